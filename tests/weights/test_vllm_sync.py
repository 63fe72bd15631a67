"""Weights into a running vLLM engine over each transport (MPI to the rank; a torch.distributed group, gloo
here, that vLLM's worker joins and receives into itself; delta updates over MPI, applied by the rank; staged
updates over either, received beside the weights that generate while a generation goes on): a trainer rank
publishes, the engine loads them while it serves, greedy generation shows the new weights (and, with the
original weights back, the old output again), and the trainer's logprobs of a reply the engine sampled match
the engine's.

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

STREAMS = ("mpi", "torch", "mpi-delta", "torch-staged", "mpi-staged")


def test_trainer_publishes_into_a_running_vllm_engine_over_each_transport(tmp_path: Path) -> None:
    # A Qwen2 folder (biases on q, k and v; tied embeddings), as a user's Qwen2.5 would be.
    model_dir = build_tiny_model(ModelSpec(build=BuildSpec(architecture="qwen2")), tmp_path / "tiny", seed=0)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(["mpiexec", "--oversubscribe", "--bind-to", "none", "-n", "2", sys.executable, "-m",
                           "tests.weights.vllm_ranks", str(model_dir), str(tmp_path), ",".join(STREAMS)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    trainer = json.loads((tmp_path / "rank0.json").read_text())
    engine = json.loads((tmp_path / "rank1.json").read_text())
    before = engine["before"]
    assert len(before["tokens"]) == 16 and before["versions"] == [0] * 16

    for index, stream in enumerate(STREAMS):
        sent, got = trainer[stream], engine[stream]
        perturbed, restored = 2 * index + 1, 2 * index + 2
        assert sent["transport"] == {"mpi": "MPITransport", "torch": "TorchTransport"}[stream.split("-")[0]]
        assert got["lands_in_engine"] == stream.startswith("torch")  # the worker received the buckets, not the rank
        if stream.endswith("-staged"):
            # Each version came in beside the weights that generated (the worker's second copy, or the rank's
            # copy) with no pause: a generation started before it ran on, every token from the version before.
            assert [s["beside"] for s in got["staged"]] == [True, True], got["staged"]
            assert [s["pauses"] for s in got["staged"]] == [0, 0], got["staged"]
            assert [s["versions"] for s in got["staged"]] == [[perturbed - 1], [perturbed]], got["staged"]
            assert all(s["tokens"] == 16 for s in got["staged"]), got["staged"]
        assert sent["manifest_sent"] == [True, False]  # same layout: the second version travels without one
        assert [v["version"] for v in got["loaded"]] == got["engine_versions"] == [perturbed, restored]
        assert got["loaded"][0]["buckets"] == sent["buckets"][0] >= 3  # several buckets, loaded one at a time
        if stream == "mpi-delta":  # the restore, a tenth of the words, went as a delta: under a third of the bytes
            assert sent["wire_bytes"][0] == sent["bytes"][0] and sent["wire_bytes"][1] < sent["bytes"][1] / 3, sent
        assert got["loaded"][0]["largest_bucket"] <= 1 << 20
        # The perturbed weights generate, and differently: the broadcast weights are the ones in use.
        assert got["perturbed"]["engine_version"] == perturbed and got["perturbed"]["versions"] == [perturbed] * 16
        assert got["perturbed"]["tokens"] != before["tokens"]
        # The original weights back bring the original output back: the change came from the weights.
        assert got["restored"]["engine_version"] == restored and got["restored"]["versions"] == [restored] * 16
        assert got["restored"]["tokens"] == before["tokens"]
        assert got["finished"]
        # The engine sampled with the weights the trainer holds: the trainer's float32 logprobs of those tokens
        # match the engine's (bf16 weights) closely; with a stale layer they would not.
        sampled, scored = got["sampled"], sent["scored_logprobs"]
        assert sampled["versions"] == [perturbed] * 16 and len(scored) == 16
        gaps = [abs(a - b) for a, b in zip(sampled["logprobs"], scored)]
        assert max(gaps) < 0.1 and sum(gaps) / len(gaps) < 0.03, (stream, gaps)
    # The same weights arrived either way: the same greedy output.
    assert engine["mpi"]["perturbed"]["tokens"] == engine["torch"]["perturbed"]["tokens"]
