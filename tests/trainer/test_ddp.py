"""Two trainer ranks under mpiexec (DDP over gloo, rendezvous agreed over MPI) stay bit-identical and
match one rank trained on the same global batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.mpi


def test_two_ranks_hold_identical_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(["mpiexec", "--oversubscribe", "--bind-to", "none", "-n", "2", sys.executable, "-m",
                           "tests.trainer.ddp_ranks", str(tiny_model_dir), str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert (r0["world"], r1["world"]) == (2, 2)
    assert r0["weights"] == r1["weights"]  # bit-identical (JSON floats round-trip exactly)
    assert r0["metrics"] == [{**m, "seconds": r0["metrics"][i]["seconds"]} for i, m in enumerate(r1["metrics"])]
    # Data parallel over halves of the rows == one rank on all of them (up to float summation order).
    for name, values in r0["single_weights"].items():
        torch.testing.assert_close(torch.tensor(r0["weights"][name]), torch.tensor(values), rtol=1e-4, atol=1e-5)
    for ddp, single in zip(r0["metrics"], r0["single_metrics"]):
        assert ddp["tokens"] == single["tokens"]
        assert ddp["loss"] == pytest.approx(single["loss"], rel=1e-4, abs=1e-6)
        assert ddp["mean_ratio"] == pytest.approx(single["mean_ratio"], rel=1e-5)
    assert (tmp_path / "ddp.pt").is_file()
