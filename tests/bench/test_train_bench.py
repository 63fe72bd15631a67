"""`sfhpc bench train`'s megatron settings: on a machine without CUDA they are refused in one line each; through
the tests' CPU shim (`tests/trainer/megatron_shim/site` on ``PYTHONPATH``) they train two data-parallel ranks in
bf16 with the distributed optimizer and recompute, and one float32 rank, beside their plans. The torch
settings run in the GPU check's flow (`tests/trainer/test_gpu_check.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.mpi  # ranks of their own (torch.distributed over gloo)

ARGS = ["--shape", "tiny", "--vocab", "0", "--ranks", "2", "--rows", "8", "--length", "64",
        "--micro-batch-tokens", "128", "--steps", "2", "--settings", "megatron-bf16-dopt-ckpt,megatron-fp32"]


def bench(tmp_path: Path, *, shim: bool) -> tuple[subprocess.CompletedProcess[str], dict]:
    site = [str(ROOT / "tests" / "trainer" / "megatron_shim" / "site")] if shim else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*site, str(ROOT)]))
    out = tmp_path / ("shim.json" if shim else "plain.json")
    done = subprocess.run([sys.executable, "-m", "sfhpc.bench.train", *ARGS, "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(out.read_text())


def test_megatron_settings_train_beside_their_plan_or_are_refused(tmp_path: Path) -> None:
    done, report = bench(tmp_path, shim=False)
    assert "megatron-bf16-dopt-ckpt: refused: megatron-core needs CUDA GPUs" in done.stdout
    assert all(s == {"refused": True, "why": "no CUDA"} for s in report["settings"].values())

    done, report = bench(tmp_path, shim=True)
    sharded, whole = report["settings"]["megatron-bf16-dopt-ckpt"], report["settings"]["megatron-fp32"]
    assert len(sharded["results"]) == 2 and len(whole["results"]) == 1
    # The plan of each: bf16 weights beside float32 masters split over the two ranks, or float32 weights whole.
    params = whole["results"][0]["params"]
    assert sharded["plan"]["weights"] == 2 * params and sharded["plan"]["master weights"] == 4 * params // 2
    assert sharded["plan"]["optimizer"] == 8 * params // 2 and whole["plan"]["optimizer"] == 8 * params
    assert whole["plan"]["weights"] == 4 * params and "master weights" not in whole["plan"]
    for entry in (sharded, whole):  # trained: each rank's own rows, two steps (the peak and the rate beside it)
        assert entry["tokens_per_s"] > 0 and entry["peak"] > 0 and entry["grad_norm"] > 0
        assert all(len(r["step_s"]) == 2 for r in entry["results"])
    assert "peak per rank" in done.stdout and "megatron-bf16-dopt-ckpt" in done.stdout.split("setting")[-1]
