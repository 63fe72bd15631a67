"""Writes arith-word: arithmetic word problems in the GSM8K shape, small enough for the CPU demo's model.

Each row is ``{"question": ..., "answer": "<a> + <b> = <n>\\n#### <n>"}`` (GSM8K's ``question`` and
``answer`` keys, the final answer after ``####``): one addition or subtraction of single digits whose
result is a single digit too, told with a name and a thing. Deterministic: the same seed writes the same
files, byte for byte.

    python data/arith-word/generate.py [--out data/arith-word] [--train 2000] [--test 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ("Ann", "Ben", "Cal", "Dot", "Eve", "Fay", "Gus", "Hal")
THINGS = ("apples", "cards", "coins", "pens", "eggs", "cups")
ADD = ("{name} has {a} {things} and gets {b} more. How many {things} now?",
       "{name} had {a} {things}, then found {b}. How many {things} in all?")
SUBTRACT = ("{name} has {a} {things} and gives {b} away. How many {things} now?",
            "{name} had {a} {things}, then lost {b}. How many {things} are left?")


def problem(rng: random.Random) -> dict[str, str]:
    name, things = rng.choice(NAMES), rng.choice(THINGS)
    if rng.random() < 0.5:
        a = rng.randrange(10)
        b = rng.randrange(10 - a)  # the sum stays a single digit
        text, result, sign = rng.choice(ADD), a + b, "+"
    else:
        a = rng.randrange(10)
        b = rng.randrange(a + 1)  # never below zero
        text, result, sign = rng.choice(SUBTRACT), a - b, "-"
    return {"question": text.format(name=name, things=things, a=a, b=b),
            "answer": f"{a} {sign} {b} = {result}\n#### {result}"}


def write(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    write(args.out / "train.jsonl", [problem(rng) for _ in range(args.train)])
    write(args.out / "test.jsonl", [problem(rng) for _ in range(args.test)])


if __name__ == "__main__":
    main()
