"""`scripts/gpu_check.py --dry-run`: the GPU machine's check, run on the CPU: a model built, trained by the
torch backend on the device it names, its weights published to a second process, one JSON out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT


def test_the_gpu_check_runs_its_whole_flow_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["device"] == "cpu" and report["dry_run"]
    assert len(report["train_step_s"]) == 2 and report["train_tokens_per_s"] > 0
    # Every bf16 weight of the built model reached the receiver: 2 bytes per parameter.
    assert report["publish_bytes"] == 2 * report["parameters"] > 0
    assert report["trainer_peak_mib"] > 0 and report["receiver_peak_mib"] > 0
    assert "gpu_check: ok" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_without_a_gpu_the_check_says_so_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "gpu_check: error: no CUDA device; run it on a GPU machine, or pass --dry-run"]
    assert not (tmp_path / "gpu_check.json").exists()
