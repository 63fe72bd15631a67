"""A tiny float32 model built once per session, and small batches to train it on."""

from __future__ import annotations

from pathlib import Path

import pytest

from sfhpc.config.recipe import BuildSpec, ModelSpec
from sfhpc.engine.tokenizer import ByteTokenizer
from sfhpc.trainer.batch import TrainBatch, TrainRow

TINY = ModelSpec(build=BuildSpec(layers=2, hidden_size=64, heads=1), max_seq_len=64, dtype="float32")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sfhpc.model.tiny import build_tiny_model

    return build_tiny_model(TINY, tmp_path_factory.mktemp("tiny-model"), seed=0)


def toy_batch(rows: int = 8, version: int = 0, seed: int = 0) -> TrainBatch:
    """Rows of a short prompt and 3..6 "generated" bytes with made-up logprobs, rewards and groups of 4."""
    import random

    rng = random.Random(seed)
    prompt = ByteTokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
    out = []
    for i in range(rows):
        n = rng.randint(3, 6)
        gen = [rng.randint(32, 126) for _ in range(n)]
        out.append(TrainRow(tokens=prompt + gen, generated=[False] * len(prompt) + [True] * n,
                            logprobs=[0.0] * len(prompt) + [rng.uniform(-6.0, -4.0) for _ in range(n)],
                            versions=[-1] * len(prompt) + [version] * n, reward=float(rng.random() < 0.5),
                            group=i // 4))
    return TrainBatch.from_rows(out)
