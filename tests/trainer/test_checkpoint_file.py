"""Trainer checkpoint files hold tensors and plain data only, and are read without unpickling anything else:
a file in a run folder that another user can write must not make a resume run code."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from sfhpc.trainer import checkpoint as ckpt
from sfhpc.trainer.errors import CheckpointError


class _RunsCode:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("touch ran-code",))


def test_the_rng_streams_round_trip_through_a_weights_only_file(tmp_path: Path) -> None:
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    path = ckpt.save_atomic({"rng": ckpt.rng_state(), "step": 7}, tmp_path / "trainer.pt")
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    state = ckpt.load(path)
    ckpt.set_rng_state(state["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
    assert state["step"] == 7


def test_a_file_that_would_run_code_is_refused_and_runs_nothing(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "trainer.pt"
    torch.save({"format": ckpt.FORMAT, "format_version": ckpt.FORMAT_VERSION, "model": _RunsCode()}, path)
    with pytest.raises(CheckpointError, match="cannot read checkpoint as tensors and plain data"):
        ckpt.load(path)
    assert not (tmp_path / "ran-code").exists()
