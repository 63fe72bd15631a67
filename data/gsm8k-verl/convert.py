"""Writes data/gsm8k-verl/train.parquet: the arith-word problems (data/arith-word) in the shape verl's GSM8K
preprocessing gives a data file, to show (and test) that such a file and a reward function written for verl
run in sfhpc as they are.

Each row: ``data_source`` ("openai/gsm8k"), ``prompt`` (one user message: the question and the instruction to
end with "####" and the answer), ``ability`` ("math"), ``reward_model`` (``{"style": "rule", "ground_truth":
<the final number>}``) and ``extra_info`` (``split``, ``index``, the worked ``answer`` and the bare
``question``). Deterministic: the same input writes the same file.

    python data/gsm8k-verl/convert.py [--source data/arith-word/train.jsonl] [--out data/gsm8k-verl/train.parquet]
                                      [--rows 256]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def verl_row(index: int, question: str, answer: str, split: str) -> dict:
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer.rpartition("####")[2].strip()},
            "extra_info": {"split": split, "index": index, "answer": answer, "question": question}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=HERE.parent / "arith-word" / "train.jsonl")
    parser.add_argument("--out", type=Path, default=HERE / "train.parquet")
    parser.add_argument("--rows", type=int, default=256)
    args = parser.parse_args()
    lines = args.source.read_text().splitlines()[:args.rows]
    rows = [verl_row(i, row["question"], row["answer"], "train") for i, row in enumerate(map(json.loads, lines))]
    pq.write_table(pa.Table.from_pylist(rows), args.out)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
