"""The weight publisher over each transport (MPI, and a torch.distributed group: gloo here, NCCL on GPUs):
three ranks, bit-identical tensors (copied or cast into staging, staged and sent in one call or two),
versions that arrive, a manifest only when the layout changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_under_mpiexec

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("transport", ["mpi", "torch"])
def test_three_ranks_receive_bit_identical_versions(tmp_path: Path, transport: str) -> None:
    done = run_under_mpiexec(3, "tests.weights.broadcast_ranks", str(tmp_path), transport)
    assert done.returncode == 0, done.stdout + done.stderr
    sent = json.loads((tmp_path / "rank0.json").read_text())
    assert [v["version"] for v in sent] == [1, 2, 3]
    assert all(v["buckets"] >= 3 for v in sent)  # small buckets: the set really travels in several
    assert [v["manifest_sent"] for v in sent] == [True, False, True]  # only when the layout changes
    for rank in (1, 2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [v["version"] for v in got] == [1, 2, 3], f"rank {rank}"
        for s, g in zip(sent, got):
            assert g["digests"] == s["digests"], f"rank {rank} version {s['version']}"
            assert g["shapes"] == s["shapes"] and g["dtypes"] == s["dtypes"]
            assert len(g["bucket_names"]) == s["buckets"]
            assert ["model.layers.0.mlp.down_proj.weight"] in g["bucket_names"]  # the oversized tensor, alone
        assert got[0]["digests"] != got[1]["digests"]  # two different versions, not one received twice
