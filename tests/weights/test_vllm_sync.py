"""Weights into a running vLLM engine over MPI: a trainer rank publishes, an engine rank loads them while
it serves, and greedy generation shows the new weights (and, with the original weights back, the old
output again)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sfhpc.config.recipe import ModelSpec
from sfhpc.model.tiny import build_tiny_model
from tests.conftest import ROOT

pytestmark = [pytest.mark.mpi, pytest.mark.vllm]


def test_trainer_publishes_into_a_running_vllm_engine(tmp_path: Path) -> None:
    model_dir = build_tiny_model(ModelSpec(), tmp_path / "tiny", seed=0)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(["mpiexec", "--oversubscribe", "--bind-to", "none", "-n", "2", sys.executable, "-m",
                           "tests.weights.vllm_ranks", str(model_dir), str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    trainer = json.loads((tmp_path / "rank0.json").read_text())
    engine = json.loads((tmp_path / "rank1.json").read_text())

    assert trainer["manifest_sent"] == [True, False]  # same layout: version 2 travels without a manifest
    assert [v["version"] for v in engine["loaded"]] == [1, 2] and engine["engine_versions"] == [1, 2]
    loaded = engine["loaded"][0]
    assert loaded["buckets"] == trainer["buckets"][0] >= 3  # several buckets, loaded one at a time
    assert loaded["largest_bucket"] <= 1 << 20

    before, after, restored = engine["before"], engine["after_v1"], engine["after_v2"]
    assert len(before["tokens"]) == len(after["tokens"]) == 16
    assert before["versions"] == [0] * 16
    # Version 1 generates, and differently: the broadcast weights are the ones in use.
    assert after["engine_version"] == 1 and after["versions"] == [1] * 16
    assert after["tokens"] != before["tokens"]
    # The original weights as version 2 bring the original output back: the change came from the weights.
    assert restored["engine_version"] == 2 and restored["versions"] == [2] * 16
    assert restored["tokens"] == before["tokens"]
    assert engine["finished"]
