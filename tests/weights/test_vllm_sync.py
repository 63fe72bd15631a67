"""Weights into a running vLLM engine over each transport (MPI to the rank; a torch.distributed group, gloo
here, that vLLM's worker joins and receives into itself): a trainer rank publishes, the engine loads them
while it serves, greedy generation shows the new weights (and, with the original weights back, the old
output again), and the trainer's logprobs of a reply the engine sampled match the engine's.

The folder is a Qwen2 with tied embeddings: on CPUs vLLM keeps a packed copy of the tied output head,
which a reload of the embeddings left stale (logprobs 1.6 nats apart) until the worker re-processed it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sfhpc.config.recipe import BuildSpec, ModelSpec
from sfhpc.model.tiny import build_tiny_model
from tests.conftest import ROOT

pytestmark = [pytest.mark.mpi, pytest.mark.vllm]


@pytest.mark.parametrize("transport", ["mpi", "torch"])
def test_trainer_publishes_into_a_running_vllm_engine(tmp_path: Path, transport: str) -> None:
    # A Qwen2 folder (biases on q, k and v; tied embeddings), as a user's Qwen2.5 would be.
    model_dir = build_tiny_model(ModelSpec(build=BuildSpec(architecture="qwen2")), tmp_path / "tiny", seed=0)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(["mpiexec", "--oversubscribe", "--bind-to", "none", "-n", "2", sys.executable, "-m",
                           "tests.weights.vllm_ranks", str(model_dir), str(tmp_path), transport],
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

    assert trainer["transport"] == {"mpi": "MPITransport", "torch": "TorchTransport"}[transport]
    assert engine["lands_in_engine"] == (transport == "torch")  # the worker received the buckets, not the rank
    # The engine sampled with the weights the trainer holds: the trainer's float32 logprobs of those tokens
    # match the engine's (bf16 weights) closely; with the engine's old weights they would not.
    sampled, scored = engine["sampled"], trainer["scored_logprobs"]
    assert sampled["versions"] == [1] * 16 and len(scored) == 16
    gaps = [abs(a - b) for a, b in zip(sampled["logprobs"], scored)]
    assert max(gaps) < 0.1 and sum(gaps) / len(gaps) < 0.03, gaps
