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
prompt whatever the seed. The hand-written `natural:eval` and `natural:validation` prompts (files/*.jsonl)
are none of these (a generated prompt equal to one, ignoring case and spacing, is left out): those sets
measure the drafter on prompts no generator produced.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@functools.cache
def demo_words() -> dict[str, Any]:
    """The word lists, templates and texts the families draw from (files/demo_words.json), read once: data,
    kept apart from the code that draws. FILLER_WORDS holds the template fields filled with a choice from a
    list (field -> its words); EXTRACTION_ASKS what people ask of each kind of text to work on."""
    return json.loads((Path(__file__).parent / "files" / "demo_words.json").read_text(encoding="utf-8"))


# Lists of pairs are tuples here, as the families unpack them.
WORDS = demo_words()

EVAL_SHARE = 0.1
# Draws a family may spend per prompt it owes before giving up (families with few combinations hit it).
ATTEMPTS_PER_PROMPT = 6

TOPICS = WORDS["TOPICS"]

# People, places and things the templates are filled with.
NAMES = WORDS["NAMES"]
SURNAMES = WORDS["SURNAMES"]
CITIES = WORDS["CITIES"]
JOBS = WORDS["JOBS"]
RELATIVES = WORDS["RELATIVES"]
HOBBIES = WORDS["HOBBIES"]
SKILLS = WORDS["SKILLS"]
FOODS = WORDS["FOODS"]
INGREDIENTS = WORDS["INGREDIENTS"]
HUMAN_LANGUAGES = WORDS["HUMAN_LANGUAGES"]
AUDIENCES = WORDS["AUDIENCES"]
WEEKDAYS = WORDS["WEEKDAYS"]
MONTHS = WORDS["MONTHS"]
TONES = WORDS["TONES"]
CHARACTERS = WORDS["CHARACTERS"]
SETTINGS = WORDS["SETTINGS"]


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
# The fields filled with a choice from a word list.
FILLERS.update({field: choice_of(words) for field, words in WORDS["FILLER_WORDS"].items()})
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

CONSTRAINTS = WORDS["CONSTRAINTS"]
GENERAL_CONTEXTS = WORDS["GENERAL_CONTEXTS"]
# Reasons to learn about a subject, for explanations.
LEARNING_CONTEXTS = [*GENERAL_CONTEXTS, *WORDS["LEARNING_CONTEXTS"]]
OPENERS = WORDS["OPENERS"]
CLOSERS = WORDS["CLOSERS"]
CASUAL_ENDINGS = WORDS["CASUAL_ENDINGS"]


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


QUESTION_WORDS = set(WORDS["QUESTION_WORDS"])


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

EXPLAIN_TEMPLATES = WORDS["EXPLAIN_TEMPLATES"]

HOW_TO_GOALS = WORDS["HOW_TO_GOALS"]
HOW_TO_TEMPLATES = WORDS["HOW_TO_TEMPLATES"]


def how_to(rng: random.Random) -> str:
    return shaped(rng, fill(rng, rng.choice(HOW_TO_TEMPLATES), goal=rng.choice(HOW_TO_GOALS)))


ADVICE_TEMPLATES = WORDS["ADVICE_TEMPLATES"]
FILLERS.update({
    "debt": money(800, 12000, 100),
    "savings": money(500, 20000, 100),
})

PET_PROBLEMS = WORDS["PET_PROBLEMS"]
PET_NAMES = WORDS["PET_NAMES"]


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

CHAT_TEMPLATES = WORDS["CHAT_TEMPLATES"]


def chat(rng: random.Random) -> str:
    prompt = fill(rng, rng.choice(CHAT_TEMPLATES))
    return casual(rng, prompt) if rng.random() < 0.25 else prompt


# --- coding: tasks across languages, concept questions, SQL, shell and debugging ---------------------------------

CODE_LANGUAGES = WORDS["CODE_LANGUAGES"]
CODE_SPECS = [tuple(item) for item in WORDS["CODE_SPECS"]]
FILLERS.update({
    "k": number(2, 5), "hours": number(1, 9), "minutes": number(1, 59), "low": number(0, 10),
    "high": number(50, 200),
})
CODE_TEMPLATES = WORDS["CODE_TEMPLATES"]
CODE_EXTRAS = WORDS["CODE_EXTRAS"]


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


CODE_QUESTIONS = WORDS["CODE_QUESTIONS"]


def code_question(rng: random.Random) -> str:
    return shaped(rng, rng.choice(CODE_QUESTIONS), constraints=CODE_QUESTION_ASKS, contexts=[])


CODE_QUESTION_ASKS = WORDS["CODE_QUESTION_ASKS"]


SQL_TABLES = WORDS["SQL_TABLES"]
SQL_TEMPLATES = WORDS["SQL_TEMPLATES"]


def sql_task(rng: random.Random) -> str:
    schema = rng.choice(list(SQL_TABLES))
    question = fill(rng, rng.choice(SQL_TABLES[schema]))
    return fill(rng, rng.choice(SQL_TEMPLATES), schema=schema, question=question)


SHELL_TASKS = WORDS["SHELL_TASKS"]
SHELL_TEMPLATES = WORDS["SHELL_TEMPLATES"]


def shell_task(rng: random.Random) -> str:
    return fill(rng, rng.choice(SHELL_TEMPLATES), task=fill(rng, rng.choice(SHELL_TASKS)))


def coding(rng: random.Random) -> str:
    return rng.choices([code_task, code_question, sql_task, shell_task], weights=[6, 2, 2, 1])[0](rng)


# Debugging: a short buggy snippet with random names, its symptom, and a question around it.
VARIABLES = WORDS["VARIABLES"]


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
FENCE_TAGS = WORDS["FENCE_TAGS"]


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


MATH_ASKS = WORDS["MATH_ASKS"]


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


RIDDLES = WORDS["RIDDLES"]


def puzzles(rng: random.Random) -> str:
    if rng.random() < 0.1:
        return shaped(rng, fill(rng, rng.choice(RIDDLES)), constraints=[])
    return with_ask(rng, logic_puzzle(rng), PUZZLE_ASKS)


PUZZLE_ASKS = WORDS["PUZZLE_ASKS"]


# --- creative writing ---------------------------------------------------------------------------------------------

CREATIVE_TEMPLATES = WORDS["CREATIVE_TEMPLATES"]


# --- editing: fix, rewrite, shorten and turn notes into prose -------------------------------------------------------

ERRONEOUS_SENTENCES = WORDS["ERRONEOUS_SENTENCES"]
# Texts to edit, by what is asked of them.
EDIT_TEXTS = WORDS["EDIT_TEXTS"]
NOTE_FRAGMENTS = WORDS["NOTE_FRAGMENTS"]
EDIT_INSTRUCTIONS = WORDS["EDIT_INSTRUCTIONS"]


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
PASSAGES = WORDS["PASSAGES"]
FILLERS.update({
    "project_cost": lambda rng: f"${rng.randint(2, 60) / 2:g} million",
    "topic_title": lambda rng: capitalised(rng.choice(TOPICS)),
    "pet_name": lambda rng: rng.choice(PET_NAMES),
    "phone_digits": number(1000, 9999),
})
SUMMARY_INSTRUCTIONS = WORDS["SUMMARY_INSTRUCTIONS"]


def summarising(rng: random.Random) -> str:
    passage = " ".join(fill(rng, rng.choice(slot)) for slot in rng.choice(PASSAGES))
    return framed(rng, rng.choice(SUMMARY_INSTRUCTIONS), passage)


TRANSLATION_SENTENCES = WORDS["TRANSLATION_SENTENCES"]
TRANSLATION_TEMPLATES = WORDS["TRANSLATION_TEMPLATES"]


def translation(rng: random.Random) -> str:
    sentence = fill(rng, rng.choice(TRANSLATION_SENTENCES))
    return fill(rng, rng.choice(TRANSLATION_TEMPLATES), sentence=sentence)


# --- lists, recommendations, comparisons and role-play --------------------------------------------------------------

LIST_TEMPLATES = WORDS["LIST_TEMPLATES"]

# Things people choose between (any comparison template fits) and ideas they contrast (only the neutral ones).
CHOICE_PAIRS = [tuple(item) for item in WORDS["CHOICE_PAIRS"]]
CONCEPT_PAIRS = [tuple(item) for item in WORDS["CONCEPT_PAIRS"]]
COMPARISON_TEMPLATES = WORDS["COMPARISON_TEMPLATES"]
CONCEPT_TEMPLATES = WORDS["CONCEPT_TEMPLATES"]
CHOICE_TEMPLATES = WORDS["CHOICE_TEMPLATES"]


def comparison(rng: random.Random) -> str:
    if rng.random() < 0.6:  # choices keep their order: the second often leans on the first ("fresh ones")
        a, b = rng.choice(CHOICE_PAIRS)
        template = rng.choice([*CHOICE_TEMPLATES, *COMPARISON_TEMPLATES])
    else:
        a, b = rng.sample(rng.choice(CONCEPT_PAIRS), 2)
        template = rng.choice([*CONCEPT_TEMPLATES, *COMPARISON_TEMPLATES])
    prompt = fill(rng, template, a=capitalised(a) if template.startswith("{a}") else a, b=b)
    return shaped(rng, prompt)


ROLES = WORDS["ROLES"]
ROLE_TASKS = WORDS["ROLE_TASKS"]
ROLEPLAY_TEMPLATES = WORDS["ROLEPLAY_TEMPLATES"]


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
    (make_text, WORDS["EXTRACTION_ASKS"][make_text.__name__])
    for make_text in (dates_text, people_text, receipt_text, contacts_text, review_text, record_text, support_text)
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


REVIEW_ENDINGS = WORDS["REVIEW_ENDINGS"]
CATEGORY_SORTS = [tuple(item) for item in WORDS["CATEGORY_SORTS"]]
SUPPORT_MESSAGES = WORDS["SUPPORT_MESSAGES"]
FACT_OR_OPINION = WORDS["FACT_OR_OPINION"]

FACTUAL_QUESTIONS = WORDS["FACTUAL_QUESTIONS"]
YES_NO_TEMPLATES = WORDS["YES_NO_TEMPLATES"]
FILLERS.update({
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


# Built-in prompt files shipped with the package. `natural:eval`: 82 prompts written by hand for
# evaluation (chat, code, arithmetic, facts, writing, editing, advice, reasoning, long requests,
# role-play, lists), deliberately unlike the demo generator's templates: held-out acceptance on
# prompts that no training generator produced.
# `natural:validation`: 42 more, written the same way, for validation sources (see prepare_conversations).
BUILTIN_SOURCES = {
    "natural:eval": Path(__file__).parent / "files" / "natural_prompts.jsonl",
    "natural:validation": Path(__file__).parent / "files" / "natural_validation_prompts.jsonl",
}
