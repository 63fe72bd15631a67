"""Writes arith-word: arithmetic word problems in the GSM8K shape, small enough for the CPU demo's model.

Each row is ``{"question": ..., "answer": "<a> + <b> = <n>\\n#### <n>"}`` (GSM8K's ``question`` and
``answer`` keys, the final answer after ``####``): a single digit plus or minus `SECOND` (1), the result a
single digit too, told with a name, a thing and one of several wordings. That is 18 distinct sums behind
many wordings: few enough for the CPU demo's tiny model to learn by RL in minutes (with 1 or 2, 34 sums,
its reward had barely moved after 66 steps; all 110 single-digit sums are further still). Deterministic:
the same seed writes the same files, byte for byte.

    python data/arith-word/generate.py [--out data/arith-word] [--train 2000] [--test 200] [--seed 0]
                                       [--first 2 7]

``--first`` keeps only problems whose first number is one of those given (a smaller set of sums, for a
quick test that RL learns); without it every single-digit sum is written.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ("Ann", "Ben", "Cal", "Dot", "Eve", "Fay", "Gus", "Hal")
THINGS = ("apples", "cards", "coins", "pens", "eggs", "cups")
SECOND = (1,)
# The question comes first and the facts last: the tiny model attends mostly to the last tokens, so the
# numbers and the verb that decide the answer sit at (nearly) fixed distances from the end of the prompt.
ADD = ("How many {things} does {name} have now? {name} had {a}, then found {b}.",
       "How many {things} are there now? {name} had {a}, then got {b}.")
SUBTRACT = ("How many {things} does {name} have now? {name} had {a}, then lost {b}.",
            "How many {things} are there now? {name} had {a}, then used {b}.")


def problem(rng: random.Random, first: frozenset[int] | None = None) -> dict[str, str]:
    while True:
        row, a = _problem(rng)
        if first is None or a in first:
            return row


def _problem(rng: random.Random) -> tuple[dict[str, str], int]:
    name, things = rng.choice(NAMES), rng.choice(THINGS)
    b = rng.choice(SECOND)
    if rng.random() < 0.5:
        a = rng.randrange(10 - b)  # the sum stays a single digit
        text, result, sign = rng.choice(ADD), a + b, "+"
    else:
        a = rng.randrange(b, 10)  # never below zero
        text, result, sign = rng.choice(SUBTRACT), a - b, "-"
    return {"question": text.format(name=name, things=things, a=a, b=b),
            "answer": f"{a} {sign} {b} = {result}\n#### {result}"}, a


def write(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first", type=int, nargs="+", metavar="N", help="only these first numbers (0-9)")
    args = parser.parse_args()
    if args.first is not None and not set(args.first) <= set(range(10)):
        parser.error("--first takes single digits (0-9)")
    first = frozenset(args.first) if args.first is not None else None
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    write(args.out / "train.jsonl", [problem(rng, first) for _ in range(args.train)])
    write(args.out / "test.jsonl", [problem(rng, first) for _ in range(args.test)])


if __name__ == "__main__":
    main()
