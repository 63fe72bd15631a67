"""megatron-core backend on two ranks under mpiexec (CPU, through the test-only shim): data parallel 2 (with
the distributed optimizer, float32 and bf16 with full recompute), tensor parallel 2 and pipeline parallel 2.
In each layout both ranks publish bit-identical weights in HF names, every layout matches the torch backend
trained on the same batches (bf16 within its precision), and a checkpoint resumes bit-exactly. This proves
the wiring (process groups, DDP gradient averaging or the distributed optimizer's reduce-scatter and
all-gather, tensor-parallel gathering of fused and sharded weights, vocab-parallel log-probabilities, the
pipeline schedule and stage-to-stage weight gathering, checkpoint parts and optimizer shards), not speed:
megatron-core's real home is the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.mpi


def test_data_and_tensor_parallel_ranks_agree(tmp_path: Path) -> None:
    from tests.trainer.megatron_shim.models import build_gqa_model

    model_dir = build_gqa_model(tmp_path / "model")  # 2 key/value heads: one query group per TP rank
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(["mpiexec", "--oversubscribe", "--bind-to", "none", "-n", "2", sys.executable, "-m",
                           "tests.trainer.megatron_shim.ranks", str(model_dir), str(tmp_path), "1x1", "2x1", "1x2",
                           "1x1:bf16,recompute"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reference = json.loads((tmp_path / "torch.json").read_text())
    # bf16 is compared within its precision (8 bits of mantissa); its master weights and Adam stay float32.
    tolerance = {"1x1_bf16_recompute": (2e-2, 1e-2)}
    layouts = {"1x1": [1, 1, 2], "2x1": [2, 1, 1], "1x2": [1, 2, 1], "1x1_bf16_recompute": [1, 1, 2]}
    for layout, sizes in layouts.items():
        r0 = json.loads((tmp_path / layout / "rank0.json").read_text())
        r1 = json.loads((tmp_path / layout / "rank1.json").read_text())
        assert r0["sizes"] == r1["sizes"] == sizes
        assert r0["weights"] == r1["weights"]  # bit-identical on both ranks (JSON floats round-trip exactly)
        assert r0["resumed"] and r1["resumed"], layout  # the checkpoint's next step is the same step, bit for bit
        assert set(r0["weights"]) == set(reference["weights"])
        assert [m["loss"] for m in r0["metrics"]] == [m["loss"] for m in r1["metrics"]]
        rel, atol = tolerance.get(layout, (1e-3, 2e-4))
        for name, values in reference["weights"].items():
            torch.testing.assert_close(torch.tensor(r0["weights"][name]), torch.tensor(values),
                                       rtol=rel, atol=atol, msg=f"{layout} {name}")
        for got, want in zip(r0["metrics"], reference["metrics"]):
            assert got["tokens"] == want["tokens"] and got["sequences"] == want["sequences"]
            assert got["loss"] == pytest.approx(want["loss"], rel=rel, abs=1e-5)
            assert got["mean_ratio"] == pytest.approx(want["mean_ratio"], rel=max(rel, 1e-4))
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=rel)
    # Two data-parallel replicas on CPUs: the optimizer is sharded by default (auto), one file of it per rank.
    assert json.loads((tmp_path / "1x1" / "rank0.json").read_text())["memory"]["distributed_optimizer"]
    assert {p.name for p in (tmp_path / "1x1").glob("megatron.pt*")} == {"megatron.pt", "megatron.pt.dp0",
                                                                         "megatron.pt.dp1"}
    bf16 = json.loads((tmp_path / "1x1_bf16_recompute" / "rank0.json").read_text())["memory"]
    assert bf16 == {"bf16": True, "distributed_optimizer": True, "recompute": True, "sequence_parallel": False}
    # Tensor parallel: one checkpoint part per model-parallel rank, the (0, 0) part at the plain path.
    assert {p.name for p in (tmp_path / "2x1").glob("megatron.pt*")} == {"megatron.pt", "megatron.pt.tp1-pp0"}
    assert {p.name for p in (tmp_path / "1x2").glob("megatron.pt*")} == {"megatron.pt", "megatron.pt.tp0-pp1"}


def test_qwen2_tensor_and_pipeline_parallel_ranks_agree_with_torch(tmp_path: Path) -> None:
    """Qwen2: the q/k/v biases split with their query groups over tensor-parallel ranks, and the tied
    embedding is shared between the first and the last pipeline stage; both publish the torch backend's
    names and weights."""
    from sfhpc.model.hf_folder import build_hf_model

    model_dir = build_hf_model(tmp_path / "model", "qwen2", kv_heads=2, dtype="float32")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(["mpiexec", "--oversubscribe", "--bind-to", "none", "-n", "2", sys.executable, "-m",
                           "tests.trainer.megatron_shim.ranks", str(model_dir), str(tmp_path), "2x1", "1x2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reference = json.loads((tmp_path / "torch.json").read_text())
    assert "model.layers.0.self_attn.q_proj.bias" in reference["weights"]
    assert "lm_head.weight" not in reference["weights"]
    for layout in ("2x1", "1x2"):
        r0 = json.loads((tmp_path / layout / "rank0.json").read_text())
        r1 = json.loads((tmp_path / layout / "rank1.json").read_text())
        assert r0["weights"] == r1["weights"] and set(r0["weights"]) == set(reference["weights"])
        for name, values in reference["weights"].items():
            torch.testing.assert_close(torch.tensor(r0["weights"][name]), torch.tensor(values), rtol=1e-3, atol=2e-4,
                                       msg=f"{layout} {name}")
        assert r0["resumed"] and r1["resumed"], layout
        for got, want in zip(r0["metrics"], reference["metrics"]):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-3, abs=1e-5)
