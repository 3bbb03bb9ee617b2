"""A built-in, offline demo set of image prompts for vision-language verifiers, drawn by code (PIL).

Each row is OpenAI-chat shaped: one user message whose content is the image part(s), as
`data:image/png;base64,` URLs, then a question. The kinds: bar charts (labelled bars with their
values; the largest, a value, a comparison, a difference, the count), shapes (coloured circles,
squares and triangles on a grid; counts, colours, positions), rendered text (a word or a number on
a background; read it, spell it backwards, add to it), and a few rows with two images (which has
more circles, the sum of two numbers, the same word or not). Rows carry no answer (the verifier
writes it); `reference_answer` is what the picture says, for checking a verifier by eye.

Image sides are 64 to 224 px in multiples of 32 (Qwen3-VL's patch 16 x spatial merge 2), so an
image is a few dozen vision tokens. The set depends on the split only; `seed` orders it (like
`demo:`), so any prefix mixes the kinds. The splits can never share a row: each has its own
background colours (so no image of one is an image of the other) and its own labels and words.
Rendering uses Pillow's built-in font, so the exact bytes (and conversation ids) follow the Pillow
version installed.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import random
from collections.abc import Callable
from typing import Any

from PIL import Image, ImageDraw, ImageFont

SIDES = (64, 96, 128, 160, 192, 224)
ROWS = {"train": 320, "eval": 40}
# Share of rows per kind (two-image rows are the few).
KINDS = (("bar_chart", 0.3), ("shapes", 0.3), ("text", 0.3), ("two_images", 0.1))
BACKGROUNDS = {  # disjoint: an eval image is never a training image
    "train": [(255, 255, 255), (245, 245, 235), (235, 242, 250), (250, 238, 238), (240, 250, 240)],
    "eval": [(250, 250, 225), (232, 232, 232), (245, 235, 250), (225, 245, 245)],
}
BAR_LABELS = {
    "train": ["ant", "bee", "cat", "dog", "elk", "fox", "hen", "owl", "pig", "yak", "cod", "eel", "ram", "bat"],
    "eval": ["oak", "elm", "ash", "fir", "yew", "fig", "lime", "pine"],
}
WORDS = {
    "train": [
        "apple", "river", "garden", "window", "silver", "rocket", "pencil", "candle", "forest", "planet",
        "button", "ladder", "mirror", "basket", "dragon", "tunnel", "violin", "harbor", "jacket", "marble",
    ],
    "eval": ["anchor", "cactus", "falcon", "lantern", "meadow", "pepper", "saddle", "walnut"],
}  # fmt: skip
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 20),
    "purple": (140, 60, 180),
    "orange": (240, 130, 20),
    "black": (20, 20, 20),
}
BAR_COLOURS = [(70, 110, 200), (200, 90, 60), (60, 150, 90), (150, 90, 170)]
SHAPES = ("circle", "square", "triangle")
INK = [(20, 20, 20), (30, 30, 120), (110, 20, 20), (20, 90, 40)]


@functools.cache
def font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def canvas(rng: random.Random, split: str, width: int, height: int) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    image = Image.new("RGB", (width, height), rng.choice(BACKGROUNDS[split]))
    return image, ImageDraw.Draw(image)


def centred_text(draw: ImageDraw.ImageDraw, xy: tuple[float, float], text: str, size: int, fill: Any) -> None:
    draw.text(xy, text, fill=fill, font=font(size), anchor="mm")


# ----- the kinds: each draws its image(s) and asks about them -----------------------------------------

Drawn = tuple[list[Image.Image], str, str]  # images, question, reference answer


def bar_chart_image(rng: random.Random, split: str) -> tuple[Image.Image, dict[str, int]]:
    width, height = rng.choice([(224, 160), (192, 160), (224, 192), (192, 192), (224, 224)])
    bars = dict(zip(rng.sample(BAR_LABELS[split], rng.randint(3, 5)), rng.sample(range(1, 21), 5), strict=False))
    image, draw = canvas(rng, split, width, height)
    colour = rng.choice(BAR_COLOURS)
    top, bottom, slot = 18, height - 18, (width - 16) / len(bars)
    draw.line([(8, bottom), (width - 8, bottom)], fill=(60, 60, 60))
    for index, (label, value) in enumerate(bars.items()):
        x0 = 8 + index * slot + slot * 0.2
        x1 = 8 + (index + 1) * slot - slot * 0.2
        y0 = bottom - (bottom - top - 12) * value / 20
        draw.rectangle([x0, y0, x1, bottom], fill=colour)
        centred_text(draw, ((x0 + x1) / 2, y0 - 7), str(value), 11, (30, 30, 30))
        centred_text(draw, ((x0 + x1) / 2, bottom + 9), label, 11, (30, 30, 30))
    return image, bars


def bar_chart(rng: random.Random, split: str) -> Drawn:
    image, bars = bar_chart_image(rng, split)
    labels = list(bars)
    a, b = rng.sample(labels, 2)
    question, answer = rng.choice(
        [
            ("Which bar in this chart is the tallest?", max(labels, key=bars.__getitem__)),
            ("Which bar is the shortest?", min(labels, key=bars.__getitem__)),
            (f"What is the value of the {a} bar?", str(bars[a])),
            (f"Is the {a} bar taller than the {b} bar?", "yes" if bars[a] > bars[b] else "no"),
            (f"How much larger is the {a} bar than the {b} bar?", str(bars[a] - bars[b])),
            ("How many bars does the chart have?", str(len(bars))),
            ("What is the total of all the values in the chart?", str(sum(bars.values()))),
        ]
    )
    return [image], question, answer


def shapes_image(rng: random.Random, split: str, count: int | None = None) -> tuple[Image.Image, list[tuple]]:
    """Shapes on a 3 x 3 grid of cells, one per cell: [(kind, colour name, row, column)]."""
    side = rng.choice([128, 160, 192, 224])
    width, height = side, rng.choice([s for s in SIDES if side - 64 <= s <= side])
    image, draw = canvas(rng, split, width, height)
    count = count or rng.randint(1, 5)
    cells = rng.sample([(r, c) for r in range(3) for c in range(3)], count)
    placed = []
    for row, column in cells:
        kind, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        cell_w, cell_h = width / 3, height / 3
        radius = min(cell_w, cell_h) * rng.uniform(0.28, 0.4)
        cx = (column + 0.5) * cell_w + rng.uniform(-0.08, 0.08) * cell_w
        cy = (row + 0.5) * cell_h + rng.uniform(-0.08, 0.08) * cell_h
        box = [cx - radius, cy - radius, cx + radius, cy + radius]
        if kind == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        elif kind == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        else:
            draw.polygon(
                [(cx, cy - radius), (cx + radius, cy + radius), (cx - radius, cy + radius)], fill=COLOURS[colour]
            )
        placed.append((kind, colour, row, column))
    return image, placed


def plural(kind: str) -> str:
    return kind + "s"


def shapes(rng: random.Random, split: str) -> Drawn:
    image, placed = shapes_image(rng, split)
    kinds = [kind for kind, *_ in placed]
    kind = rng.choice(SHAPES)
    options = [
        (f"How many {plural(kind)} are in the picture?", str(kinds.count(kind))),
        ("How many shapes can you see?", str(len(placed))),
    ]
    unique = [p for p in placed if kinds.count(p[0]) == 1]
    if unique:
        only = rng.choice(unique)
        options.append((f"What colour is the {only[0]}?", only[1]))
    described = [p for p in placed if sum(q[:2] == p[:2] for q in placed) == 1]  # colour + kind names it
    if len(described) >= 2:
        first, second = rng.sample(described, 2)
        if first[3] != second[3]:
            side = "left" if first[3] < second[3] else "right"
            options.append(
                (f"Is the {first[1]} {first[0]} to the left or to the right of the {second[1]} {second[0]}?", side)
            )
        if first[2] != second[2]:
            above = "above" if first[2] < second[2] else "below"
            options.append((f"Is the {first[1]} {first[0]} above or below the {second[1]} {second[0]}?", above))
    leftmost = min(p[3] for p in placed)
    if sum(p[3] == leftmost for p in placed) == 1:
        p = next(p for p in placed if p[3] == leftmost)
        options.append(("Which shape is furthest to the left? Give its colour and kind.", f"the {p[1]} {p[0]}"))
    question, answer = rng.choice(options)
    return [image], question, answer


def text_image(rng: random.Random, split: str, text: str) -> Image.Image:
    width = rng.choice([160, 192, 224]) if len(text) > 4 else rng.choice([96, 128, 160])
    height = rng.choice([64, 96])
    image, draw = canvas(rng, split, width, height)
    size = min(rng.randint(22, 34), int(width / (0.62 * len(text))))
    centred_text(draw, (width / 2, height / 2), text, size, rng.choice(INK))
    return image


def rendered_text(rng: random.Random, split: str) -> Drawn:
    if rng.random() < 0.5:
        word = rng.choice(WORDS[split])
        image = text_image(rng, split, word)
        question, answer = rng.choice(
            [
                ("What does the text in this image say?", word),
                ("What word is written in the picture?", word),
                ("Read the word in the image and spell it backwards.", word[::-1]),
                ("How many letters does the word in the image have?", str(len(word))),
            ]
        )
    else:
        number = rng.randint(10, 9999)
        image = text_image(rng, split, str(number))
        question, answer = rng.choice(
            [
                ("What number is written here?", str(number)),
                ("What number does the image show?", str(number)),
                ("Add 7 to the number in the image. What do you get?", str(number + 7)),
                ("Is the number in the picture even or odd?", "even" if number % 2 == 0 else "odd"),
            ]
        )
    return [image], question, answer


def two_images(rng: random.Random, split: str) -> Drawn:
    choice = rng.randrange(3)
    if choice == 0:
        first, placed_1 = shapes_image(rng, split)
        second, placed_2 = shapes_image(rng, split)
        circles = [sum(p[0] == "circle" for p in placed) for placed in (placed_1, placed_2)]
        answer = (
            "the same number"
            if circles[0] == circles[1]
            else ("the first" if circles[0] > circles[1] else "the second")
        )
        return [first, second], "Which of these two images has more circles, the first or the second?", answer
    if choice == 1:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        images = [text_image(rng, split, str(a)), text_image(rng, split, str(b))]
        return images, "What is the sum of the two numbers shown in these images?", str(a + b)
    words = [rng.choice(WORDS[split]) for _ in range(2)]
    images = [text_image(rng, split, word) for word in words]
    return images, "Do these two images show the same word?", "yes" if words[0] == words[1] else "no"


DRAWERS: dict[str, Callable[[random.Random, str], Drawn]] = {
    "bar_chart": bar_chart,
    "shapes": shapes,
    "text": rendered_text,
    "two_images": two_images,
}


# ----- the set -----------------------------------------------------------------------------------------


@functools.cache
def split_rows(split: str) -> tuple[str, ...]:
    """The split's rows as JSON lines, in generation order (distinct: a repeat draw is drawn again)."""
    if split not in ROWS:
        raise ValueError(f"demo-vl split '{split}' is not train or eval")
    rng = random.Random(f"demo-vl:{split}")
    lines: list[str] = []
    seen: set[str] = set()
    for kind, share in KINDS:
        wanted, attempts = round(ROWS[split] * share), 0
        while wanted and attempts < 20 * ROWS[split]:
            attempts += 1
            images, question, answer = DRAWERS[kind](rng, split)
            content: list[dict[str, Any]] = [
                {"type": "image_url", "image_url": {"url": data_url(image)}} for image in images
            ]
            content.append({"type": "text", "text": question})
            line = json.dumps(
                {"messages": [{"role": "user", "content": content}], "reference_answer": answer, "kind": kind},
                sort_keys=True,
            )
            key = json.dumps(content, sort_keys=True)
            if key not in seen:
                seen.add(key)
                lines.append(line)
                wanted -= 1
    return tuple(lines)


def demo_image_rows(split: str = "train", seed: int = 0) -> list[dict[str, Any]]:
    """The `demo-vl:<split>` rows (fresh dicts), in an order seeded by `seed`."""
    lines = list(split_rows(split))
    random.Random(seed).shuffle(lines)
    return [json.loads(line) for line in lines]
