"""A built-in, deterministic demo prompt set: varied instructions across many topics, no network.

Task templates (explain, summarise, write code, list, compare, rewrite, answer, ...) are crossed
with topics; a seeded shuffle orders them, and a hash of each prompt assigns it to the training or
the held-out evaluation split, so the two never share a prompt whatever the seed.
"""

from __future__ import annotations

import hashlib
import random

TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "volcanoes", "plate tectonics", "the immune system",
    "vaccines", "DNA replication", "climate change", "renewable energy", "solar panels", "wind turbines",
    "electric cars", "batteries", "the internet", "email", "encryption", "passwords", "cloud computing",
    "databases", "sorting algorithms", "binary search", "recursion", "hash tables", "linked lists",
    "machine learning", "neural networks", "language models", "speculative decoding", "GPUs", "compilers",
    "operating systems", "version control", "unit testing", "code review", "open source software",
    "the Roman Empire", "the printing press", "the Industrial Revolution", "ancient Egypt", "the Silk Road",
    "the French Revolution", "the Moon landing", "the Renaissance", "democracy", "taxes", "inflation",
    "interest rates", "supply and demand", "budgeting", "saving for retirement", "starting a small business",
    "marketing", "job interviews", "writing a resume", "public speaking", "time management", "remote work",
    "team meetings", "negotiation", "learning a new language", "studying for exams", "reading habits",
    "sleep", "healthy breakfast", "drinking water", "running", "yoga", "meditation", "stress", "gardening",
    "composting", "houseplants", "baking bread", "making pasta", "coffee", "tea", "chocolate", "pizza",
    "dogs", "cats", "bees", "whales", "penguins", "forests", "deserts", "oceans", "rivers", "mountains",
    "rainbows", "thunderstorms", "snow", "earthquakes", "the solar system", "Mars", "telescopes",
    "bicycles", "trains", "airplanes", "bridges", "skyscrapers", "recycling", "plastic pollution",
    "museums", "libraries", "chess", "football", "the Olympics", "music theory", "the piano", "jazz",
    "photography", "painting", "poetry", "short stories", "friendship", "kindness", "moving to a new city",
]  # fmt: skip

TASKS = [
    "Explain {topic} in simple terms.",
    "Explain {topic} to a ten-year-old.",
    "What is the most important thing to know about {topic}?",
    "Give me three interesting facts about {topic}.",
    "List five key terms related to {topic} and define each one briefly.",
    "Write a short paragraph about {topic}.",
    "Write a haiku about {topic}.",
    "Write a four-line poem about {topic}.",
    "Summarise the main ideas of {topic} in two sentences.",
    "Summarise the following text in one sentence: {passage}",
    "Rewrite the following sentence to make it clearer: {passage}",
    "Rewrite this text in a more formal tone: {passage}",
    "Compare {topic} and {other}. How are they similar and how are they different?",
    "What are the pros and cons of {topic}?",
    "Give me a step-by-step guide to getting started with {topic}.",
    "What are common misconceptions about {topic}?",
    "Write a Python function that returns a short description of {topic} as a string.",
    "Write a Python class named Note that stores a title and a text about {topic}, with a method to print it.",
    "Write a SQL query that selects all rows about {topic} from a table named articles.",
    "Write a short email inviting a colleague to a talk about {topic}.",
    "Suggest five questions a student could ask about {topic}.",
    "Answer briefly: why does {topic} matter?",
    "Create a short quiz with three multiple-choice questions about {topic}.",
    "Describe the history of {topic} in a few sentences.",
    "Give me a catchy title for a blog post about {topic}.",
    "Write a tweet about {topic}.",
    "Explain how {topic} relates to everyday life.",
    "List three books or resources someone could use to learn about {topic}.",
    "Write a two-sentence story that involves {topic}.",
    "What would change in the world if {topic} did not exist?",
]

PASSAGE_STARTS = [
    "Many people think that {topic} is complicated, but",
    "In recent years, interest in {topic} has grown because",
    "Experts who study {topic} often point out that",
    "When you first learn about {topic}, you notice that",
]
PASSAGE_ENDS = [
    "it mostly comes down to a few simple ideas that anyone can understand with some practice.",
    "it affects the daily lives of millions of people in ways they rarely notice.",
    "the details matter much less than the overall pattern, which is easy to remember.",
    "there is still a lot that we do not know, and new discoveries appear every year.",
]
EVAL_SHARE = 0.1


def render(task: str, topic: str, index: int) -> str:
    other = TOPICS[(TOPICS.index(topic) * 7 + 3) % len(TOPICS)]
    passage = (
        PASSAGE_STARTS[index % len(PASSAGE_STARTS)].format(topic=topic)
        + " "
        + PASSAGE_ENDS[(index // len(PASSAGE_STARTS)) % len(PASSAGE_ENDS)]
    )
    return task.format(topic=topic, other=other, passage=passage)


def split_of(prompt: str) -> str:
    bucket = int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "eval" if bucket < EVAL_SHARE else "train"


def all_demo_prompts() -> list[str]:
    prompts = [render(task, topic, i) for i, (task, topic) in enumerate((t, p) for t in TASKS for p in TOPICS)]
    return list(dict.fromkeys(prompts))


def demo_prompts(split: str = "train", seed: int = 0) -> list[str]:
    """The `split` ('train' or 'eval') of the demo prompt set, in a seeded order."""
    prompts = [p for p in all_demo_prompts() if split_of(p) == split]
    random.Random(seed).shuffle(prompts)
    return prompts
