"""A built-in, deterministic demo prompt set shaped like chat-assistant traffic, no network.

A drafter learns the verifier's answers to the prompts it is trained on: prompts from a handful of templates
teach it the templates, and it then falls over on the prompts people actually write. So the set is built
from prompt *families* (explanations, how-to questions, personal advice with concrete details, casual chat,
coding tasks and debugging in several languages, arithmetic and word problems, logic puzzles, creative
writing, editing, summaries, translation, lists, comparisons, role-play, extraction and classification,
factual and yes/no questions). Each family has many phrasings, filled from word lists by its own seeded
`random.Random`; most prompts then get a shape (a lowercase message without punctuation, a polite opener,
some context, or a constraint such as a word limit), and texts to work on are framed in several layouts.

Every family contributes a fixed number of distinct prompts, so the mix does not depend on how many
duplicates a family happens to draw. A seeded shuffle orders the set, so any prefix mixes all families, and a
hash of each prompt assigns it to the training or the held-out evaluation split, so the two never share a
prompt whatever the seed. The hand-written `natural:eval` and `natural:validation` prompts (data/*.jsonl)
are none of these (a generated prompt equal to one, ignoring case and spacing, is left out): those sets
measure the drafter on prompts no generator produced.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass

EVAL_SHARE = 0.1
# Draws a family may spend per prompt it owes before giving up (families with few combinations hit it).
ATTEMPTS_PER_PROMPT = 6

TOPICS = [
    # science and nature
    "photosynthesis", "black holes", "the water cycle", "volcanoes", "plate tectonics", "the immune system",
    "vaccines", "DNA replication", "climate change", "gravity", "magnetism", "static electricity",
    "the speed of light", "sound waves", "atoms", "chemical bonds", "acids and bases", "the periodic table",
    "evolution", "natural selection", "genetics", "cells", "bacteria", "viruses", "fungi", "the human heart",
    "the brain", "memory", "dreams", "sleep cycles", "the nervous system", "digestion", "hormones",
    "antibiotics", "antibiotic resistance", "the greenhouse effect", "ocean currents", "tides",
    "the ozone layer", "earthquakes", "tsunamis", "hurricanes", "tornadoes", "lightning", "clouds",
    "snowflakes", "glaciers", "coral reefs", "rainforests", "deserts", "wetlands", "food chains",
    "pollination", "bees", "ants", "bird migration", "whales", "octopuses", "dinosaurs", "fossils",
    "the Big Bang", "the solar system", "the Moon", "Mars", "Jupiter", "Saturn's rings", "comets",
    "meteor showers", "eclipses", "stars", "galaxies", "exoplanets", "the International Space Station",
    "rockets", "satellites", "telescopes", "entropy", "friction", "buoyancy", "air pressure",
    "nuclear power", "nuclear fusion", "radioactivity", "the Doppler effect", "lasers", "microscopes",
    "the scientific method", "probability", "statistics", "prime numbers", "fractions", "algebra",
    "geometry", "calculus", "infinity", "the number pi", "volcanic islands", "caves", "mushrooms",
    # technology
    "the internet", "Wi-Fi", "Bluetooth", "email", "encryption", "passwords", "two-factor authentication",
    "phishing", "cloud computing", "databases", "spreadsheets", "sorting algorithms", "binary search",
    "recursion", "hash tables", "linked lists", "machine learning", "neural networks", "language models",
    "speculative decoding", "GPUs", "compilers", "operating systems", "version control", "unit testing",
    "code review", "open source software", "APIs", "web browsers", "browser cookies", "search engines",
    "smartphones", "touchscreens", "QR codes", "GPS", "3D printing", "virtual reality", "blockchain",
    "cryptocurrency", "robots", "self-driving cars", "electric cars", "batteries", "solar panels",
    "wind turbines", "smart homes", "data privacy", "backups", "computer viruses", "the command line",
    "regular expressions", "containers", "microservices", "caching", "DNS", "IP addresses", "routers",
    "fiber optics", "5G networks", "semiconductors", "transistors", "Moore's law", "big O notation",
    "floating point numbers", "binary numbers", "Unicode", "image compression", "video streaming",
    "social media", "online advertising", "recommendation systems", "e-books", "video games", "spam filters",
    "quantum computing", "Linux", "keyboard shortcuts", "password managers",
    # history and people
    "the Roman Empire", "ancient Greece", "ancient Egypt", "the pyramids", "the printing press",
    "the Industrial Revolution", "the Silk Road", "the French Revolution", "the Moon landing",
    "the Renaissance", "the Vikings", "the Middle Ages", "medieval castles", "the samurai", "the Aztecs",
    "the Inca Empire", "the Ottoman Empire", "the Great Wall of China", "the age of exploration",
    "the American Revolution", "the abolition of slavery", "women's suffrage", "the First World War",
    "the Second World War", "the Cold War", "the fall of the Berlin Wall", "the space race",
    "the invention of the telephone", "the history of writing", "the invention of paper",
    "the history of money", "the ancient Olympics", "the Black Death", "the Great Depression",
    "the civil rights movement", "the history of medicine", "the first computers", "the history of the bicycle",
    "Shakespeare", "Leonardo da Vinci", "Marie Curie", "Isaac Newton", "Albert Einstein", "Ada Lovelace",
    "Charles Darwin", "Cleopatra", "Napoleon", "Nelson Mandela", "the Wright brothers", "Galileo",
    # society, money and work
    "democracy", "elections", "the United Nations", "human rights", "taxes", "inflation", "interest rates",
    "supply and demand", "budgeting", "saving for retirement", "index funds", "the stock market",
    "credit scores", "mortgages", "student loans", "insurance", "emergency funds", "compound interest",
    "the minimum wage", "unemployment", "globalization", "tariffs", "recessions", "central banks",
    "frugal living", "side hustles", "investing for beginners", "paying off debt", "tipping culture",
    "starting a small business", "marketing", "job interviews", "writing a resume", "public speaking",
    "time management", "remote work", "team meetings", "negotiation", "leadership", "giving feedback",
    "handling criticism", "burnout", "networking", "freelancing", "project management", "agile methods",
    "customer service", "sales", "email etiquette", "work-life balance", "procrastination", "office politics",
    "career changes", "asking for a raise", "onboarding new employees", "writing reports", "delegation",
    "mentoring", "hybrid work", "the gig economy", "labour unions", "performance reviews", "internships",
    # everyday life
    "learning a new language", "studying for exams", "reading habits", "friendship", "kindness",
    "moving to a new city", "minimalism", "decluttering", "cleaning routines", "doing laundry",
    "car maintenance", "public transport", "commuting", "parenting", "toddlers", "teenagers",
    "sibling rivalry", "weddings", "birthdays", "gift giving", "etiquette", "small talk",
    "making friends as an adult", "loneliness", "happiness", "gratitude", "habits", "motivation",
    "goal setting", "journaling", "screen time", "digital detox", "online dating", "long-distance relationships",
    "living with roommates", "volunteering", "recycling", "composting", "plastic pollution", "fast fashion",
    "sustainable living", "home repairs", "interior design", "houseplants", "gardening", "lawn care",
    "keeping chickens", "dogs", "cats", "rabbits", "goldfish", "parrots", "horses", "pet adoption",
    "dog training", "bicycles", "trains", "airplanes", "bridges", "skyscrapers", "architecture",
    # hobbies and culture
    "chess", "football", "basketball", "tennis", "cricket", "the Olympics", "marathon running", "cycling",
    "swimming", "rock climbing", "hiking", "camping", "fishing", "birdwatching", "stargazing", "photography",
    "painting", "drawing", "watercolour painting", "pottery", "knitting", "sewing", "woodworking", "origami",
    "calligraphy", "the guitar", "the piano", "music theory", "jazz", "classical music", "hip hop", "opera",
    "film noir", "animation", "comic books", "poetry", "short stories", "science fiction", "fantasy novels",
    "detective fiction", "crossword puzzles", "sudoku", "magic tricks", "stand-up comedy", "theatre",
    "ballet", "karaoke", "podcasts", "stamp collecting", "vinyl records", "museums", "libraries", "street art",
    "tattoos", "the history of fashion", "jigsaw puzzles", "skateboarding", "surfing", "yoga", "meditation",
    # food and drink
    "baking bread", "making pasta", "coffee", "tea", "chocolate", "pizza", "sushi", "fermentation",
    "sourdough starters", "cheese", "olive oil", "spices", "vegetarian cooking", "vegan diets", "meal prep",
    "knife skills", "grilling", "slow cookers", "air fryers", "food safety", "smoothies", "soups", "curries",
    "tacos", "dumplings", "ramen", "barbecue", "ice cream", "honey", "rice", "potatoes", "craft beer",
    "mocktails", "street food", "food waste", "farmers markets", "seasonal vegetables", "fresh herbs",
    # travel and places
    "travelling on a budget", "solo travel", "jet lag", "packing light", "travel insurance", "road trips",
    "cruises", "visas", "hostels", "the Alps", "the Amazon rainforest", "the Sahara", "Antarctica", "Iceland",
    "Japan", "Italy", "Mexico", "India", "Kenya", "Canada", "New Zealand", "Peru", "Norway", "national parks",
    "islands", "time zones", "maps", "the equator", "mountains", "rivers", "oceans", "lakes", "megacities",
    # health
    "running", "stress", "sleep", "nutrition", "protein", "dietary fibre", "sugar", "caffeine", "vitamins",
    "strength training", "stretching", "posture", "back pain", "headaches", "allergies", "the common cold",
    "the flu", "first aid", "CPR", "sunscreen", "skin care", "dental hygiene", "eye strain", "hearing loss",
    "mental health", "anxiety", "mindfulness", "breathing exercises", "walking", "ageing", "blood pressure",
    "cholesterol", "diabetes", "heart health", "gut bacteria", "intermittent fasting", "hydration",
]

# People, places and things the templates are filled with.
NAMES = [
    "Ana", "Ben", "Chloe", "Daniel", "Emma", "Farid", "Grace", "Hiro", "Isabel", "Jamal", "Kate", "Liam", "Maya",
    "Noah", "Olga", "Priya", "Quentin", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Ximena", "Yusuf", "Zoe",
    "Marco", "Leila", "Tom", "Aisha", "Jonas", "Mei", "Carlos", "Ingrid", "Kofi", "Nadia", "Oscar", "Sofia",
    "Ravi", "Hannah", "Pablo", "Elif", "Dmitri", "Amara", "Felix", "Lucia", "Ahmed", "Nora", "Kenji", "Beatriz",
]
SURNAMES = [
    "Garcia", "Okafor", "Lindqvist", "Tanaka", "Novak", "Schmidt", "Rossi", "Kowalski", "Haddad", "Murphy",
    "Chen", "Dubois", "Silva", "Patel", "Moreau", "Jensen", "Nguyen", "Fischer", "Costa", "Mensah", "Ivanova",
    "Yilmaz", "Kim", "Alvarez", "Byrne", "Sato", "Hansen", "Mwangi", "Rahman", "Walsh",
]
CITIES = [
    "Lisbon", "Toronto", "Osaka", "Nairobi", "Melbourne", "Denver", "Glasgow", "Lyon", "Krakow", "Austin", "Seoul",
    "Mexico City", "Berlin", "Chicago", "Dublin", "Cape Town", "Vancouver", "Bangalore", "Barcelona", "Manchester",
    "Singapore", "Portland", "Helsinki", "Buenos Aires", "Atlanta", "Istanbul", "Prague", "Auckland", "Montreal",
    "Amsterdam", "Rome", "Boston", "Phoenix", "Edinburgh", "Copenhagen", "Hanoi", "Lima", "Vienna", "Seattle",
    "Athens", "Marseille", "Leeds", "Porto", "Valencia", "Munich", "Kyoto", "Taipei", "Bogota", "Accra", "Perth",
]
JOBS = [
    "nurse", "software developer", "primary school teacher", "electrician", "accountant", "graphic designer",
    "chef", "truck driver", "pharmacist", "barista", "civil engineer", "paramedic", "lawyer", "dental hygienist",
    "warehouse worker", "marketing manager", "librarian", "physiotherapist", "carpenter", "sales assistant",
    "web designer", "bus driver", "social worker", "lab technician", "hotel receptionist", "police officer",
    "architect", "freelance translator", "bookkeeper", "veterinary nurse", "plumber", "call centre agent",
    "university lecturer", "UX researcher", "project manager", "hairdresser", "security guard", "pilot",
]
RELATIVES = [
    "mom", "dad", "sister", "brother", "grandmother", "grandfather", "aunt", "uncle", "cousin", "best friend",
    "partner", "wife", "husband", "son", "daughter", "roommate", "neighbour", "boss", "coworker", "girlfriend",
    "boyfriend", "niece", "nephew", "stepdad", "mother-in-law", "childhood friend",
]
HOBBIES = [
    "painting", "rock climbing", "baking", "chess", "birdwatching", "running", "photography", "knitting",
    "gardening", "board games", "cycling", "playing the guitar", "pottery", "swimming", "woodworking", "yoga",
    "hiking", "drawing comics", "learning Japanese", "salsa dancing", "fishing", "coding", "reading sci-fi",
    "video games", "skateboarding", "singing in a choir", "camping", "cooking curries", "origami", "tennis",
]
SKILLS = [
    "Spanish", "the piano", "touch typing", "public speaking", "Excel", "basic car repair", "sketching",
    "photography", "Python", "sewing", "juggling", "sign language", "chess openings", "bread baking", "swimming",
    "video editing", "knitting", "meditation", "drawing portraits", "woodworking", "statistics", "web design",
    "the ukulele", "first aid", "calligraphy", "Italian cooking", "budgeting", "SQL", "rock climbing", "Portuguese",
]
FOODS = [
    "lasagne", "pancakes", "lentil soup", "chicken curry", "banana bread", "fried rice", "guacamole", "hummus",
    "risotto", "falafel", "chili con carne", "apple pie", "mac and cheese", "stir-fried noodles", "shakshuka",
    "tomato sauce", "granola", "brownies", "pad thai", "beef stew", "vegetable lasagne", "fish tacos", "pesto",
    "carrot cake", "miso soup", "roast chicken", "potato salad", "omelette", "dumplings", "paella",
]
INGREDIENTS = [
    "chickpeas", "a tin of tomatoes", "leftover rice", "two potatoes", "a bag of spinach", "some feta",
    "half a cabbage", "frozen peas", "three carrots", "a block of tofu", "some chicken thighs", "a can of tuna",
    "pasta", "a few mushrooms", "an aubergine", "some lentils", "a courgette", "a bunch of coriander", "bread",
    "sweet potatoes", "a tub of yoghurt", "a red pepper", "some cheddar", "a can of coconut milk", "noodles",
]
HUMAN_LANGUAGES = [
    "Spanish", "French", "German", "Italian", "Portuguese", "Dutch", "Japanese", "Chinese", "Korean", "Polish",
    "Swedish", "Turkish", "Greek", "Russian", "Hindi", "Arabic", "Vietnamese", "Indonesian", "Czech", "Danish",
    "Norwegian", "Finnish", "Swahili", "Hebrew", "Thai", "Ukrainian",
]
AUDIENCES = [
    "a ten-year-old", "my grandmother", "a complete beginner", "a high school student", "someone who hates maths",
    "a new employee", "a busy manager", "a curious kid", "a first-year university student", "a friend over coffee",
    "someone learning English", "a room of engineers", "a retired farmer", "a teenager", "an artist",
]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November",
    "December",
]
TONES = [
    "funny", "melancholic", "hopeful", "dramatic", "whimsical", "formal", "sarcastic", "heartfelt", "spooky",
    "calm", "upbeat", "nostalgic", "mysterious", "playful", "serious",
]
CHARACTERS = [
    "a retired lighthouse keeper", "a nervous dragon", "a teenage inventor", "a grumpy baker", "a lost robot vacuum",
    "a time-travelling librarian", "two rival gardeners", "an astronaut on her last mission", "a talking umbrella",
    "a street musician", "a shy ghost", "a very old tortoise", "a chef who has lost his sense of taste",
    "a mail carrier", "a cat burglar who only steals spoons", "a knight who is terrible with swords",
    "a girl who can talk to birds", "a sleepy bear", "a wizard who forgot all his spells", "a lonely satellite",
    "a detective with a fear of heights", "twin sisters who never agree", "a dog who wants to be a firefighter",
    "a bus driver on his final shift", "a houseplant with big dreams", "a small-town mayor", "a retired spy",
    "a penguin who hates the cold", "a nervous first-time teacher", "an old fisherman",
]
SETTINGS = [
    "a snowy mountain village", "a space station orbiting Jupiter", "a busy night market", "a flooded city",
    "a laundromat at midnight", "a desert oasis", "a school on the last day of term", "an underwater hotel",
    "a lighthouse during a storm", "a tiny island with one shop", "a city where it never stops raining",
    "a crowded airport on Christmas Eve", "an abandoned amusement park", "a food truck festival", "a hospital ward",
    "a library that never closes", "a farm at harvest time", "a ferry crossing a foggy lake", "a rooftop garden",
    "a village at the edge of a forest", "a research base in Antarctica", "a jazz club in the 1950s",
]


@dataclass(frozen=True)
class Family:
    """A kind of prompt: `count` distinct prompts are drawn from `make`, with a `random.Random` seeded by `name`."""

    name: str
    count: int
    make: Callable[[random.Random], str]


def choice_of(options: list[str]) -> Callable[[random.Random], str]:
    return lambda rng: rng.choice(options)


def number(low: int, high: int) -> Callable[[random.Random], str]:
    return lambda rng: str(rng.randint(low, high))


def money(low: int, high: int, step: int = 1) -> Callable[[random.Random], str]:
    return lambda rng: f"${rng.randrange(low, high + 1, step):,}"


def clock_time(rng: random.Random) -> str:
    """A time of day when people do things (7 am to 9 pm)."""
    hour, minute = rng.randint(7, 21), rng.choice(["00", "05", "10", "15", "20", "30", "40", "45", "50", "55"])
    return f"{(hour - 1) % 12 + 1}:{minute} {'am' if hour < 12 else 'pm'}"


def full_name(rng: random.Random) -> str:
    return f"{rng.choice(NAMES)} {rng.choice(SURNAMES)}"


def ordinal(number: int) -> str:
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


def date_text(rng: random.Random) -> str:
    """A date in one of the forms people write them in."""
    day, month, year = rng.randint(1, 28), rng.randrange(12), rng.randint(2019, 2026)
    forms = [
        f"{MONTHS[month]} {day}", f"{day} {MONTHS[month]} {year}", f"{MONTHS[month]} {day}, {year}",
        f"{year}-{month + 1:02d}-{day:02d}", f"{day}/{month + 1}/{year}", f"the {ordinal(day)} of {MONTHS[month]}",
        f"next {rng.choice(WEEKDAYS)}", f"{rng.choice(WEEKDAYS)} the {ordinal(day)}",
    ]
    return rng.choice(forms)


def capitalised(text: str) -> str:
    return text[:1].upper() + text[1:]


# Template fields -> how to fill them. A field with a trailing digit ({city2}) is filled like the field without
# it ({city}), with a different value.
FILLERS: dict[str, Callable[[random.Random], str]] = {
    "topic": choice_of(TOPICS),
    "name": choice_of(NAMES),
    "full_name": full_name,
    "city": choice_of(CITIES),
    "job": choice_of(JOBS),
    "relative": choice_of(RELATIVES),
    "family_member": choice_of(["mom", "dad", "sister", "brother", "grandmother", "son", "daughter", "partner"]),
    "hobby": choice_of(HOBBIES),
    "skill": choice_of(SKILLS),
    "food": choice_of(FOODS),
    "ingredient": choice_of(INGREDIENTS),
    "language": choice_of(HUMAN_LANGUAGES),
    "audience": choice_of(AUDIENCES),
    "weekday": choice_of(WEEKDAYS),
    "month": choice_of(MONTHS),
    "tone": choice_of(TONES),
    "character": choice_of(CHARACTERS),
    "setting": choice_of(SETTINGS),
    "time": clock_time,
    "date": date_text,
    "age": number(18, 74),
    "milestone": choice_of(["18th", "21st", "30th", "40th", "50th", "60th", "70th", "80th"]),
    "kid_age": number(3, 15),
    "n": number(3, 7),
    "big_n": number(10, 60),
    "years": number(2, 25),
    "work_hours": number(35, 60),
    "words": lambda rng: str(rng.choice([50, 80, 100, 120, 150, 200, 250, 300])),
    "lines": number(4, 16),
    "year": number(1995, 2024),
    "percent": lambda rng: str(rng.choice([3, 5, 8, 10, 12, 15, 20, 25, 30, 35, 40, 45, 60, 75])),
    "income": money(1400, 9000, 50),
    "budget": money(50, 3000, 25),
    "small_budget": money(15, 150, 5),
    "price": lambda rng: f"${rng.randint(2, 250)}.{rng.choice(['00', '49', '50', '95', '99'])}",
}
FORMATTER = string.Formatter()
# "a" before a filled-in word or number that starts with a vowel sound ("a electrician", "a 18-year-old").
A_BEFORE_VOWEL = re.compile(r"\b([Aa]) (?=[aioAIO]|[eE](?!u)|u(?!ni|s[eu])|8|1[18](?!\d))")


@functools.cache
def fields_of(template: str) -> tuple[str, ...]:
    return tuple(field for _, field, _, _ in FORMATTER.parse(template) if field)


def fill(rng: random.Random, template: str, **given: str) -> str:
    """`template` with every field drawn from FILLERS (or taken from `given`); same field, same value."""
    values = dict(given)
    for field in fields_of(template):
        if field in values:
            continue
        base = field.rstrip(string.digits)
        value = FILLERS[base](rng)
        for _ in range(20):  # a numbered field differs from the others of its kind ("from Lyon to Lyon")
            if base == field or value not in values.values():
                break
            value = FILLERS[base](rng)
        values[field] = fill(rng, value) if "{" in value else value  # filler values may hold fields too
    return A_BEFORE_VOWEL.sub(r"\1n ", template.format(**values))


# --- shapes: the same request as people type it -------------------------------------------------------------

CONSTRAINTS = [
    "Keep it under {words} words.", "Use bullet points.", "Answer in one sentence.", "Keep it short.",
    "Please be concise.", "No more than three sentences.", "Use simple words.", "Give an example.",
    "Explain your reasoning.", "Use a numbered list.", "Make it fun to read.", "Be specific.", "Avoid jargon.",
    "End with one practical tip.", "Give me the short version first, then the details.", "Two paragraphs max.",
    "Write it for a complete beginner.", "Use a friendly tone.", "Please don't use bullet points.",
    "I only need the main points.", "Include a quick example from everyday life.", "Answer like a teacher would.",
]
GENERAL_CONTEXTS = [
    "I've been curious about this for a while.", "English is my second language, so simple words please.",
    "I'm {age} and never learned this properly.", "I have about five minutes to read the answer.",
    "I'm a complete beginner.", "I'm on my phone, so a short answer helps.", "Asking for a friend, honestly.",
]
# Reasons to learn about a subject, for explanations.
LEARNING_CONTEXTS = [
    *GENERAL_CONTEXTS, "I'm a {job} and this keeps coming up at work.", "This is for a school project.",
    "I'm preparing a short talk for my team.", "My {family_member} asked me and I didn't know.",
    "I'm studying for an exam next {weekday}.", "I'm writing a blog post.", "I'm helping my {child} with homework.",
    "We argued about this at dinner last night.",
]
OPENERS = [
    "Hi! ", "Hello, ", "Hey, ", "Quick question: ", "Hi there. ", "Good morning! ", "Can you help me? ",
    "Hey there, quick one. ", "Hello! I need some help. ", "Random question: ", "Okay, so ", "Hi, ",
]
CLOSERS = ["Thanks!", "Thank you.", "Thanks in advance.", "Much appreciated!", "Thanks a lot.", "Cheers."]
CASUAL_ENDINGS = ["", "", "", " pls", " lol", "??", " thx", " haha", " :)"]


def decapitalised(text: str) -> str:
    """The text with a lowercase first letter, unless its first word is "I", a name or an acronym."""
    first = re.split(r"[ ,:'.]", text, maxsplit=1)[0]
    if first == "I" or first in PROPER_WORDS or first[1:2].isupper():
        return text
    return text[:1].lower() + text[1:]


def casual(rng: random.Random, text: str) -> str:
    """A lowercase message without final punctuation, sometimes with dropped apostrophes and "u" for "you"."""
    text = text.lower().rstrip(".?!")
    if rng.random() < 0.5:
        text = text.replace("'", "")
    if rng.random() < 0.3:
        text = re.sub(r"\byou\b", "u", text)
    return text + rng.choice(CASUAL_ENDINGS)


def followed(prompt: str, sentence: str) -> str:
    """The prompt and one more sentence; after a message without final punctuation, as part of its sentence."""
    if prompt.endswith((".", "?", "!", ")")):
        return f"{prompt} {sentence}"
    return f"{prompt}, {decapitalised(sentence)}"


def shaped(
    rng: random.Random,
    prompt: str,
    constraints: list[str] | None = None,
    contexts: list[str] | None = None,
) -> str:
    """The prompt as one of several shapes: casual, constrained, with context, polite, or as it is."""
    constraints = CONSTRAINTS if constraints is None else constraints
    contexts = GENERAL_CONTEXTS if contexts is None else contexts
    roll = rng.random()  # about half keep their plain form, as most real prompts are plain requests
    if roll < 0.12:
        return casual(rng, prompt)
    if roll < 0.30 and constraints:
        return followed(prompt, fill(rng, rng.choice(constraints)))
    if roll < 0.38 and contexts:
        context = fill(rng, rng.choice(contexts))
        return f"{context} {prompt}" if rng.random() < 0.5 else followed(prompt, context)
    if roll < 0.46:
        return rng.choice(OPENERS) + decapitalised(prompt)
    if roll < 0.52:
        return followed(prompt, rng.choice(CLOSERS))
    return prompt


QUESTION_WORDS = {"What", "What's", "Which", "Who", "Is", "How", "Can", "Could", "Why", "Where"}


def framed(rng: random.Random, instruction: str, text: str) -> str:
    """An instruction about a text, in one of the layouts people paste texts in."""
    instruction = instruction.rstrip(":.")
    end = "?" if instruction.split()[0] in QUESTION_WORDS else "."
    layouts = [
        f'{instruction}: "{text}"',
        f"{instruction}:\n\n{text}",
        f"{instruction}{end}\n\n{text}",
        f"{text}\n\n{instruction}{end}",
        f'"{text}"\n\n{decapitalised(instruction)}{end}',
        f'{instruction}:\n"""\n{text}\n"""',
    ]
    return rng.choices(layouts, weights=[4, 3, 1, 2, 1, 1])[0]


def from_templates(templates: list[str], contexts: list[str] | None = None) -> Callable[[random.Random], str]:
    def make(rng: random.Random) -> str:
        return shaped(rng, fill(rng, rng.choice(templates)), contexts=contexts)

    return make


# --- explanations, how-to questions and advice ------------------------------------------------------------------

EXPLAIN_TEMPLATES = [
    "Explain {topic} in simple terms.", "Explain {topic} to {audience}.", "Explain {topic} like I'm five.",
    "Explain how {topic} relates to everyday life.", "Can you explain {topic}?",
    "In a nutshell, what should I know about {topic}?",
    "How would you explain {topic} to {audience}?", "I never really understood {topic}. Can you walk me through it?",
    "what's the deal with {topic}", "Give me three interesting facts about {topic}.", "tell me about {topic}",
    "What are the most common misconceptions about {topic}?", "Why should anyone care about {topic}?",
    "Describe the history of {topic} in a few sentences.", "What should a beginner know about {topic}?",
    "Write a short paragraph about {topic}.", "I have a quiz on {topic} tomorrow. What are the key ideas?",
    "My {relative} asked me about {topic} and I had no idea what to say. How would you explain it?",
    "What is the most surprising thing about {topic}?", "Give me a one-paragraph overview of {topic}.",
    "Teach me something about {topic} that I probably don't know.",
    "What's one thing everyone gets wrong about {topic}?",
    "List {n} key terms related to {topic} and define each one briefly.", "Why do people find {topic} so interesting?",
    "Create a short quiz with three multiple-choice questions about {topic}.",
    "How did people first learn about {topic}?",
    "Suggest {n} questions a student could ask about {topic}.", "Summarise the main ideas of {topic} in two sentences.",
    "Write a short explainer on {topic} for a school newsletter.", "What would a good first lesson on {topic} cover?",
    "Can you give me an analogy that explains {topic}?", "In plain English, what's the idea behind {topic}?",
"ELI5: {topic}", "So what's the big deal about {topic}?",
]

HOW_TO_GOALS = [
    "fix a leaky tap", "get rid of fruit flies in the kitchen", "make cold brew coffee at home",
    "unclog a bathroom sink", "remove a red wine stain from a carpet", "keep basil alive on a windowsill",
    "change a flat tyre on a bike", "start a vegetable garden on a balcony", "sharpen a kitchen knife",
    "make a simple budget", "back up the photos on my phone", "set up a home Wi-Fi network",
    "write a good cover letter", "prepare for a long flight", "make friends in a new city",
    "stop my glasses from fogging up", "paint a room without making a mess", "cook rice without a rice cooker",
    "wake up earlier without feeling terrible", "plan a week of healthy lunches", "learn to juggle",
    "get better at chess", "fall asleep faster", "clean a cast iron pan", "descale a kettle", "hang a heavy mirror",
    "negotiate the price of a used bike", "write a short speech", "train my dog to come when called",
    "say no to extra work politely", "read more books", "start journaling", "organise a messy garage",
    "make my phone battery last longer", "prepare for a marathon", "take better photos with my phone",
    "improve my handwriting", "make a sourdough starter", "keep a conversation going", "stop biting my nails",
    "brew a good cup of green tea", "pick a ripe avocado", "freeze fresh herbs", "fold a fitted sheet",
    "get a splinter out", "save money on groceries", "lower my electricity bill", "write a haiku",
    "run a good meeting", "start investing with a small amount", "fix a squeaky door", "tie a tie",
    "plan a surprise party", "care for a succulent", "stay focused while working from home", "memorise a speech",
    "learn the basics of music theory", "make pizza dough from scratch", "set up a fish tank", "clean my keyboard",
    "make my own salad dressing", "keep a sourdough starter alive while I travel", "do a proper push-up",
    "build a simple website", "get started with birdwatching", "write a thank-you note", "patch a hole in drywall",
    "reduce my screen time", "sleep better in hot weather", "choose a good watermelon", "calm down before an exam",
    "stop procrastinating on small tasks", "set boundaries with a friend", "get into running after an injury",
    "teach a child to ride a bike", "make a cheap bookshelf", "grow tomatoes from seed", "clean white sneakers",
    "cook a steak in a pan", "boil an egg so the yolk is soft", "make an emergency kit", "fix a zipper",
    "get better at drawing faces", "prepare for a salary negotiation", "plan a road trip", "make better coffee at home",
]
HOW_TO_TEMPLATES = [
    "How do I {goal}?", "What's the best way to {goal}?", "how can i {goal}", "how to {goal}",
    "Give me step-by-step instructions to {goal}.", "I've never tried to {goal} before. Where do I start?",
    "Is there an easy way to {goal}?", "Can you explain how to {goal}?",
    "Any tips to {goal}?", "I'm trying to {goal}. Any advice?",
    "What are the common mistakes when people try to {goal}?",
    "Walk me through how to {goal}.", "Explain how to {goal}, step by step.", "I want to {goal}. What's the plan?",
    "What's the fastest way to {goal}?", "I keep failing to {goal}. What am I doing wrong?",
    "Write a short guide on how to {goal}.", "List the steps to {goal}.", "Help me {goal}.",
]


def how_to(rng: random.Random) -> str:
    return shaped(rng, fill(rng, rng.choice(HOW_TO_TEMPLATES), goal=rng.choice(HOW_TO_GOALS)))


ADVICE_TEMPLATES = [
    "I'm {age} and work as a {job} in {city}. I take home about {income} a month. How should I start saving for"
    " {saving_goal}?",
    "I'm moving from {city} to {city2} in {month} for a new job. What should I sort out before the move?",
    "I have {budget} to spend on {purchase}. What should I look for?",
    "My {relative} is turning {age} next week and my budget is {small_budget}. Any gift ideas? They love {hobby}.",
    "I work night shifts as a {job} and I can never sleep properly during the day. What can I try?",
    "I'm a {age}-year-old {job} and I'm thinking about retraining as a {job2}. Is that realistic?",
    "My {coworker} {coworker_problem}. How should I handle it?",
    "I have {n} weeks until my {exam} exam and I've barely started. How should I plan my studying?",
    "I sit at a desk for about {work_hours} hours a week and my back is always stiff. What small changes could help?",
    "I have about {n} hours a week of free time. How could I learn {skill} with that?",
    "We're a family of {n} with a grocery budget of {budget} a month. How can we eat well on that?",
    "I'm visiting {city} for {n} days in {month}. What should I plan for?",
    "My {kid_age}-year-old {child} {child_problem}. How can I help?",
    "I got a job offer as a {job} in {city} that pays more, but I'd have to {tradeoff}. How should I decide?",
    "I owe {debt} on a credit card and have {savings} in savings. Should I pay the card off first?",
    "My {plant} has {plant_symptom}. What's going on and how do I fix it?",
    "How do I tell my {relative} that {hard_message}?",
    "I'm nervous about {nervous_event} next {weekday}. How can I prepare?",
    "My partner wants to move to {city} and I want to stay in {city2}. How do we even start that conversation?",
    "I'm {age} and I've never done any exercise. What's a sensible way to start?",
    "I just started as a {job} and I feel like I know nothing. How do I survive the first month?",
    "I have {income} a month after tax and rent takes half of it. Is that normal, and what can I do?",
    "My {relative} keeps giving me unsolicited advice about {life_area}. How do I respond without a fight?",
    "I want to adopt a {pet_kind} but I work {work_hours} hours a week. Would that be fair to the animal?",
    "I'm planning a {n}-day trip to {city} with two kids aged {kid_age} and {kid_age2}. Any advice?",
    "I've been a {job} for {years} years and I'm bored. How do I figure out what to do next?",
    "I'm hosting {big_n} people for dinner on {weekday} and one is vegan. What could I cook for everyone?",
    "I have {ingredient}, {ingredient2} and {ingredient3} in the fridge. What can I make for dinner?",
    "I keep spending too much on takeaway, about {small_budget} a week. How do I stop?",
    "I'm {age}, I live in {city} and I want to buy my first car for under {budget}. New or used?",
    "My roommate never cleans the kitchen. We split rent in {city} and I don't want to move out. What do I say?",
    "I want to run {race} in {month}. I can currently run about {n} km. Is that enough time to train?",
    "Our team of {n} {job}s has a new manager who cancels every one-on-one. Should we raise it with someone?",
    "I'm a student in {city} with {small_budget} a week for food. What cheap meals can I make?",
    "I'm {age} and I want to start saving for retirement with {small_budget} a month. Is it even worth it?",
]
FILLERS.update({
    "saving_goal": choice_of(["a house deposit", "a wedding", "a new car", "a year of travel", "retirement",
                              "an emergency fund", "my kids' education", "a sabbatical", "a new laptop"]),
    "purchase": choice_of(["a laptop for university", "a road bike", "a sofa", "a used car", "a camera",
                           "a mattress", "running shoes", "a coffee machine", "a gaming PC", "a tent", "a TV",
                           "a pair of hiking boots", "a desk chair", "an e-reader", "a washing machine"]),
    "coworker": choice_of(["coworker", "manager", "team lead", "desk neighbour", "new colleague"]),
    "coworker_problem": choice_of([
        "takes credit for my work in meetings", "keeps scheduling calls during my lunch break",
        "talks loudly on the phone all day", "replies to every email with 'per my last email'",
        "asks me to cover their shifts almost every week", "never answers messages until the last minute",
        "criticises my work in front of clients", "keeps borrowing my stapler and never returns it",
        "sends me work messages at midnight", "interrupts me whenever I speak in meetings"]),
    "exam": choice_of(["driving theory", "biology", "accounting", "statistics", "final chemistry", "bar",
                       "nursing licensing", "history", "calculus", "German B1", "AWS certification"]),
    "child": choice_of(["son", "daughter", "kid", "stepson", "stepdaughter"]),
    "child_problem": choice_of([
        "refuses to do homework", "is scared of going to the dentist", "gets angry when losing at games",
        "won't eat anything green", "has trouble making friends at school", "spends hours on a tablet",
        "is being teased about their glasses", "can't fall asleep before midnight", "wants a phone already",
        "says school is boring every single day", "keeps lying about small things"]),
    "tradeoff": choice_of(["commute for an hour each way", "move away from my family", "work most weekends",
                           "give up remote work", "take a less senior title", "travel two weeks a month"]),
    "debt": money(800, 12000, 100),
    "savings": money(500, 20000, 100),
    "plant": choice_of(["monstera", "peace lily", "snake plant", "basil plant", "fiddle leaf fig", "orchid",
                        "pothos", "rosemary bush", "lemon tree", "spider plant", "jade plant", "aloe vera"]),
    "plant_symptom": choice_of(["brown crispy tips on the leaves", "drooping stems even though I water it",
                                "white spots on the leaves", "leaves that are curling inward",
                                "tiny flies around the soil", "no new growth for months",
                                "soft, mushy stems near the soil", "pale, washed-out leaves"]),
    "hard_message": choice_of([
        "I can't lend them money again", "I won't be home for the holidays this year", "I'm changing careers",
        "I don't want to be the one who always hosts", "their jokes about my job hurt", "I'm moving abroad",
        "I need more time to myself", "I'm not going to their wedding", "I've decided to drop out of my course"]),
    "nervous_event": choice_of(["a presentation to the whole company", "my first driving lesson",
                                "meeting my partner's parents", "a big family dinner", "a dentist appointment",
                                "my first day at a new school", "a performance review", "a piano recital",
                                "giving a eulogy", "a first date"]),
    "life_area": choice_of(["my career", "how I raise my kids", "my diet", "my spending", "my wedding plans"]),
    "pet_kind": choice_of(["dog", "puppy", "cat", "pair of rabbits", "rescue greyhound", "kitten"]),
    "race": choice_of(["a half marathon", "a 10k", "a marathon", "a 5k", "a trail race"]),
})

PET_PROBLEMS = {
    "dog": ["barks at every noise at night", "pulls on the lead during walks", "chews the furniture when I'm out",
            "jumps on visitors", "eats so fast that he sometimes throws up", "is scared of the vacuum cleaner",
            "won't stop begging at the table", "growls when anyone goes near her food bowl"],
    "cat": ["scratches the sofa", "wakes me up at 5 a.m. every day", "has stopped using the litter box",
            "knocks things off the shelves", "hides under the bed when guests come", "bites me when I stroke her",
            "meows all night", "won't touch her new food"],
    "rabbit": ["chews the cables", "thumps at night", "won't let me pick him up", "ignores his hay"],
    "parrot": ["screams every morning", "pulls out her feathers", "bites when I offer my hand",
               "copies the phone ringtone all day"],
}
PET_NAMES = ["Biscuit", "Luna", "Max", "Pepper", "Milo", "Coco", "Bruno", "Nala", "Ziggy", "Olive", "Rocky", "Mochi"]


def pet_advice(rng: random.Random) -> str:
    kind = rng.choice(list(PET_PROBLEMS))
    problem, pet_name, age = rng.choice(PET_PROBLEMS[kind]), rng.choice(PET_NAMES), rng.randint(1, 12)
    prompts = [
        f"My {kind} {problem}. {pet_name} is {age} years old. What can I do?",
        f"my {kind} {pet_name} {problem}, any ideas how to stop it",
        f"How do I get my {kind} to stop doing this? {pet_name} {problem} and it's driving me mad.",
        f"We adopted a {age}-year-old {kind} called {pet_name} last month. Now {pet_name} {problem}. Is this normal?",
        f"Is it normal that my {kind} {problem}? {pet_name} is {age}.",
    ]
    return shaped(rng, rng.choice(prompts))


# --- casual chat ------------------------------------------------------------------------------------------------

CHAT_TEMPLATES = [
    "hey", "hi there! how's your day going", "good morning! what should I have for breakfast?",
    "i'm bored, tell me a fun fact about {topic}", "Tell me a joke about {topic}.", "do you like {topic}?",
    "What would you do with a free afternoon in {city}?", "guess what, I just {achievement}!",
    "I can't decide between {food} and {food2} for dinner tonight. Help me choose.",
    "ugh, {complaint}", "can we just chat for a bit? {mood_line}",
    "What's something interesting you know about {topic}?", "Hi, I'm {name}. I'm a {job} from {city}. What can you do?",
    "Would you rather {would_a} or {would_b}?", "It's {weather} here in {city}. What should I do today?",
    "I just watched a documentary about {topic} and I can't stop thinking about it.",
    "what's your favourite {favourite_thing}", "Do you ever get tired of answering questions?",
    "I just started {hobby} and I love it. Any tips for a beginner?", "Say something nice, I'm having a {bad_day} day.",
    "my {relative} says {opinion_claim}. who's right?", "Is it normal to {habit}?",
    "i have {n} hours to kill at the airport in {city}. ideas?", "What's a good name for a {pet_kind}?",
    "Okay, random thought: why is {topic} so interesting to people?", "hello!! what's new with you",
    "Do you know any good riddles?", "Recommend me something to do this {weekday} evening. I like {hobby}.",
    "I finally finished {finished_thing}. What should I start next?", "Good night! Any tips for falling asleep?",
    "I'm {age} today!", "What's the weirdest fact you know?",
    "Can you tell me a short story to cheer me on? {mood_line}",
    "honestly what do you think about {topic}", "I'm learning {skill}. Quiz me with one easy question.",
    "Let's play twenty questions. I'm thinking of an animal.", "hi can u help me with something",
    "It's my first day as a {job} tomorrow!", "What should I name my new {plant}?", "Tell me a fun fact about {city}.",
]
FILLERS.update({
    "achievement": choice_of(["passed my driving test", "ran my first 5k", "got the job", "finished my thesis",
                              "baked my first loaf of bread", "got engaged", "paid off my student loan",
                              "adopted a kitten", "learned to do a handstand", "fixed my own bike"]),
    "complaint": choice_of(["my train got cancelled again", "it's raining and I forgot my umbrella",
                            "my laptop just died in the middle of an essay", "the neighbours are drilling again",
                            "I spilled coffee on my white shirt", "mondays are the worst",
                            "my code has been broken for three hours", "I burned the toast"]),
    "mood_line": choice_of(["I'm feeling a bit lonely tonight.", "I had a great day and want to share it.",
                            "I can't focus on anything.", "I'm procrastinating, honestly.", "Work was long.",
                            "I'm waiting for a bus and have nothing to read."]),
    "would_a": choice_of(["live by the sea", "be able to fly", "speak every language", "never need sleep",
                          "have a personal chef", "travel to the past", "live in a big city"]),
    "would_b": choice_of(["live in the mountains", "be invisible", "play every instrument", "never feel cold",
                          "have a personal driver", "travel to the future", "live on a quiet farm"]),
    "weather": choice_of(["sunny and warm", "pouring with rain", "freezing", "foggy", "really windy", "humid"]),
    "favourite_thing": choice_of(["book", "colour", "season", "animal", "movie genre", "food", "word",
                                  "planet", "type of music", "number"]),
    "bad_day": choice_of(["bad", "rough", "long", "weird", "stressful", "boring"]),
    "opinion_claim": choice_of(["pineapple belongs on pizza", "cats are smarter than dogs",
                                "you should never wake a sleeping baby", "cold showers are good for you",
                                "tomatoes are a vegetable", "reading on a screen ruins your eyes",
                                "you lose most body heat through your head"]),
    "habit": choice_of(["talk to my plants", "reread the same book every year", "eat breakfast at noon",
                        "need music to concentrate", "hate the sound of people chewing",
                        "rehearse conversations in my head", "sleep with socks on", "name my houseplants"]),
    "finished_thing": choice_of(["a 1000-piece jigsaw", "a long fantasy series", "my first knitted scarf",
                                 "a TV show I loved", "a language course", "a big work project"]),
})


def chat(rng: random.Random) -> str:
    prompt = fill(rng, rng.choice(CHAT_TEMPLATES))
    return casual(rng, prompt) if rng.random() < 0.25 else prompt


# --- coding: tasks across languages, concept questions, SQL, shell and debugging ---------------------------------

CODE_LANGUAGES = ["Python", "Python", "Python", "JavaScript", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C",
                  "C++", "C#", "Ruby", "Kotlin"]
CODE_SPECS = [
    ("count_vowels", "count the vowels in a string"),
    ("average", "return the average of a list of numbers, or nothing for an empty list"),
    ("top_words", "find the {n} most common words in a text"),
    ("merge_counts", "merge two dictionaries, adding up the values of keys they share"),
    ("chunk", "split a list into chunks of {n} items"),
    ("celsius_to_fahrenheit", "convert a temperature from Celsius to Fahrenheit"),
    ("flatten", "flatten a nested list of any depth"),
    ("unique_in_order", "remove duplicates from a list while keeping the original order"),
    ("parse_duration", 'turn a duration string like "{hours}h{minutes}m" into seconds'),
    ("mask_email", "hide everything but the first letter of the user name in an email address"),
    ("rotate_right", "rotate a list {k} positions to the right"),
    ("second_largest", "return the second largest number in a list"),
    ("clamp", "clamp a number so that it stays between {low} and {high}"),
    ("fizz_buzz", 'print 1 to {big_n}, but "Fizz" for multiples of {k} and "Buzz" for multiples of {k2}'),
    ("running_total", "compute the running total of a list of numbers"),
    ("are_anagrams", "check whether two words are anagrams of each other"),
    ("title_case", "capitalise the first letter of every word in a sentence"),
    ("word_frequencies", "count how many times each word appears in a text file"),
    ("gcd", "find the greatest common divisor of two numbers"),
    ("transpose", "transpose a matrix given as a list of rows"),
    ("has_unique_chars", "check whether a string has no repeated characters"),
    ("caesar_shift", "shift every letter of a message {k} places along the alphabet"),
    ("compress_runs", 'compress runs of repeated characters, so "aaabcc" becomes "a3b1c2"'),
    ("median", "compute the median of a list of numbers"),
    ("text_histogram", "print a histogram of a list of counts using '#' characters"),
    ("check_password", "check that a password has at least {big_n} characters, a digit and an uppercase letter"),
    ("slugify", "turn an article title into a URL slug"),
    ("roman_to_int", "convert a Roman numeral to an integer"),
    ("days_between", "return the number of days between two dates written as YYYY-MM-DD"),
    ("group_by_initial", "group a list of words by their first letter"),
    ("pairs_with_sum", "find all pairs of numbers in a list that add up to {big_n}"),
    ("fibonacci", "generate the first {big_n} Fibonacci numbers"),
    ("format_seconds", "convert a number of seconds into hours, minutes and seconds"),
    ("is_power_of_two", "check whether a number is a power of two"),
    ("digit_sum", "sum the digits of an integer"),
    ("longest_word", "find the longest word in a sentence"),
    ("every_kth", "return every {k}th element of a list"),
    ("split_bill", "add a {percent}% tip to a bill and split it between {n} people"),
    ("balanced_brackets", "check that the brackets in a string are balanced"),
    ("binary_to_decimal", "convert a binary string to a decimal number"),
    ("retry", "call another function up to {n} times until it stops raising an error"),
    ("parse_settings", 'parse a line like "name=value; colour=blue" into a dictionary'),
    ("first_negative", "find the index of the first negative number in a list"),
    ("interleave", "interleave two lists, one item from each in turn"),
    ("dot_product", "compute the dot product of two vectors"),
    ("with_thousands", "format an integer with thousands separators"),
    ("parse_csv_line", "split a CSV line into fields, respecting quoted commas"),
    ("nth_prime", "return the n-th prime number"),
    ("sort_people", "sort a list of people by age and then by name"),
    ("truncate", 'cut a string to {big_n} characters and add "..." if it was cut'),
    ("random_password", "generate a random password of {big_n} characters"),
    ("roll_dice", "simulate rolling two dice {big_n} times and count how often each total comes up"),
    ("merge_sorted", "merge two sorted lists into one sorted list"),
    ("Stack", "implement a stack with push, pop and peek"),
    ("Queue", "implement a queue using two stacks"),
    ("memoize", "cache the results of a slow function"),
    ("longest_lines", "read a text file and print its {n} longest lines"),
    ("count_weekdays", "count how many weekdays there are between two dates"),
    ("initials", 'turn a full name like "{full_name}" into initials'),
    ("to_snake_case", "convert camelCase identifiers to snake_case"),
    ("moving_average", "compute a moving average over a window of {n} values"),
    ("is_valid_ipv4", "check whether a string is a valid IPv4 address"),
    ("price_with_vat", "add {percent}% VAT to a price and round it to two decimals"),
]
FILLERS.update({
    "k": number(2, 5), "hours": number(1, 9), "minutes": number(1, 59), "low": number(0, 10),
    "high": number(50, 200),
})
CODE_TEMPLATES = [
    "Write a {lang} function `{name}` to {spec}.", "Write a function in {lang} that can {spec}.",
    "how do i {spec} in {lang}", "Can you write {lang} code to {spec}? Call the function {name}.",
    "I need a {lang} function to {spec}. {code_extra}", "Implement {name} in {lang}. It should {spec}.",
    "Show me how to {spec} in {lang}, with a short example.", "In {lang}, what's the cleanest way to {spec}?",
    "Write a small {lang} program that uses a function to {spec}.", "{lang}: {spec}. {code_extra}",
    "Please write {name} in {lang}. It needs to {spec}. {code_extra}",
    "I'm practising {lang} for interviews. Could you write a solution that will {spec}, and explain it?",
    "What's an efficient way to {spec}? I'm using {lang}.", "write {lang} to {spec}",
]
CODE_EXTRAS = [
    "Add a docstring.", "Include two or three test cases.", "Don't use any external libraries.",
    "Explain the time complexity.", "Handle empty input gracefully.", "Add comments explaining each step.",
    "Keep it under 15 lines.", "Make it readable rather than clever.", "Add type annotations.",
    "Show how to call it.", "Make it work for large inputs too.", "I'm a beginner, so keep it simple.",
]


def identifier(name: str, language: str) -> str:
    """`name` in the language's naming convention (snake_case, camelCase or PascalCase)."""
    if name[0].isupper() or language in ("Python", "Rust", "C", "Ruby"):
        return name
    parts = name.split("_")
    if language in ("Go", "C#"):
        return "".join(part.title() for part in parts)
    return parts[0] + "".join(part.title() for part in parts[1:])


def code_task(rng: random.Random) -> str:
    language = rng.choice(CODE_LANGUAGES)
    name, spec = rng.choice(CODE_SPECS)
    template = rng.choice(CODE_TEMPLATES)
    prompt = fill(rng, template, lang=language, name=identifier(name, language), spec=fill(rng, spec),
                  code_extra=rng.choice(CODE_EXTRAS))
    return casual(rng, prompt) if rng.random() < 0.06 else prompt


CODE_QUESTIONS = [
    "What's the difference between a list and a tuple in Python?", "When should I use a generator in Python?",
    "What does `if __name__ == '__main__':` do in Python?", "How do I read a JSON file in Python?",
    "How do I sort a list of dictionaries by one of their keys in Python?", "What are Python decorators for?",
    "How do I measure how long a piece of Python code takes to run?", "What's a virtual environment in Python?",
    "Why is `is` different from `==` in Python?", "How do I copy a nested dictionary in Python without sharing data?",
    "What's the difference between `let`, `const` and `var` in JavaScript?", "What is a closure in JavaScript?",
    "How do promises work in JavaScript?", "What's the difference between `==` and `===` in JavaScript?",
    "How do I debounce a function in JavaScript?", "How do I deep clone an object in JavaScript?",
    "What does the `this` keyword refer to in JavaScript?", "Why would I use TypeScript instead of JavaScript?",
    "What is the difference between an interface and an abstract class in Java?", "What does `static` mean in Java?",
    "When should I use an ArrayList and when a LinkedList in Java?", "How do Java streams work?",
    "What is a pointer in C, explained simply?", "What is the difference between the stack and the heap?",
    "Why does C need header files?", "What does `const` mean in different positions of a C declaration?",
    "What's the difference between a slice and an array in Go?", "How do goroutines and channels work together?",
    "How do I handle errors idiomatically in Go?", "What is a Go interface and why are they implicit?",
    "What's the difference between `String` and `&str` in Rust?", "What is ownership in Rust?",
    "When should I use `Box`, `Rc` and `Arc` in Rust?", "What does the `?` operator do in Rust?",
    "What's the difference between INNER JOIN and LEFT JOIN?", "When do I use HAVING instead of WHERE in SQL?",
    "What is a database index and when should I add one?", "What does normalisation mean for a database?",
    "What's the difference between single and double quotes in bash?", "What does `set -euo pipefail` do in a script?",
    "What is a race condition? Give a small example.", "What does REST mean for an API?",
    "How does garbage collection work?", "What's the difference between a compiler and an interpreter?",
    "Explain dependency injection with a short example.", "What is a hash function and why do hash tables need one?",
    "How does `git rebase` differ from `git merge`?", "How do I undo my last commit in git but keep the changes?",
    "What is Big O notation? Use simple examples.", "What's the difference between unit tests and integration tests?",
    "Explain recursion with an example that isn't factorial.", "What's a memory leak and how do I find one?",
    "What is a Docker container, compared to a virtual machine?", "Explain the difference between TCP and UDP.",
    "What is an API key and how should I store it in a project?", "What does a load balancer do?",
    "Why do floating point numbers give 0.30000000000000004 for 0.1 + 0.2?", "What is a mutex?",
    "What's the difference between `map`, `filter` and `reduce`?", "What is functional programming, in short?",
    "What is the difference between a shallow copy and a deep copy?", "What are environment variables for?",
    "What does `async` actually change about a function?", "What is CORS and why does my browser complain about it?",
]


def code_question(rng: random.Random) -> str:
    return shaped(rng, rng.choice(CODE_QUESTIONS), constraints=CODE_QUESTION_ASKS, contexts=[])


CODE_QUESTION_ASKS = [
    "Give a short example.", "Keep it brief.", "Explain it like I'm new to programming.", "Show code if it helps.",
    "Use bullet points.", "Answer in one paragraph.", "When would I use each?", "What are the common pitfalls?",
]


SQL_TABLES = {
    "employees(id, name, department, salary, hired_on)": [
        "find the average salary in each department", "list everyone hired after {year}, newest first",
        "find the {n} best-paid people in the {department} department",
        "show departments with more than {big_n} employees",
        "find people who earn more than their department's average",
    ],
    "books(id, title, author, published_year, price)": [
        "find authors who have written more than {n} books", "list the cheapest book by each author",
        "find books published between {year} and 2024", "count the books published in each decade",
    ],
    "students(id, name, class) and grades(student_id, subject, score)": [
        "find each student's average score", "list students who scored under {big_n} in {subject}",
        "find the best student in each class", "count how many students took {subject}",
    ],
    "products(id, name, category, price) and sales(product_id, quantity, sold_at)": [
        "find the total revenue per category in {year}", "list products that have never been sold",
        "find the best-selling product of each month", "find categories whose average price is above {price}",
    ],
    "flights(id, origin, destination, departs_at, arrives_at)": [
        "find flights from {city} that take longer than {n} hours", "count the flights to each destination",
        "find the earliest flight of each day",
    ],
    "songs(id, title, artist, seconds) and plays(song_id, user_id, played_at)": [
        "find the {n} most played songs of last week", "find users who listened to more than {big_n} artists",
        "compute the total listening time per user",
    ],
    "tickets(id, customer_email, status, opened_at, closed_at)": [
        "compute the average time it takes to close a ticket", "count the open tickets per day for the last {n} days",
        "find customers with more than {n} tickets",
    ],
}
FILLERS.update({
    "department": choice_of(["Sales", "Engineering", "Finance", "Marketing", "Support", "Legal"]),
    "subject": choice_of(["maths", "biology", "history", "French", "physics", "art"]),
})
SQL_TEMPLATES = [
    "Write a SQL query to {question}. The table is {schema}.", "I have a table {schema}. How do I {question}?",
    "sql question: {schema}, need to {question}", "Given {schema}, write a query that will {question}.",
    "What's the SQL to {question}? My schema: {schema}.", "Using PostgreSQL and {schema}, {question}.",
]


def sql_task(rng: random.Random) -> str:
    schema = rng.choice(list(SQL_TABLES))
    question = fill(rng, rng.choice(SQL_TABLES[schema]))
    return fill(rng, rng.choice(SQL_TEMPLATES), schema=schema, question=question)


SHELL_TASKS = [
    "rename every .jpeg file in a folder to .jpg", "find files bigger than {big_n} MB in my home directory",
    "delete log files older than {big_n} days", "show the {n} biggest folders under /var",
    "back up a folder into a tar.gz archive with today's date in the name",
    "check every {big_n} seconds whether a website is up", "replace 'colour' with 'color' in all .md files",
    "print the {n} most frequent IP addresses in an access log", "watch a folder and print new file names",
    "download a list of URLs from a file, one by one", "convert every .png in a folder to .webp",
    "kill whatever process is listening on port {port}", "show disk usage in a human-readable way",
    "find all TODO comments in a project", "sort a CSV file by its third column",
    "create {n} folders named week1 to week{n}", "print the lines that two files have in common",
    "run a command and email me if it fails", "show which git branches are already merged",
]
FILLERS["port"] = choice_of(["3000", "5432", "8080", "8000", "5000", "9090"])
SHELL_TEMPLATES = [
    "Write a bash script to {task}.", "How do I {task} from the command line?", "bash one-liner to {task}?",
    "What's the Linux command to {task}?", "I'm on macOS. How can I {task} in the terminal?",
    "Write a shell script that will {task}. Explain each line.",
]


def shell_task(rng: random.Random) -> str:
    return fill(rng, rng.choice(SHELL_TEMPLATES), task=fill(rng, rng.choice(SHELL_TASKS)))


def coding(rng: random.Random) -> str:
    return rng.choices([code_task, code_question, sql_task, shell_task], weights=[6, 2, 2, 1])[0](rng)


# Debugging: a short buggy snippet with random names, its symptom, and a question around it.
VARIABLES = ["items", "scores", "prices", "names", "values", "orders", "temps", "ages", "words", "rows"]


def python_mutable_default(rng: random.Random) -> tuple[str, str, str]:
    things = rng.choice(VARIABLES)
    code = "\n".join([f"def add_item(item, {things}=[]):", f"    {things}.append(item)", f"    return {things}", "",
                      "print(add_item(1))", "print(add_item(2))"])
    return "Python", code, "prints [1, 2] on the second call instead of [2]"


def python_off_by_one(rng: random.Random) -> tuple[str, str, str]:
    things = rng.choice(VARIABLES)
    code = f"total = 0\nfor i in range(1, len({things})):\n    total += {things}[i]\nprint(total)"
    return "Python", code, "gives a total that is too small"


def python_remove_while_iterating(rng: random.Random) -> tuple[str, str, str]:
    things, limit = rng.choice(VARIABLES), rng.randint(5, 50)
    code = "\n".join([f"{things} = [3, 8, {limit}, {limit + 1}, 2]", f"for x in {things}:", f"    if x > {limit - 1}:",
                      f"        {things}.remove(x)", f"print({things})"])
    return "Python", code, f"still contains a number bigger than {limit - 1}"


def python_str_plus_int(rng: random.Random) -> tuple[str, str, str]:
    name, value = rng.choice(["age", "count", "score", "total", "level"]), rng.randint(2, 90)
    code = f'{name} = {value}\nprint("Your {name} is " + {name})'
    return "Python", code, 'raises TypeError: can only concatenate str (not "int") to str'


def python_early_return(rng: random.Random) -> tuple[str, str, str]:
    things, limit = rng.choice(VARIABLES), rng.randint(10, 100)
    code = "\n".join([f"def any_over({things}):", f"    for x in {things}:", f"        if x > {limit}:",
                      "            return True", "        else:", "            return False"])
    return "Python", code, "only ever looks at the first element"


def javascript_closure_loop(rng: random.Random) -> tuple[str, str, str]:
    count, delay = rng.randint(3, 6), rng.choice([100, 200, 500, 1000])
    code = f"for (var i = 0; i < {count}; i++) {{\n  setTimeout(() => console.log(i), {delay});\n}}"
    return "JavaScript", code, f"prints {count} {count} times instead of counting up"


def javascript_string_sum(rng: random.Random) -> tuple[str, str, str]:
    field = rng.choice(["quantity", "price", "age", "amount"])
    code = f'const {field} = document.querySelector("#{field}").value;\nconsole.log({field} + 1);'
    value = rng.randint(2, 40)
    return "JavaScript", code, f'prints "{value}1" when I type {value}'


def javascript_missing_await(rng: random.Random) -> tuple[str, str, str]:
    resource = rng.choice(["users", "orders", "posts", "products", "weather"])
    code = "\n".join(["async function load() {", f'  const response = fetch("/api/{resource}");',
                      "  const data = response.json();", "  console.log(data.length);", "}"])
    return "JavaScript", code, "throws TypeError: response.json is not a function"


def sql_missing_group_by(rng: random.Random) -> tuple[str, str, str]:
    column = rng.choice(["department", "country", "category", "status", "city"])
    code = f"SELECT {column}, COUNT(*)\nFROM customers\nWHERE created_at > '{rng.randint(2018, 2024)}-01-01';"
    return "SQL", code, f'says column "{column}" must appear in the GROUP BY clause'


def sql_where_aggregate(rng: random.Random) -> tuple[str, str, str]:
    limit = rng.choice([1000, 2500, 5000, 40000])
    code = f"SELECT team, AVG(salary)\nFROM staff\nWHERE AVG(salary) > {limit}\nGROUP BY team;"
    return "SQL", code, "fails with an error about aggregate functions in WHERE"


def c_integer_division(rng: random.Random) -> tuple[str, str, str]:
    total, count = rng.randint(7, 99), rng.choice([2, 4, 8])
    code = f'int total = {total};\nint count = {count};\nfloat mean = total / count;\nprintf("%f\\n", mean);'
    return "C", code, f"prints {total // count}.000000 instead of {total / count}"


def c_assignment_in_if(rng: random.Random) -> tuple[str, str, str]:
    name, value = rng.choice(["x", "level", "mode", "retries"]), rng.randint(1, 9)
    code = f'if ({name} = {value}) {{\n    printf("{name} is {value}\\n");\n}}'
    return "C", code, f"always prints the message even when {name} is not {value}"


def c_buffer_overflow(rng: random.Random) -> tuple[str, str, str]:
    word = rng.choice(["hello world", "configuration", "Amsterdam", "temperature"])
    code = f'char label[5];\nstrcpy(label, "{word}");\nprintf("%s\\n", label);'
    return "C", code, "sometimes crashes and sometimes prints garbage"


def java_string_equality(rng: random.Random) -> tuple[str, str, str]:
    answer = rng.choice(["yes", "quit", "admin", "y"])
    code = f'String input = scanner.nextLine();\nif (input == "{answer}") {{\n    System.out.println("ok");\n}}'
    return "Java", code, f'never prints "ok" even when I type {answer}'


def go_range_copy(rng: random.Random) -> tuple[str, str, str]:
    field = rng.choice(["Count", "Score", "Stock", "Visits"])
    code = f"for _, item := range items {{\n    item.{field}++\n}}\nfmt.Println(items[0].{field})"
    return "Go", code, f"leaves {field} unchanged"


def go_nil_map(rng: random.Random) -> tuple[str, str, str]:
    key = rng.choice(["apples", "alice", "red", "monday"])
    code = f'var counts map[string]int\ncounts["{key}"]++\nfmt.Println(counts)'
    return "Go", code, "panics with: assignment to entry in nil map"


def rust_use_after_move(rng: random.Random) -> tuple[str, str, str]:
    word = rng.choice(["hello", "report", "draft", "config"])
    code = f'let text = String::from("{word}");\nlet copy = text;\nprintln!("{{}} {{}}", text, copy);'
    return "Rust", code, "fails with: borrow of moved value: `text`"


def bash_test_spaces(rng: random.Random) -> tuple[str, str, str]:
    name, limit = rng.choice(["count", "files", "n", "retries"]), rng.randint(2, 20)
    code = f'if [${name} -gt {limit}]; then\n  echo "too many"\nfi'
    return "bash", code, f"says: [{limit + 1}: command not found"


BUGS = [
    python_mutable_default, python_off_by_one, python_remove_while_iterating, python_str_plus_int,
    python_early_return, javascript_closure_loop, javascript_string_sum, javascript_missing_await,
    sql_missing_group_by, sql_where_aggregate, c_integer_division, c_assignment_in_if, c_buffer_overflow,
    java_string_equality, go_range_copy, go_nil_map, rust_use_after_move, bash_test_spaces,
]
FENCE_TAGS = {"Python": "python", "JavaScript": "js", "SQL": "sql", "C": "c", "Java": "java", "Go": "go",
              "Rust": "rust", "bash": "bash"}


def debugging(rng: random.Random) -> str:
    language, code, symptom = rng.choice(BUGS)(rng)
    block = f"```{FENCE_TAGS[language]}\n{code}\n```" if rng.random() < 0.7 else code
    prompts = [
        f"Why is this {language} code broken? It {symptom}.\n\n{block}",
        f"This {symptom}. What am I doing wrong?\n\n{block}",
        f"can someone tell me whats wrong here, it {symptom}\n{block}",
        f"{block}\n\nThis {language} snippet {symptom}. How do I fix it?",
        f"I'm new to {language}. My code {symptom}:\n\n{block}\n\nCan you explain the bug and show a fix?",
        f"Debug this please. It {symptom}.\n\n{block}",
        f"{block}\n\nit {symptom}, why",
        f"Help! My {language} code {symptom}. Here it is:\n{block}",
        f"Explain what is wrong with this {language} code and rewrite it correctly:\n\n{block}",
    ]
    return rng.choice(prompts)


# --- arithmetic, word problems and logic puzzles ----------------------------------------------------------------


def with_ask(rng: random.Random, question: str, asks: list[str] | None = None) -> str:
    """The question, maybe asking for the working, the answer alone, or in a casual shape."""
    asks = MATH_ASKS if asks is None else asks
    roll = rng.random()
    if roll < 0.25:
        return followed(question, rng.choice(asks))
    if roll < 0.35:
        return casual(rng, question)
    return question


MATH_ASKS = [
    "Show your work.", "Explain step by step.", "Just the answer, please.", "Can you show how you got it?",
    "Please double-check the result.", "Walk me through it.", "Round to two decimals.", "Keep it brief.",
]


def discount(rng: random.Random) -> str:
    price, off = rng.randint(12, 480), rng.choice([10, 15, 20, 25, 30, 40, 50, 60, 70])
    item = rng.choice(["jacket", "pair of boots", "lamp", "backpack", "blender", "desk", "guitar", "suitcase"])
    return rng.choice([
        f"A {item} costs ${price} and is {off}% off. What's the sale price?",
        f"the {item} i want is ${price} with {off} percent off, how much do i actually pay",
        f"How much do I save on a ${price} {item} if it's {off}% off?",
        f"A {item} is on sale for ${price}, which is {off}% less than the original price. What was the original?",
    ])


def restaurant_bill(rng: random.Random) -> str:
    bill, tax, people = rng.randint(35, 320), rng.choice([5, 7, 8, 10, 13, 20]), rng.randint(2, 8)
    tip = rng.choice([10, 15, 18, 20])
    return rng.choice([
        f"Dinner was ${bill} before a {tax}% tax. If we tip {tip}% on the pre-tax amount, what's the total?",
        f"We are {people} people and the bill is ${bill} plus a {tip}% tip. How much does each of us pay?",
        f"What's a {tip}% tip on ${bill}.{rng.randint(10, 95)}?",
    ])


def unit_price(rng: random.Random) -> str:
    small, big = rng.choice([250, 300, 400, 500]), rng.choice([750, 900, 1000, 1500])
    p1, p2 = rng.randint(150, 450) / 100, rng.randint(400, 1100) / 100
    product = rng.choice(["cereal", "coffee beans", "rice", "washing powder", "pasta", "dog food"])
    return f"Which is the better deal: {small} g of {product} for ${p1:.2f} or {big} g for ${p2:.2f}?"


def time_maths(rng: random.Random) -> str:
    start_h, start_m = rng.randint(6, 11), rng.choice([0, 10, 15, 20, 30, 45, 50])
    hours, minutes = rng.randint(2, 9), rng.choice([5, 10, 15, 25, 40, 45, 55])
    start = f"{start_h}:{start_m:02d} am"
    return rng.choice([
        f"I start work at {start} and need to work {hours} hours {minutes} minutes plus a 30-minute lunch break."
        " When can I leave?",
        f"How many minutes are there between {start} and {rng.randint(1, 11)}:{rng.choice(['05', '25', '40'])} pm?",
        f"My flight takes off at {start} and lands {hours} hours and {minutes} minutes later, in a time zone"
        f" {rng.randint(2, 6)} hours ahead. What's the local time when I land?",
        f"If I sleep from 11:{rng.choice(['15', '30', '45'])} pm to {start}, how long did I sleep?",
        f"A recipe needs {hours} hours {minutes} minutes in the oven and dinner is at {rng.randint(6, 9)} pm."
        " When do I put it in?",
        f"How many seconds are in {rng.randint(2, 30)} days?",
        f"What's {hours * 60 + minutes} minutes in hours and minutes?",
    ])


def speed_distance(rng: random.Random) -> str:
    distance, speed = rng.randint(40, 900), rng.choice([40, 50, 60, 70, 80, 90, 100, 110, 120])
    minutes = rng.randint(12, 150)
    return rng.choice([
        f"If I drive {distance} km at an average of {speed} km/h, how long will the trip take?",
        f"A cyclist rides {rng.randint(8, 60)} miles in {minutes} minutes. What's the average speed in mph?",
        f"Two trains leave stations {distance} km apart and head towards each other at {speed} and"
        f" {speed - 20} km/h. When do they meet?",
        f"I walk at about 5 km/h. How long will it take me to walk {rng.randint(3, 25)} km?",
        f"My car uses {rng.randint(4, 11)} litres per 100 km. How much fuel do I need for {distance} km, and what"
        f" does it cost at ${rng.randint(120, 220) / 100:.2f} a litre?",
        f"If I run {rng.randint(3, 21)} km in {minutes} minutes, what's my pace per kilometre?",
    ])


def percentages(rng: random.Random) -> str:
    old, change = rng.randint(400, 3000), rng.choice([3, 4, 6, 8, 12, 15, 18, 22, 35])
    new = round(old * (1 + change / 100))
    return rng.choice([
        f"My rent went from ${old} to ${new}. By what percentage did it go up?",
        f"What's {change} percent of {rng.randint(20, 900)}?",
        f"A town had {old * 10} people and grew by {change}% last year. How many live there now?",
        f"If my salary is ${old * 20} a year and I get a {change}% raise, what's my new salary?",
        f"{rng.randint(10, 90)} out of {rng.randint(95, 160)} students passed. What percentage is that?",
        f"A shirt's price went up {change}% and then down {change}%. Is it back to the original price?",
        f"My savings of ${old} earn {rng.choice([2, 3, 4, 5])}% interest a year. How much after"
        f" {rng.randint(2, 10)} years if it compounds yearly?",
    ])


def conversions(rng: random.Random) -> str:
    return rng.choice([
        f"Convert {rng.randint(3, 200)} km to miles.", f"How many ounces is {rng.randint(50, 900)} grams?",
        f"What is {rng.randint(-15, 40)}°C in Fahrenheit?", f"{rng.randint(20, 105)}°F in Celsius?",
        f"How many cups is {rng.randint(100, 1000)} ml?", f"I'm {rng.randint(4, 6)} feet {rng.randint(0, 11)}"
        " inches tall. What's that in centimetres?", f"How many pounds is {rng.randint(45, 130)} kg?",
        f"Convert {rng.randint(2, 60)} miles per hour to metres per second.",
        f"How many square feet is a {rng.randint(20, 150)} square metre flat?",
        f"how many tablespoons in {rng.choice(['a quarter', 'half', 'a third of a', 'two'])} cup",
        f"What's {rng.randint(1, 10)} gallons in litres?", f"How many megabytes are {rng.randint(2, 64)} gigabytes?",
    ])


def plain_arithmetic(rng: random.Random) -> str:
    a, b, c = rng.randint(12, 999), rng.randint(3, 99), rng.randint(2, 60)
    scores = ", ".join(str(rng.randint(50, 100)) for _ in range(rng.randint(4, 7)))
    x, m, k = rng.randint(-9, 15), rng.randint(2, 9), rng.randint(1, 30)
    return rng.choice([
        f"What's {a} × {b}?", f"calculate {a} * {b} - {c}", f"What is {b} squared minus {c}?",
        f"What is the square root of {b * b}?", f"What's {a} divided by {c}, as a decimal?",
        f"My test scores are {scores}. What's my average?", f"What's the median of {scores}?",
        f"What is {rng.randint(1, 7)}/{rng.randint(8, 12)} + {rng.randint(1, 5)}/{rng.randint(6, 9)}?",
        f"Find x if {m}x + {k} = {m * x + k}.", f"If {m}x - {k} = {m * x - k}, what is x?",
        f"What's {rng.randint(2, 9)} to the power of {rng.randint(2, 6)}?", f"Is {a} divisible by {rng.randint(3, 9)}?",
        f"Find the prime factors of {rng.randint(30, 600)}.", f"What is {a} + {b} + {c} + {rng.randint(1, 500)}?",
        f"Round {a / c:.5f} to two decimal places.", f"What's {rng.randint(2, 9)}! (factorial)?",
        f"What's the lowest common multiple of {rng.randint(2, 15)} and {rng.randint(4, 20)}?",
    ])


def everyday_word_problem(rng: random.Random) -> str:
    people, grams, target = rng.randint(2, 6), rng.choice([200, 250, 300, 400, 500]), rng.randint(3, 12)
    monthly, goal = rng.choice([50, 75, 100, 150, 200, 300]), rng.choice([1200, 2500, 4000, 6000, 10000])
    workers, days = rng.randint(2, 6), rng.randint(3, 12)
    return rng.choice([
        f"A recipe for {people} people needs {grams} g of flour. How much do I need for {target} people?",
        f"If I save ${monthly} a month, how long until I have ${goal}?",
        f"If {workers} painters can paint a house in {days} days, how long would {workers + 2} painters take?",
        f"A round table has a diameter of {rng.randint(60, 180)} cm. What's its area?",
        f"A wall is {rng.randint(3, 9)} m wide and {rng.choice([2.4, 2.5, 2.7, 3])} m high. One litre of paint"
        f" covers {rng.randint(8, 12)} m². How many litres for two coats?",
        f"We rented a cabin for ${rng.randint(300, 1500)} for {rng.randint(2, 7)} nights and there are {people} of"
        " us. What does each person pay per night?",
        f"A bag has {rng.randint(2, 9)} red and {rng.randint(2, 9)} blue marbles. If I pick two without looking,"
        " what's the chance both are red?",
        f"If I roll two dice, what's the probability the total is {rng.randint(2, 12)}?",
        f"A phone plan costs ${rng.randint(10, 40)} a month plus ${rng.randint(100, 600)} for the phone. What's the"
        f" total over {rng.choice([12, 18, 24, 36])} months?",
        f"I need {rng.randint(3, 40)} metres of fence and it comes in {rng.choice([1.8, 2, 2.4, 3])} m panels."
        " How many panels should I buy?",
        f"My electricity costs {rng.randint(12, 45)} cents per kWh. How much does a {rng.choice([60, 800, 1500, 2000])}"
        f" W heater cost to run for {rng.randint(2, 9)} hours?",
    ])


MATH_PROBLEMS = [discount, restaurant_bill, unit_price, time_maths, speed_distance, percentages, conversions,
                 plain_arithmetic, everyday_word_problem]


def maths(rng: random.Random) -> str:
    return with_ask(rng, rng.choice(MATH_PROBLEMS)(rng))


def ordering_puzzle(rng: random.Random) -> str:
    people = rng.sample(NAMES, rng.randint(3, 4))
    quality, opposite = rng.choice([("taller", "shortest"), ("older", "youngest"), ("faster", "slowest"),
                                    ("richer", "poorest"), ("heavier", "lightest")])
    facts = " ".join(f"{a} is {quality} than {b}." for a, b in itertools.pairwise(people))
    return f"{facts} Who is the {opposite}?"


def sequence_puzzle(rng: random.Random) -> str:
    start, step = rng.randint(1, 12), rng.randint(2, 9)
    kind = rng.choice(["add", "multiply", "squares", "growing"])
    if kind == "add":
        terms = [start + step * i for i in range(5)]
    elif kind == "multiply":
        ratio = rng.choice([2, 3])
        terms = [start * ratio**i for i in range(5)]
    elif kind == "squares":
        terms = [(start + i) ** 2 for i in range(5)]
    else:
        terms = [start + i * (i + 1) // 2 * step for i in range(5)]
    listed = ", ".join(map(str, terms))
    return rng.choice([f"What comes next: {listed}, ...?", f"Find the pattern: {listed}. What's the next number?",
                       f"next number in {listed} ?"])


def logic_puzzle(rng: random.Random) -> str:
    a, b, c, d = rng.sample(NAMES, 4)
    days, today = rng.randint(10, 400), rng.choice(WEEKDAYS)
    gap, later = rng.randint(2, 12), rng.randint(2, 10)
    b_age = rng.randint(5, 40)
    total = 2 * b_age + gap + 2 * later
    group, club = rng.choice([("engineers", "the chess club"), ("teachers", "the running club"),
                              ("nurses", "the choir"), ("students", "the book club")])
    red, blue, people = rng.randint(3, 12), rng.randint(3, 12), rng.randint(4, 30)
    jug_a, jug_b = rng.choice([(3, 5), (4, 7), (5, 8), (3, 7), (4, 9)])
    target = rng.choice([t for t in range(1, jug_b) if t not in (jug_a,)])
    if rng.random() < 0.3:
        return rng.choice([ordering_puzzle, sequence_puzzle])(rng)
    return rng.choice([
        f"If today is {today}, what day of the week will it be in {days} days?",
        f"{a} is {gap} years older than {b}. In {later} years their ages will add up to {total}. How old is {b} now?",
        f'{a} says "{b} is lying." {b} says "{c} is lying." {c} says "{a} and {b} are both lying." Who is telling'
        " the truth?",
        f"All the {group} I know are in {club}. {a} is in {club}. Does that mean {a} is one of the {group}?",
        f"A drawer has {red} red socks and {blue} blue socks. How many do I have to take out in the dark to be sure"
        " of a matching pair?",
        f"{people} people at a party each shake hands once with everyone else. How many handshakes is that?",
        f"What's the angle between the hands of a clock at {rng.randint(1, 12)}:{rng.choice(['00', '15', '45'])}?",
        f"I have a {jug_a}-litre jug and a {jug_b}-litre jug. How can I measure exactly {target} litres?",
        f"I have {rng.choice([8, 9, 12])} coins and one is lighter than the others. With a balance scale, what's the"
        " fewest weighings to find it?",
        f"{a}, {b} and {c} each own a different pet: a cat, a dog and a fish. {a} is allergic to fur and {b} walks"
        " her pet every morning. Who owns which pet?",
        f"A snail climbs {rng.randint(3, 5)} m up a wall {rng.randint(10, 20)} m high each day and slides down 2 m each"
        " night. How many days to reach the top?",
        f"If {a} finishes a race ahead of {b} but behind {c}, and {b} beats {d}, who came second?",
        f"I'm thinking of a number. Double it and add {gap}, and you get {2 * b_age + gap}. What's my number?",
    ])


RIDDLES = [
    "Give me a riddle and don't tell me the answer until I guess.", "Can you make up a logic puzzle for kids?",
    "What's a good brain teaser I can ask my friends at dinner?",
    "Give me a lateral thinking puzzle, with the solution hidden at the end.",
    "Make up a riddle whose answer is {riddle_answer}.",
    "Invent a short murder mystery puzzle I can solve in five minutes.",
]
FILLERS["riddle_answer"] = choice_of(["a shadow", "an echo", "a candle", "a map", "a key", "time", "a cloud",
                                      "a clock", "footsteps", "a sponge", "a mirror", "the letter E"])


def puzzles(rng: random.Random) -> str:
    if rng.random() < 0.1:
        return shaped(rng, fill(rng, rng.choice(RIDDLES)), constraints=[])
    return with_ask(rng, logic_puzzle(rng), PUZZLE_ASKS)


PUZZLE_ASKS = ["Explain your reasoning.", "Just give me a hint first.", "Show how you worked it out.",
               "Don't just give the answer, explain it.", "Is there a trick to this?"]


# --- creative writing ---------------------------------------------------------------------------------------------

CREATIVE_TEMPLATES = [
    "Write a poem about {topic}.", "Write a haiku about {topic}.", "Write a {tone} poem about {character}.",
    "Write a four-line poem about {topic} for a birthday card.", "Write a limerick about {character}.",
    "Write a short story about {character} in {setting}.", "Write a {tone} short story set in {setting}.",
    "Write a bedtime story for a {kid_age}-year-old about {character}. Keep it under {words} words.",
    "Write a dialogue between {character} and {character2} in {setting}.",
    "Write the first page of a {genre} story that takes place in {setting}.",
    "Describe {setting} using all five senses.",
    "Write a story in exactly {n} sentences about {character}.", "Write a {tone} scene where {character} meets"
    " {character2}.", "Give me five slogans for {business}.", "Write a slogan for {business}.",
    "Write a product description for {product}.", "Write an email to {recipient} {email_purpose}.",
    "Write a letter to my future self about {topic}.", "Write a {tone} toast for my {relative}'s {celebration}.",
    "Write a short speech for {occasion}.", "Write song lyrics about {topic} in the style of a {music_genre} song.",
    "Write a tweet announcing {announcement}.", "Write a birthday message for my {relative} who is turning {age}.",
    "Write an apology text to my {relative} for {mistake}.", "Write a LinkedIn post about {achievement}.",
    "Come up with a name and a backstory for {character}.", "Write a {tone} monologue by {character}.",
    "Write a two-sentence horror story about {everyday_object}.", "Write a fable with a moral about {virtue}.",
    "Write a motivational message for someone who is {struggle}.", "Write a short radio ad for {business}.",
    "Write an acrostic poem using the word {acrostic}.", "Write a diary entry from {character} in {setting}.",
    "Write a {lines}-line poem about {topic} that doesn't rhyme.",
    "Write a cheerful out-of-office reply for {occasion}.",
    "Write a story that starts with the line: \"{first_line}\"", "Write a love letter from {character} to {food}.",
    "Come up with {n} names for {business}.",
    "Write the blurb for the back cover of a {genre} novel about {character}.",
    "Write a short invitation to {party}.", "Write a short wedding vow that mentions {hobby}.",
    "Write a eulogy for {everyday_object} that finally broke after {years} years.",
    "Write a {tone} haiku sequence about {month}.", "Write a children's rhyme that helps kids remember {topic}.",
    "Write a scene in {setting}, told only through dialogue.",
]
FILLERS.update({
    "genre": choice_of(["mystery", "science fiction", "fantasy", "romance", "thriller", "historical",
                        "horror", "comedy", "adventure", "literary"]),
    "business": choice_of(["a bike repair shop", "a dog-walking service", "a vegan food truck", "a yoga studio",
                           "a second-hand bookshop", "a cleaning company", "a language school", "a plant nursery",
                           "an escape room", "a tea shop", "a local gym", "a wedding photographer",
                           "a moving company", "a board game café", "a tutoring service", "an ice cream van",
                           "a podcast about history", "a recycling app", "a barber shop", "a climbing wall"]),
    "product": choice_of(["a solar-powered phone charger", "noise-cancelling earplugs for sleeping",
                          "a smart plant pot", "a foldable e-bike", "a handmade ceramic mug", "a weighted blanket",
                          "a travel pillow that packs into its own pocket", "a cast iron pizza pan",
                          "a kids' coding robot", "an ergonomic mouse", "a waterproof hiking jacket",
                          "an electric kettle with temperature control", "a reusable notebook", "a bamboo toothbrush"]),
    "recipient": choice_of(["my team", "a client", "my professor", "the HR department", "a hotel", "my neighbours",
                            "a new colleague", "the school principal", "an old friend", "the city council",
                            "a customer who complained", "a recruiter"]),
    "email_purpose": choice_of([
        "asking for a deadline extension", "inviting them to a farewell lunch on {weekday}",
        "following up on an invoice that is {n} weeks late", "asking for a reference letter",
        "explaining that I'll be on leave in {month}", "thanking them for a great workshop",
        "suggesting we move our meeting to {weekday}", "asking about a lost parcel",
        "complaining about a noisy party", "introducing myself as the new {job}", "declining a job offer politely",
        "asking to work from home on {weekday}s", "about the fire drill next {weekday}"]),
    "celebration": choice_of(["silver wedding anniversary", "retirement party", "50th birthday", "graduation",
                              "engagement party", "housewarming", "farewell dinner", "promotion party"]),
    "occasion": choice_of(["the opening of a community garden", "a school's sports day", "my last day at work",
                           "a friend's book launch", "the start of a charity run", "a team's end-of-year dinner",
                           "a summer holiday", "a retirement", "the first day of a new project"]),
    "music_genre": choice_of(["country", "blues", "pop", "punk", "folk", "sea shanty", "rap", "musical theatre"]),
    "announcement": choice_of(["a new café opening on {weekday}", "our first app release", "a bake sale for charity",
                               "the winner of our photo contest", "a new podcast episode", "a free coding workshop"]),
    "mistake": choice_of(["forgetting our dinner plans", "missing the call last night", "being late again",
                          "breaking the good teapot", "snapping this morning", "losing the spare key"]),
    "everyday_object": choice_of(["a mirror", "a phone that keeps ringing", "an old doll", "a fridge",
                                  "the last bus home", "a knock at the door", "a babysitting job", "a GPS",
                                  "a toaster", "a coffee machine", "an umbrella", "a pair of headphones"]),
    "virtue": choice_of(["patience", "honesty", "sharing", "hard work", "listening", "courage", "humility"]),
    "struggle": choice_of(["training for a marathon", "starting a new job", "learning to code", "studying late",
                           "recovering from an injury", "moving to a new country", "looking for work"]),
    "acrostic": choice_of(["SUMMER", "COFFEE", "FRIEND", "OCEAN", "MONDAY", "GARDEN", "WINTER", "MUSIC"]),
    "first_line": choice_of(["The last train had already left.", "Nobody in the village had ever seen snow.",
                             "The letter arrived forty years late.", "My neighbour's dog can read.",
                             "The lights went out at exactly midnight.", "She had one hour to find the key."]),
    "party": choice_of(["a barbecue in our garden", "a baby shower", "a games night", "a surprise party",
                        "a picnic in the park", "a Halloween party", "a farewell drinks evening"]),
})


# --- editing: fix, rewrite, shorten and turn notes into prose -------------------------------------------------------

ERRONEOUS_SENTENCES = [
    "{name} and me was going to the {place} on {weekday} but it were closed.",
    "their going to bring there {thing}s to the party tomorow.",
    "she dont like {food} because it taste to salty.",
    "Me and my {relative} has been living in {city} since {year}, its a nice city.",
    "i seen that film allready, it was more better then the book.",
    "Could you sent me the report untill {weekday}, i need it for the meeting with {name}.",
    "Everyone have they're own opinion about {topic}.",
    "The {thing}s was delivered yesterday but one of them are broken.",
    "We was suppose to meet at {time} but {name} didnt came.",
    "Their is alot of reasons why {topic} are important for peoples.",
    "If I would have knew about the {place}, I would of went there.",
    "He dont has no time for {hobby} since he start his new job.",
    "Less people comes to the {place} since the prices goes up.",
    "Between you and I, the {thing} is not working good since {month}.",
]
FILLERS.update({
    "place": choice_of(["museum", "library", "gym", "bakery", "pool", "cinema", "post office", "market", "park"]),
    "thing": choice_of(["chair", "printer", "laptop", "cable", "ticket", "plant", "book", "lamp", "bike", "parcel"]),
})
# Texts to edit, by what is asked of them.
EDIT_TEXTS = {
    "formal": [
        "hey, can't make the {event} on {weekday}, something came up, sorry!!",
        "yo {name}, the {thing} is broken again. can u sort it before {time}?",
        "thx for the help yesterday, u saved me big time", "need the numbers asap, boss is asking, pls send",
        "gonna be late, traffic is crazy, start without me", "cant do the {event}, my kid is sick. next week?",
        "hey all, {event} moved to {weekday}, same place, bring snacks lol",
        "the {thing} thing is done, finally. lmk if anything looks off",
        "so sorry, totally forgot about the invoice, will send tonight",
        "can we push the call to {time}? stuck in another meeting", "who took my {thing}?? not cool",
        "fyi the wifi on floor 2 is down again, IT knows", "got ur message, will check and get back to u tmrw",
    ],
    "casual": [
        "Dear colleagues, please be advised that the {place} will be unavailable on {weekday} due to scheduled"
        " maintenance.",
        "We regret to inform you that your application has not been successful on this occasion.",
        "Kindly ensure that all expense reports are submitted no later than {date}.",
        "Pursuant to our previous correspondence, I would like to confirm the {event} on {weekday} at {time}.",
        "Attendance at the {event} is mandatory for all members of staff.",
        "Please note that the {thing} in the kitchen is for shared use and must be cleaned after each use.",
        "Your request has been forwarded to the relevant department, which will respond in due course.",
        "Members are reminded that guests must be signed in at reception prior to entering the premises.",
        "It has come to our attention that several invoices remain outstanding as of {date}.",
        "The management wishes to thank all residents for their patience during the recent renovation works.",
    ],
    "shorter": [
        "Due to the fact that a large number of people have expressed an interest in attending, we have made the"
        " decision to move the {event} to a bigger room on the second floor of the building.",
        "At this point in time, I would like to take the opportunity to say that I am of the opinion that the new"
        " {thing} policy is in need of some changes.",
        "In the event that you are unable to attend the {event} on {weekday}, it would be greatly appreciated if you"
        " could let {name} know at your earliest convenience.",
        "It is important to note that, generally speaking, most people who try {hobby} for the first time tend to"
        " find it more difficult than they had originally expected it to be.",
        "The reason why I am writing to you today is in order to ask whether it might perhaps be possible for me to"
        " change the date of my appointment from {weekday} to a different day later in the week.",
        "What I am trying to say is that, when all is said and done, {topic} is something that has a much bigger"
        " impact on our everyday lives than most of us would ever really think about.",
        "I just wanted to reach out and check in to see if you had had a chance to take a look at the document that"
        " I sent over to you last {weekday}, or if not, when you think you might be able to do so.",
        "Despite the fact that the weather forecast had said that it was going to be sunny all day long, it actually"
        " ended up raining for most of the afternoon, which meant the {event} had to be moved indoors.",
        "There are a number of different reasons why it might be a good idea for you to consider the possibility of"
        " starting to save a small amount of money every single month, starting as early as you possibly can.",
    ],
}
FILLERS["event"] = choice_of(["team lunch", "book club", "workshop", "quiz night", "training session", "standup",
                              "rehearsal", "planning meeting", "parents' evening", "football practice"])
NOTE_FRAGMENTS = [
    "{name} back from leave {date}", "budget for {thing}s down {percent}%", "client call moved to {weekday}",
    "new intern starts {date}", "printer on 2nd floor still broken", "deadline pushed to end of {month}",
    "{city} trip confirmed", "need {n} volunteers for the {event}", "survey results: {big_n}% happy",
    "parking closed all week", "ask {name} about the contract", "{event} at {time}", "order more {thing}s",
    "website down for an hour on {weekday}", "prices up {percent}% from {month}", "{name} leading the {event}",
    "report due {date}", "kitchen rota starts {weekday}",
]
EDIT_INSTRUCTIONS = {
    "grammar": ["Fix the grammar", "Correct the mistakes in this sentence", "Can you fix the spelling and grammar",
                "proofread this", "Please correct this sentence and explain what was wrong",
                "What's wrong with this sentence grammatically"],
    "formal": ["Rewrite this in a more formal tone", "Make this sound professional", "Rewrite this message for my boss",
               "Turn this into a polite email", "Rewrite this so I can send it to a client"],
    "casual": ["Rewrite this in a casual, friendly way", "Make this sound less stiff", "Rewrite this so it sounds"
               " like a normal person wrote it", "Make this friendlier", "Rewrite this for a group chat"],
    "shorter": ["Shorten this", "Rewrite this more concisely", "Cut this down to half the length",
                "Make this sentence shorter without losing the meaning", "Rewrite the following sentence to make it"
                " clearer", "Simplify this sentence"],
    "notes": ["Turn these notes into a paragraph", "Write up these notes as a short update email",
              "Can you turn my notes into proper sentences", "Rewrite these meeting notes as a summary for the team",
              "Make a short bulleted list out of these notes"],
}


def editing(rng: random.Random) -> str:
    kind = rng.choice(["grammar", "grammar", "formal", "casual", "shorter", "notes"])
    if kind == "grammar":
        text = fill(rng, rng.choice(ERRONEOUS_SENTENCES))
    elif kind in EDIT_TEXTS:
        text = fill(rng, rng.choice(EDIT_TEXTS[kind]))
    else:
        notes = [fill(rng, fragment) for fragment in rng.sample(NOTE_FRAGMENTS, rng.randint(3, 6))]
        text = rng.choice([", ".join(notes), "; ".join(notes), "\n".join(f"- {note}" for note in notes)])
    return framed(rng, rng.choice(EDIT_INSTRUCTIONS[kind]), text)


# --- summaries of composed passages, translation --------------------------------------------------------------------

# Short texts to summarise: each a list of sentence slots, each slot a list of ways to write it.
PASSAGES = [
    [["{city} will open a new {facility} on {date}.", "A new {facility} opens in {city} on {date}."],
     ["The project cost about {project_cost} and took {n} years to finish.",
      "Building it took {n} years and about {project_cost}, more than twice the first estimate."],
     ["Residents had asked for it since {year}.", "A survey found that {big_n}% of residents plan to use it monthly.",
      "Some neighbours still worry about traffic and parking."],
     ["The mayor, {full_name}, said it would also host evening classes.",
      "Entry will be free for children under {kid_age}.", "Opening hours will be 7 am to 10 pm every day."]],
    [["Our team spent the last quarter moving the billing system to a new provider.",
      "Last quarter we replaced our old support tool with a new one."],
     ["The switch finished {n} days late because two data exports failed.",
      "It went mostly to plan, although {name} had to rebuild the reports by hand."],
     ["No customer data was lost.", "Support tickets went up by {percent}% in the first week and are now back to"
      " normal.", "Customers noticed almost nothing."],
     ["Next quarter we will focus on the mobile app.", "We will now look at cutting costs in {department}."]],
    [["I bought this {product_review} {n} weeks ago.", "I've been using this {product_review} since {month}."],
     ["Setting it up took ten minutes and the instructions were clear.", "Setup was confusing and took an hour."],
     ["It works well most of the time, although it gets loud after a while.", "It does the job, but the app is"
      " clunky.", "It stopped working once and support replaced it within a week."],
     ["For the price, I think it's good value.", "I'd buy it again, but only on sale.",
      "I wouldn't recommend it at full price."]],
    [["Researchers in {city} followed {big_n}0 adults for {n} years to see how {habit_study} affects sleep.",
      "A new study from {city} looked at whether {habit_study} changes how well people sleep."],
     ["People who did it most days fell asleep about {minutes} minutes faster on average.",
      "They found only a small effect, and only in people over {age}."],
     ["The authors warn that the study was observational, so it cannot prove cause and effect.",
      "Other scientists say the sample was too small to be sure."],
     ["The team now plans a larger trial.", "The results were published in {month}."]],
    [["We spent {n} days in {city} in {month}.", "We just got back from a week in {city}."],
     ["The weather was mixed, but the food was excellent.", "It rained almost every day, but we barely noticed."],
     ["Public transport made it easy to get around.", "We rented bikes, which was the best decision of the trip."],
     ["The highlight was a day trip to the coast.", "The highlight was a cooking class with a local chef."],
     ["Next time we would book the museums in advance, because the queues were long.",
      "We'd go again, but in spring rather than {month}."]],
    [["Dear residents, from {date} the rubbish collection day changes from {weekday} to {weekday2}.",
      "Dear parents, the school will close early on {date} for staff training."],
     ["Recycling will be collected every two weeks instead of weekly.", "Pickup will be at 1 pm instead of 3 pm."],
     ["Please plan ahead.", "We are sorry for any inconvenience."],
     ["Questions can be sent to the office.", "More details will follow by email."]],
    [["{topic_title} has changed a lot over the last few decades.", "Few subjects divide opinion like {topic}."],
     ["What started as a niche interest is now something millions of people have an opinion about.",
      "Twenty years ago hardly anyone talked about it."],
     ["Supporters say it makes everyday life easier, while critics worry about costs.",
      "Some see it as progress; others think it is mostly hype."],
     ["Most experts agree the next ten years will decide its future.", "What happens next is anyone's guess."]],
    [["{name} started the bakery in {year} with a loan of {budget} and a single oven.",
      "{name} opened a small bike shop in {city} in {year}."],
     ["For the first two years she worked alone, six days a week.", "At first, almost nobody came in."],
     ["Today the shop employs {n} people.", "Now it has a waiting list of customers every weekend."],
     ["Most customers live within walking distance.", "She says the secret is remembering everyone's name."]],
    [["The meeting agreed three things.", "Here is what we decided on {weekday}."],
     ["First, the launch moves to {month} so that testing can finish.", "First, {name} takes over the website."],
     ["Second, we will hire two more support staff.", "Second, the budget stays the same but more goes to video."],
     ["Third, everyone should submit their holiday plans by {date}.", "Third, Friday meetings are cancelled."],
     ["The next meeting is on {weekday} at {time}.", "Questions go to {name}."]],
    [["We are hiring a {job} to join our team in {city}.", "{city} Community Health is looking for a {job}."],
     ["You will work with a small, friendly team of {n} people.", "The role is full-time, with two days from home."],
     ["We are looking for someone organised who likes solving problems.", "Experience helps, but we will train you."],
     ["The salary is {income} a month.", "Applications close on {date}."]],
    [["Lost: a {pet_colour} {lost_pet} called {pet_name}, last seen near {place_near} on {weekday} evening.",
      "Found: a friendly {pet_colour} {lost_pet} wandering near {place_near} this morning."],
     ["Answers to {pet_name}, wears a red collar.", "No collar, but very calm and clearly someone's pet."],
     ["Please check your sheds and garages.", "We are keeping it safe until the owner is found."],
     ["Call {name} on 555-{phone_digits}.", "Reply to this post if you know anything."]],
    [["Version {n}.{minutes} of the app is out today.", "We've just released a big update to the app."],
     ["You can now export your notes to PDF.", "Dark mode finally arrives on every screen."],
     ["We fixed a bug that logged some people out at random.", "Sync is now about twice as fast."],
     ["Thanks to everyone who sent feedback.", "Tell us what you think in the comments."]],
    [["Hi! Long time no see.", "Hey, hope you're doing well."],
     ["Things here have been busy: I started a new job as a {job} in {month}.",
      "We finally moved to {city}, into a small flat near the river."],
     ["The kids are fine and {name} is learning {skill}.", "I've taken up {hobby}, which is harder than it looks."],
     ["Are you free for a call next {weekday}?", "Let me know if you're ever in town."]],
]
FILLERS.update({
    "project_cost": lambda rng: f"${rng.randint(2, 60) / 2:g} million",
    "facility": choice_of(["public library", "swimming pool", "cycling bridge", "community centre", "skate park"]),
    "product_review": choice_of(["air purifier", "standing desk", "robot vacuum", "blender", "electric toothbrush"]),
    "habit_study": choice_of(["an evening walk", "reading before bed", "drinking coffee after noon",
                              "using a phone in bed", "a short afternoon nap"]),
    "topic_title": lambda rng: capitalised(rng.choice(TOPICS)),
    "pet_name": lambda rng: rng.choice(PET_NAMES),
    "lost_pet": choice_of(["dog", "cat", "kitten", "puppy", "rabbit", "spaniel", "terrier"]),
    "pet_colour": choice_of(["black", "grey", "ginger", "white", "brown and white", "tabby"]),
    "place_near": choice_of(["the park", "the station", "Elm Street", "the school", "the canal", "the market"]),
    "phone_digits": number(1000, 9999),
})
SUMMARY_INSTRUCTIONS = [
    "Summarise this in one sentence", "Summarise the following text in two sentences", "Summarize this for me",
    "Give me the key points of this as bullet points", "tl;dr this", "What's the main point of this text",
    "Summarise this for someone who has ten seconds", "Write a one-line headline for this",
    "Summarise this and list any dates or numbers it mentions", "Sum this up in plain words",
]


def summarising(rng: random.Random) -> str:
    passage = " ".join(fill(rng, rng.choice(slot)) for slot in rng.choice(PASSAGES))
    return framed(rng, rng.choice(SUMMARY_INSTRUCTIONS), passage)


TRANSLATION_SENTENCES = [
    "Could I have {menu_item}, please?", "The {shop} opens at {hour} tomorrow.", "My {relative} lives in {city}.",
    "How much does this {thing} cost?", "Is there a {shop} near here?", "I'm allergic to {allergen}.",
    "We'd like a table for {n}, please.", "What time does the last bus leave?", "I've lost my {lost_item}.",
    "Can you speak more slowly, please?", "Happy birthday! I hope you have a wonderful day.",
    "The meeting has been moved to {weekday}.", "I'm sorry, I don't understand.", "It's {weather} today.",
    "Thank you for your help yesterday.", "I'd like to book a room for {n} nights.", "Where can I buy a ticket?",
    "My name is {name} and I work as a {job}.", "See you next {weekday}!", "Do you take credit cards?",
    "I'm looking for a pharmacy that is open now.", "The {thing} in my room doesn't work.",
]
FILLERS.update({
    "menu_item": choice_of(["a glass of water", "the soup of the day", "a coffee with milk", "the bill",
                            "two croissants", "the vegetarian menu"]),
    "shop": choice_of(["bakery", "supermarket", "bank", "pharmacy", "museum", "bookshop"]),
    "hour": choice_of(["eight", "nine", "ten", "half past seven", "noon"]),
    "allergen": choice_of(["peanuts", "shellfish", "gluten", "milk", "eggs"]),
    "lost_item": choice_of(["passport", "wallet", "phone", "keys", "luggage"]),
})
TRANSLATION_TEMPLATES = [
    'Translate into {language}: "{sentence}"', 'How do you say "{sentence}" in {language}?',
    "what's '{sentence}' in {language}", 'Translate "{sentence}" to {language} and explain the grammar briefly.',
    "Can you translate this into {language} for me? {sentence}", 'I need this in {language}: "{sentence}"',
    'How would a native {language} speaker say "{sentence}"?', "Translate to {language}, informal: {sentence}",
]


def translation(rng: random.Random) -> str:
    sentence = fill(rng, rng.choice(TRANSLATION_SENTENCES))
    return fill(rng, rng.choice(TRANSLATION_TEMPLATES), sentence=sentence)


# --- lists, recommendations, comparisons and role-play --------------------------------------------------------------

LIST_TEMPLATES = [
    "List {n} {list_subject}.", "Give me {n} ideas for {idea_occasion}.", "What are some good {good_things}?",
    "Recommend {n} {media} for someone who enjoys {media_taste}.", "Make me a packing list for {trip}.",
    "List the pros and cons of {topic}.", "What are {n} things every {job} should know?",
    "Give me a shopping list for making {food}.", "Suggest {n} weekend activities in {city} that cost nothing.",
    "List {n} easy dinners I can make with {ingredient}.", "What are some hobbies similar to {hobby}?",
    "Give me {n} conversation starters for {social_situation}.", "Name {n} famous people connected to {topic}.",
    "Make a checklist for {checklist_task}.", "list {n} {list_subject}", "Give me {n} fun facts about {topic}.",
    "What {n} books or resources would you suggest for learning about {topic}?", "Rank {n} {list_subject}.",
    "Suggest a {n}-day itinerary for {city}.", "Give me a weekly workout plan for a beginner with {n} free hours.",
    "List some questions I should ask at {question_setting}.", "What are the best {good_things}? Give me a top {n}.",
]
FILLERS.update({
    "list_subject": choice_of([
        "vegetables that are rich in iron", "countries in South America", "famous bridges", "ways to save energy at"
        " home", "indoor activities for a rainy day", "breakfasts that take under five minutes", "classic novels",
        "jobs that didn't exist twenty years ago", "words that are hard to translate", "birds you can see in a city"
        " park", "inventions that changed daily life", "stretches for people who sit all day", "cheap date ideas",
        "ways to reuse glass jars", "habits of productive people", "spices every kitchen should have",
        "mistakes new managers make", "sports you can play alone", "animals that live in the desert",
        "ways to say thank you at work", "signs that a website is a scam", "herbs that grow well indoors"]),
    "idea_occasion": choice_of(["a rainy Sunday with kids", "a team-building day", "a cheap date night",
                                "a {milestone} birthday party", "a school science fair", "a first blog post",
                                "a family reunion", "a small garden", "a farewell gift for a coworker",
                                "a picnic lunch", "a themed dinner party", "a YouTube channel about {hobby}"]),
    "good_things": choice_of(["snacks for a long road trip", "houseplants for a dark room",
                              "podcasts for learning history", "games to play on a long car ride",
                              "apps for learning a language", "gifts for someone who has everything",
                              "exercises to do at a desk", "names for a golden retriever", "first cars for students",
                              "habits for better sleep", "songs for a wedding first dance", "icebreaker games"]),
    "media": choice_of(["books", "films", "podcasts", "TV series", "albums", "video games", "documentaries"]),
    "media_taste": choice_of(["cozy mysteries", "space exploration", "true crime", "slow, beautiful films",
                              "stories about friendship", "historical dramas", "clever heist plots",
                              "nature and wildlife", "dark comedies", "epic fantasy worlds", "{topic}"]),
    "trip": choice_of(["a beach weekend", "a business trip to {city}", "a week of skiing", "a music festival",
                       "a winter city break in {city}", "a road trip with a baby", "a month backpacking in Asia",
                       "a camping weekend with kids", "a wedding abroad"]),
    "social_situation": choice_of(["a networking event", "a first date", "meeting my partner's family",
                                   "a new team at work", "a wedding where I know nobody", "a school parents' evening"]),
    "checklist_task": choice_of(["the first week at a new job", "selling my car", "hosting Thanksgiving",
                                 "getting a new puppy", "closing up a holiday home for winter", "a job interview",
                                 "launching a small website", "a baby's first trip abroad", "spring cleaning"]),
    "question_setting": choice_of(["a job interview", "a parent-teacher meeting", "a flat viewing",
                                   "my first appointment with a financial adviser", "a wedding venue visit"]),
})

# Things people choose between (any comparison template fits) and ideas they contrast (only the neutral ones).
CHOICE_PAIRS = [
    ("tea", "coffee"), ("renting", "buying a home"), ("Python", "JavaScript"), ("trains", "planes for short trips"),
    ("e-books", "paper books"), ("cats", "dogs"), ("running", "cycling"), ("yoga", "pilates"), ("Mac", "Windows"),
    ("iPhone", "Android"), ("electric cars", "hybrids"), ("index funds", "individual stocks"),
    ("working from home", "working in an office"), ("butter", "olive oil for cooking"), ("SQL", "NoSQL databases"),
    ("a gas stove", "an induction hob"), ("freelancing", "a full-time job"), ("the city", "the countryside"),
    ("a credit card", "a debit card"), ("weightlifting", "cardio"), ("Spanish", "French for an English speaker"),
    ("React", "Vue"), ("a laptop", "a desktop"), ("Spotify", "buying music"), ("hostels", "hotels"),
    ("camping", "glamping"), ("Go", "Rust"), ("Java", "Kotlin"), ("bash", "Python for scripting"),
    ("Excel", "Google Sheets"), ("a fixed-rate mortgage", "a variable-rate one"), ("meditation", "journaling"),
    ("a standing desk", "a normal desk"), ("leasing a car", "buying one"), ("frozen vegetables", "fresh ones"),
    ("a Kindle", "a tablet"), ("a gym membership", "working out at home"), ("learning guitar", "learning piano"),
    ("an electric toothbrush", "a manual one"), ("brown rice", "white rice"), ("sourdough", "supermarket bread"),
    ("a road bike", "a hybrid bike"), ("a cruise", "a road trip"), ("an air fryer", "an oven"),
    ("a savings account", "paying off my loan early"), ("a master's degree", "getting work experience"),
    ("a puppy", "an older rescue dog"), ("cloth nappies", "disposable ones"), ("a heat pump", "a gas boiler"),
    ("PostgreSQL", "MySQL"), ("VS Code", "PyCharm"), ("AWS", "a cheap VPS"), ("a tent", "a hammock for camping"),
    ("Duolingo", "an evening class"), ("audiobooks", "podcasts"), ("a smartwatch", "a fitness band"),
]
CONCEPT_PAIRS = [
    ("viruses", "bacteria"), ("mitosis", "meiosis"), ("a comet", "an asteroid"), ("sushi", "sashimi"),
    ("Stoicism", "Epicureanism"), ("the Renaissance", "the Enlightenment"), ("baking soda", "baking powder"),
    ("agile", "waterfall"), ("nuclear fission", "nuclear fusion"), ("a virus", "a worm in computer security"),
    ("speed", "velocity"), ("mass", "weight"), ("a simile", "a metaphor"), ("socialism", "communism"),
    ("an alligator", "a crocodile"), ("a hurricane", "a typhoon"), ("affect", "effect"), ("RAM", "storage"),
    ("a stock", "a bond"), ("a recession", "a depression"), ("empathy", "sympathy"), ("a tortoise", "a turtle"),
    ("latitude", "longitude"), ("an epidemic", "a pandemic"), ("a violin", "a viola"), ("jam", "jelly"),
    ("HTTP", "HTTPS"), ("a compiler", "a linker"), ("supervised learning", "unsupervised learning"),
    ("a lake", "a pond"), ("a psychologist", "a psychiatrist"), ("a will", "a trust"), ("gross pay", "net pay"),
    ("the House of Commons", "the House of Lords"), ("a rabbit", "a hare"), ("an ocean", "a sea"),
    ("a cold", "the flu"), ("a kernel", "a shell"), ("Baroque", "Classical music"), ("a haiku", "a tanka"),
]
COMPARISON_TEMPLATES = [
    "Compare {a} and {b}.", "Compare {a} and {b}. How are they similar and how are they different?",
    "What's the difference between {a} and {b}?", "Compare {a} with {b} in a short paragraph.",
    "Explain the main differences between {a} and {b} to {audience}.", "what's the difference between {a} and {b}",
    "Compare {a} and {b} in a table.", "{a} vs {b}: what's the difference?",
]
CONCEPT_TEMPLATES = [
    "How do you tell {a} and {b} apart?", "Is {a} the same thing as {b}?",
    "People mix up {a} and {b}. What's the actual difference?",
]
CHOICE_TEMPLATES = [
    "{a} or {b}: which is better for {purpose}?", "{a} vs {b}, pros and cons?", "Should I choose {a} or {b}?"
    " {comparison_context}", "Make a table comparing {a} and {b} on cost, convenience and quality.",
    "is {a} better than {b}", "Which would you pick, {a} or {b}, and why?", "Help me decide between {a} and {b}."
    " {comparison_context}", "I can't decide: {a} or {b}?",
]
FILLERS.update({
    "purpose": choice_of(["a beginner", "a tight budget", "a small family", "someone who travels a lot",
                          "a student", "the environment", "long-term use", "my health", "a small business"]),
    "comparison_context": choice_of(["I'm {age} and on a budget.", "I live in {city}.", "I'm a {job}.",
                                     "I care most about cost.", "Time matters more to me than money.",
                                     "It's for my {relative}.", "I have {n} kids."]),
})


def comparison(rng: random.Random) -> str:
    if rng.random() < 0.6:  # choices keep their order: the second often leans on the first ("fresh ones")
        a, b = rng.choice(CHOICE_PAIRS)
        template = rng.choice([*CHOICE_TEMPLATES, *COMPARISON_TEMPLATES])
    else:
        a, b = rng.sample(rng.choice(CONCEPT_PAIRS), 2)
        template = rng.choice([*CONCEPT_TEMPLATES, *COMPARISON_TEMPLATES])
    prompt = fill(rng, template, a=capitalised(a) if template.startswith("{a}") else a, b=b)
    return shaped(rng, prompt)


ROLES = [
    "a medieval blacksmith", "a friendly librarian", "a strict chess coach", "a travel agent in {city}",
    "a barista on your first day", "a Shakespearean actor", "a detective in 1920s {city}", "a spaceship's computer",
    "a patient maths tutor", "a personal trainer", "a sommelier", "a museum curator", "a wise old owl",
    "a football commentator", "a nervous new intern", "a 1950s radio host", "a park ranger", "a Victorian butler",
    "a famous chef judging my cooking", "my future self, twenty years from now", "a customer returning a {thing}",
    "an alien visiting Earth for the first time", "a ship's captain in a storm", "a kind kindergarten teacher",
    "a landlord showing me a flat in {city}", "a startup founder pitching to investors", "a very sarcastic cat",
]
ROLE_TASKS = [
    "Tell me about your day.", "Give me advice about {topic}.", "Explain {topic} in character.",
    "Stay in character and help me practise my {language}.", "Introduce yourself in three sentences.",
    "Convince me to try {hobby}.", "Describe the view from where you are.", "Answer my questions about {topic}.",
    "Teach me one useful thing.", "Complain about your job for a bit.", "Welcome me and ask what I need.",
]
ROLEPLAY_TEMPLATES = [
    "Pretend you are {role}. {role_task}", "You are {role}. {role_task}", "Act as {role}. {role_task}",
    "Let's role-play: you're {role} and I'm {my_role}. Start the conversation.", "Roleplay as {role}. {role_task}",
    "From now on, answer like {role}. {role_task}",
    "I want to practise {practice}. Play the other person and go first.",
    "Can you be {role} for a minute? {role_task}", "Interview me for a {job} job. Ask one question at a time.",
]
FILLERS.update({
    "my_role": choice_of(["a tourist", "a customer", "your apprentice", "a journalist", "a new neighbour",
                          "a lost traveller", "a student", "a time traveller from the year 1800"]),
    "practice": choice_of(["asking for a raise", "returning a faulty item", "a difficult conversation with my"
                           " landlord about noise", "ordering food in {language}", "small talk at a party",
                           "a salary negotiation", "saying no to a pushy salesperson",
                           "a first phone call to a client"]),
})


def roleplay(rng: random.Random) -> str:
    prompt = fill(rng, rng.choice(ROLEPLAY_TEMPLATES), role=fill(rng, rng.choice(ROLES)),
                  role_task=fill(rng, rng.choice(ROLE_TASKS)))
    return shaped(rng, prompt, constraints=[], contexts=[])


# --- extraction, classification, factual and yes/no questions -------------------------------------------------------


def dates_text(rng: random.Random) -> str:
    return fill(rng, "The {event} is on {date}, the report is due {date2}, and {name} is away until {date3}.")


def people_text(rng: random.Random) -> str:
    a, b, c = rng.sample(NAMES, 3)
    return fill(rng, f"{a} met {b} at the {{place}} in {{city}}, where {c} had been waiting since {{time}}.")


def receipt_text(rng: random.Random) -> str:
    items = rng.sample(["milk", "bread", "coffee", "apples", "cheese", "soap", "rice", "eggs", "tea", "pasta"], 4)
    return "\n".join(f"{item} ${rng.randint(1, 12)}.{rng.randint(0, 99):02d}" for item in items)


def contacts_text(rng: random.Random) -> str:
    first, second = (f"{rng.choice(NAMES).lower()}.{rng.choice(SURNAMES).lower()}@example.com" for _ in range(2))
    phone = f"555-{rng.randint(1000, 9999)}"
    return f"Hi all, please send the slides to {first} and copy {second}. Call me on {phone} if anything is unclear."


def review_text(rng: random.Random) -> str:
    aspect, aspect2 = rng.sample(["food", "service", "battery", "screen", "staff", "room", "delivery", "price"], 2)
    good, bad = rng.choice(["great", "fine", "excellent", "okay"]), rng.choice(["awful", "a letdown", "meh"])
    return f"The {aspect} was {good}, but the {aspect2} was {bad}. {rng.choice(REVIEW_ENDINGS)}"


def record_text(rng: random.Random) -> str:
    return fill(rng, "{full_name} is {age}, lives in {city} and works as a {job}.")


def support_text(rng: random.Random) -> str:
    return rng.choice(SUPPORT_MESSAGES)


# A text to work on, and what people ask of such a text.
EXTRACTIONS = [
    (dates_text, ["Extract the dates from this text", "List all the dates mentioned here",
                  "Pull out every date in this message and say what each is for"]),
    (people_text, ["Which people are mentioned in this sentence", "List the names and places in this text",
                   "Extract the people, places and times from this"]),
    (receipt_text, ["What's the total of this receipt", "Add these up",
                    "Which item here is the most expensive, and what's the total"]),
    (contacts_text, ["Find the email addresses in this message", "Extract all contact details from this",
                     "Pull out the emails and phone numbers"]),
    (review_text, ["Is this review positive, negative or mixed", "Classify the sentiment of this review",
                   "What's the tone of this customer review"]),
    (record_text, ["Turn this into JSON with the fields name, age, city and job", "Convert this to a YAML record",
                   "Fill in a table with name, age, city and job from this sentence"]),
    (support_text, ["Classify this customer message as billing, technical or other", "Label the intent of this message",
                    "Which team should handle this message: billing, tech support or sales"]),
]


def extraction(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.15:
        pool, question = rng.choice(CATEGORY_SORTS)
        return f"{question}: {', '.join(rng.sample(pool, rng.randint(5, min(len(pool), 8))))}"
    if roll < 0.22:
        statements = rng.sample(FACT_OR_OPINION, 3)
        return "Label each of these as fact or opinion:\n" + "\n".join(f"{i}. {s}" for i, s in enumerate(statements, 1))
    make_text, instructions = rng.choice(EXTRACTIONS)
    return framed(rng, rng.choice(instructions), make_text(rng))


REVIEW_ENDINGS = ["Would probably come back.", "Not sure I'd recommend it.", "Overall, happy.", "Never again.",
                  "Mixed feelings.", "Five stars for the view at least."]
CATEGORY_SORTS = [
    (["apple", "carrot", "banana", "broccoli", "mango", "spinach", "pear", "onion", "grape", "leek"],
     "Sort these into fruits and vegetables"),
    (["dolphin", "shark", "bat", "penguin", "whale", "salmon", "eagle", "cow", "frog", "snake"],
     "Which of these animals are mammals"),
    (["rent", "concert tickets", "groceries", "a new phone", "electricity", "a holiday", "medicine", "takeaway"],
     "Classify each of these as a need or a want"),
    (["Python", "HTML", "Rust", "CSS", "SQL", "JSON", "Go", "YAML", "Java"],
     "Which of these are programming languages and which are not"),
    (["the printing press", "the steam engine", "the internet", "the telephone", "the wheel", "electric light"],
     "Put these inventions in the order they appeared"),
    (["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"],
     "Which of these planets are rocky and which are gas or ice giants"),
    (["glass bottle", "pizza box", "banana peel", "plastic bag", "newspaper", "battery", "tin can", "coffee grounds"],
     "Which bin does each of these go in: recycling, compost or general waste"),
]
SUPPORT_MESSAGES = [
    "I was charged twice for my subscription this month.", "The app crashes every time I open the camera.",
    "Do you offer discounts for schools?", "I can't reset my password, the email never arrives.",
    "How do I change the address on my invoice?", "Your website is showing a blank page on Firefox.",
    "Can I upgrade to the family plan halfway through the month?", "The export button doesn't do anything.",
]
FACT_OR_OPINION = [
    "Water boils at 100 degrees Celsius at sea level.", "Summer is the best season.", "Paris is the capital of France.",
    "Cats make better pets than dogs.", "The Pacific is the largest ocean.", "Jazz is boring.",
    "Humans have 206 bones as adults.", "Breakfast is the most important meal.", "Mount Everest is in the Himalayas.",
    "Remote work is more productive.", "Spiders have eight legs.", "Modern art is overrated.",
]

FACTUAL_QUESTIONS = [
    "How do bees make honey?", "Why do cats purr?", "How do airplanes stay in the air?", "What is a black hole?",
    "Why is the ocean salty?", "How do vaccines train the immune system?", "Who invented the printing press?",
    "How tall is Mount Everest?", "How many bones are in the human body?", "What causes earthquakes?",
    "Why do leaves change colour in autumn?", "How does a compass work?", "What's the largest desert in the world?",
    "How long do elephants live?", "Why do we yawn?", "What is the speed of sound?", "How are rainbows formed?",
    "Who painted the Mona Lisa?", "When did the Berlin Wall fall?", "What is the longest river in Africa?",
    "How does a microwave oven heat food?", "What is inflation?", "Why do we get goosebumps?",
    "How do solar panels make electricity?", "What language has the most native speakers?",
    "What's the smallest country in the world?", "How do tides work?", "Why do stars twinkle?",
    "How does GPS know where I am?", "What's the hottest planet in the solar system?", "Why is Pluto not a planet?",
    "What is the boiling point of water at the top of a mountain?", "How do chameleons change colour?",
    "How does a 3D printer work?", "Why do we dream?", "What's the difference between a virus and bacteria?",
    "How many time zones does Russia have?", "When were the first Olympic Games held?", "What is DNA made of?",
    "How does a credit score work?", "How did the Romans build roads?", "Why do some birds migrate?",
    "What is the deepest point in the ocean?", "How do glasses correct vision?", "How do fireflies glow?",
    "What did people eat in medieval Europe?", "Who was Ada Lovelace?", "How much of the Earth is covered by water?",
    "What is the Great Barrier Reef?", "Why does bread go stale?", "What makes popcorn pop?",
    "How do electric cars charge?", "What is the tallest building in the world?", "How do submarines dive?",
    "Why do we have fingerprints?", "Who discovered penicillin?", "What is a light-year?", "How do plants drink water?",
    "How does Wi-Fi work?", "Why do cats land on their feet?", "What causes hiccups?", "How are diamonds formed?",
]
YES_NO_TEMPLATES = [
    "Can {animal} {ability}?", "Is it true that {claim}?", "Do {animal} sleep?", "Is {food} healthy?",
    "Is it safe to {safety_action}?", "Was {person} alive at the same time as {person2}?", "Is {city} a capital city?",
    "Can you see {sky_thing} without a telescope?", "Do {animal} feel pain?",
    "Can {number_claim} be divided evenly by anything except 1 and itself?", "does {food} freeze well",
    "is {city} bigger than {city2}",
]
FILLERS.update({
    "animal": choice_of(["penguins", "octopuses", "horses", "owls", "crocodiles", "snails", "goldfish", "cows",
                         "sharks", "parrots", "elephants", "spiders", "bats", "squirrels", "frogs", "pigs"]),
    "ability": choice_of(["swim", "see in colour", "recognise faces", "sleep standing up", "climb trees",
                          "jump", "hear music", "live for 50 years", "survive freezing", "count"]),
    "claim": choice_of(["we only use 10% of our brains", "goldfish have a three-second memory",
                        "lightning never strikes the same place twice", "bats are blind",
                        "cracking your knuckles causes arthritis", "the Great Wall is visible from space",
                        "sugar makes children hyperactive", "bulls hate the colour red",
                        "you should wait an hour after eating before swimming",
                        "shaving makes hair grow back thicker"]),
    "safety_action": choice_of(["eat raw cookie dough", "reheat rice", "charge my phone overnight",
                                "look at a solar eclipse with sunglasses", "drink water from a garden hose",
                                "give my dog grapes", "refreeze thawed chicken", "run every day"]),
    "person": choice_of(["Cleopatra", "Shakespeare", "Isaac Newton", "Leonardo da Vinci", "Napoleon", "Mozart",
                         "Galileo", "Abraham Lincoln", "Charles Darwin", "Queen Victoria", "Genghis Khan"]),
    "sky_thing": choice_of(["Saturn's rings", "the Andromeda galaxy", "Jupiter's moons", "the ISS", "Mars",
                            "the Milky Way", "a comet"]),
    "number_claim": number(50, 999),
})


def factual(rng: random.Random) -> str:
    if rng.random() < 0.55:
        return shaped(rng, rng.choice(FACTUAL_QUESTIONS))
    return shaped(rng, fill(rng, rng.choice(YES_NO_TEMPLATES)))


# --- the set --------------------------------------------------------------------------------------------------------

FAMILIES = [
    Family("explanations", 2500, from_templates(EXPLAIN_TEMPLATES, LEARNING_CONTEXTS)),
    Family("how-to", 1600, how_to),
    Family("advice", 2000, from_templates(ADVICE_TEMPLATES)),
    Family("pet-advice", 350, pet_advice),
    Family("chat", 1100, chat),
    Family("coding", 2600, coding),
    Family("debugging", 1100, debugging),
    Family("maths", 2200, maths),
    Family("puzzles", 900, puzzles),
    Family("creative-writing", 2400, from_templates(CREATIVE_TEMPLATES)),
    Family("editing", 1500, editing),
    Family("summaries", 1000, summarising),
    Family("translation", 1000, translation),
    Family("lists", 1300, from_templates(LIST_TEMPLATES)),
    Family("comparisons", 1000, comparison),
    Family("role-play", 800, roleplay),
    Family("extraction", 1000, extraction),
    Family("factual", 1200, factual),
]

# Words that keep their capital when a prompt is put after an opener ("Hi! Python: ...").
PROPER_WORDS = frozenset(
    word
    for phrase in [*NAMES, *CITIES, *HUMAN_LANGUAGES, *CODE_LANGUAGES, *TOPICS, "SQL", "ELI5"]
    if (word := phrase.split()[0])[:1].isupper()
)

# Every phrasing template of the families (the tests read the verbs they start with).
TASKS = [
    *EXPLAIN_TEMPLATES, *HOW_TO_TEMPLATES, *ADVICE_TEMPLATES, *CHAT_TEMPLATES, *CODE_TEMPLATES, *SQL_TEMPLATES,
    *SHELL_TEMPLATES, *RIDDLES, *CREATIVE_TEMPLATES, *(i for kind in EDIT_INSTRUCTIONS.values() for i in kind),
    *SUMMARY_INSTRUCTIONS, *TRANSLATION_TEMPLATES, *LIST_TEMPLATES, *COMPARISON_TEMPLATES, *CHOICE_TEMPLATES,
    *CONCEPT_TEMPLATES, *ROLEPLAY_TEMPLATES, *YES_NO_TEMPLATES,
]


def split_of(prompt: str) -> str:
    bucket = int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "eval" if bucket < EVAL_SHARE else "train"


def family_prompts(family: Family) -> list[str]:
    """`family.count` distinct prompts of the family (fewer if its combinations run out)."""
    rng = random.Random(f"demo-prompts/{family.name}")  # a str seed is hashed with sha512: same on every machine
    drawn: dict[str, None] = {}
    for _ in range(family.count * ATTEMPTS_PER_PROMPT):
        if len(drawn) >= family.count:
            break
        drawn[family.make(rng).strip()] = None
    return list(drawn)


def normalised(prompt: str) -> str:
    return " ".join(prompt.lower().split())


@functools.cache
def hand_written_prompts() -> frozenset[str]:
    """The built-in hand-written prompts (natural:eval, natural:validation), normalised: the generator
    never yields one."""
    import json

    from speculators.prompts import BUILTIN_SOURCES  # (prompts imports this module lazily: no cycle)

    rows = [json.loads(line) for path in BUILTIN_SOURCES.values()
            for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return frozenset(normalised(row["prompt"]) for row in rows)


@functools.cache
def generated_prompts() -> tuple[str, ...]:
    natural = hand_written_prompts()
    prompts = (prompt for family in FAMILIES for prompt in family_prompts(family))
    return tuple(dict.fromkeys(p for p in prompts if normalised(p) not in natural))


def all_demo_prompts() -> list[str]:
    return list(generated_prompts())


def demo_prompts(split: str = "train", seed: int = 0) -> list[str]:
    """The `split` ('train' or 'eval') of the demo prompt set, in a seeded order."""
    prompts = [p for p in all_demo_prompts() if split_of(p) == split]
    random.Random(seed).shuffle(prompts)
    return prompts
