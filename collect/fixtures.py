"""Small offline fixture datasets in the real column formats of the OpenCompass-style workloads.

The demo and the tests have no hub access, so they collect on these: a few dozen
deterministic, template-generated rows per dataset with correct answers, written as
``<name>.jsonl`` files that ``--data-dir`` picks up exactly like a user's local copy
of the real dataset.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moecast.collect.traceset import atomic_write_bytes

NAMES = ["Ava", "Ben", "Chen", "Dana", "Eli", "Fatima", "Goro", "Hana", "Ivan", "Julia"]
ITEMS = ["apples", "books", "marbles", "stamps", "coins", "pencils", "cookies", "shells"]
CAPITALS = [
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Canada", "Ottawa"),
    ("Egypt", "Cairo"),
    ("Norway", "Oslo"),
    ("Chile", "Santiago"),
    ("India", "New Delhi"),
    ("Spain", "Madrid"),
]
WIC = [
    ("bank", "She sat on the bank of the river.", "The bank approved the loan.", False),
    ("bank", "He deposited cash at the bank.", "The bank closes at five.", True),
    ("bright", "The room was bright with sunlight.", "She is a bright student.", False),
    ("run", "They run every morning.", "I run five miles before work.", True),
    ("light", "Turn on the light.", "The box is light enough to carry.", False),
    ("plant", "Water the plant daily.", "The plant by the window needs sun.", True),
    ("bat", "The bat flew out of the cave.", "He swung the bat hard.", False),
    ("key", "I lost my house key.", "This key opens the front door.", True),
]


def _gsm8k(rng: random.Random) -> dict[str, Any]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(3, 40), rng.randint(2, 9), rng.randint(1, 20)
    total = a * b - c
    q = f"{name} buys {b} boxes of {item} with {a} {item} in each box, then gives away {c} {item}. How many {item} does {name} have now?"
    return {
        "question": q,
        "answer": f"{name} had {a}*{b}={a * b} {item}. After giving away {c}, {a * b}-{c}={total}.\n#### {total}",
    }


def _boolq(rng: random.Random) -> dict[str, Any]:
    country, capital = rng.choice(CAPITALS)
    if rng.random() < 0.5:
        other = capital
        answer = True
    else:
        other = rng.choice([c for _, c in CAPITALS if c != capital])
        answer = False
    passage = (
        f"{country} is a country whose capital and seat of government is {capital}. It has a long history."
    )
    return {
        "question": f"is {other.lower()} the capital of {country.lower()}",
        "passage": passage,
        "answer": answer,
    }


def _race(rng: random.Random) -> dict[str, Any]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    n = rng.randint(2, 9)
    article = f"{name} collects {item}. Last week {name} found {n} new {item} at the market and showed them to friends at school."
    options = [str(n), str(n + 1), str(n + 3), str(max(1, n - 1))]
    order = rng.sample(range(4), 4)
    opts = [options[i] for i in order]
    return {
        "article": article,
        "question": f"How many new {item} did {name} find?",
        "options": opts,
        "answer": "ABCD"[opts.index(str(n))],
    }


def _wic(rng: random.Random) -> dict[str, Any]:
    word, s1, s2, same = rng.choice(WIC)
    return {"word": word, "sentence1": s1, "sentence2": s2, "label": same}


def _triviaqa(rng: random.Random) -> dict[str, Any]:
    country, capital = rng.choice(CAPITALS)
    return {
        "question": f"What is the capital city of {country}?",
        "answer": {"value": capital, "aliases": [capital, capital.lower()]},
    }


def _gaokao(rng: random.Random) -> dict[str, Any]:
    while True:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        choices = [a * b, a * b + a, a + b, a * b - b]
        if len(set(choices)) == 4:
            break
    order = rng.sample(range(4), 4)
    opts = [choices[i] for i in order]
    q = f"若 x = {a}, y = {b}, 则 xy 的值为 ( ) A. {opts[0]} B. {opts[1]} C. {opts[2]} D. {opts[3]}"
    return {"question": q, "answer": "ABCD"[opts.index(a * b)]}


GENERATORS: dict[str, Callable[[random.Random], dict[str, Any]]] = {
    "gsm8k": _gsm8k,
    "boolq": _boolq,
    "race-middle": _race,
    "wic": _wic,
    "triviaqa": _triviaqa,
    "gaokao": _gaokao,
}


def write_fixtures(
    directory: str | Path, rows: int = 24, seed: int = 0, names: list[str] | None = None
) -> Path:
    """Write ``<name>.jsonl`` fixture files for the built-in workloads into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name in names or list(GENERATORS):
        rng = random.Random(f"{seed}:{name}")
        lines = [json.dumps(GENERATORS[name](rng), ensure_ascii=False) for _ in range(rows)]
        atomic_write_bytes(directory / f"{name}.jsonl", ("\n".join(lines) + "\n").encode())
    return directory
