"""Write a GSM8K-format dataset of small word problems: JSONL rows with ``question`` and
``answer`` (the working, then ``#### N``), plus ``level`` (1 or 2 steps).

    python examples/wordproblems/make_data.py [--out DIR] [--train N] [--test N] [--seed S]

writes ``DIR/train.jsonl`` and ``DIR/test.jsonl`` (default ``runs/data/wordproblems``), the
files ``examples/wordproblems/config.yaml`` trains on through the ``dataset`` workload exactly
as it would on GSM8K itself. Problems are generated from templates (names, objects, verbs), so
nothing is downloaded; a question never appears in both files.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Tom", "Sara", "Ali", "Mia", "Ben", "Lena", "Omar", "Ivy", "Noah", "Zoe", "Raj", "Eva"]
ITEMS = ["apples", "books", "coins", "stamps", "cards", "pens", "shells", "marbles", "cookies", "stickers"]


def _add(rng: random.Random) -> tuple[str, str]:
    n, it, a, b = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(1, 20), rng.randint(1, 9)
    q = rng.choice([f"{n} has {a} {it} and gets {b} more. How many {it} does {n} have now?",
                    f"{n} found {a} {it} on Monday and {b} {it} on Tuesday. How many {it} did {n} find?"])
    return q, f"{a} + {b} = {a + b}\n#### {a + b}"


def _sub(rng: random.Random) -> tuple[str, str]:
    n, it, a = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(2, 20)
    b = rng.randint(1, a - 1)
    q = rng.choice([f"{n} had {a} {it} and gave away {b}. How many {it} does {n} have left?",
                    f"There are {a} {it} in a box. {n} takes {b} of them. How many {it} are still in the box?"])
    return q, f"{a} - {b} = {a - b}\n#### {a - b}"


def _mul(rng: random.Random) -> tuple[str, str]:
    n, it, a, b = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(2, 5), rng.randint(2, 9)
    q = rng.choice([f"{n} buys {a} bags with {b} {it} in each bag. How many {it} does {n} buy?",
                    f"{n} gets {b} {it} every day for {a} days. How many {it} does {n} get?"])
    return q, f"{a} * {b} = {a * b}\n#### {a * b}"


def _two_step(rng: random.Random) -> tuple[str, str]:
    n, it, a, b = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(2, 12), rng.randint(1, 9)
    c = rng.randint(1, a + b - 1)
    q = f"{n} has {a} {it}, buys {b} more and then gives {c} to a friend. How many {it} does {n} have now?"
    return q, f"{a} + {b} = {a + b}\n{a + b} - {c} = {a + b - c}\n#### {a + b - c}"


FAMILIES = [(_add, 1), (_sub, 1), (_mul, 1), (_two_step, 2)]


def generate(n: int, rng: random.Random, seen: set[str]) -> list[dict]:
    rows = []
    while len(rows) < n:
        make, level = rng.choice(FAMILIES)
        question, answer = make(rng)
        if question not in seen:
            seen.add(question)
            rows.append({"question": question, "answer": answer, "level": level})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/data/wordproblems", help="directory for train.jsonl and test.jsonl")
    ap.add_argument("--train", type=int, default=20000, help="training problems")
    ap.add_argument("--test", type=int, default=400, help="held-out problems")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng, seen = random.Random(args.seed), set()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, n in (("test", args.test), ("train", args.train)):  # test first: train never repeats it
        rows = generate(n, rng, seen)
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {n} problems to {out / f'{name}.jsonl'}")


if __name__ == "__main__":
    main()
