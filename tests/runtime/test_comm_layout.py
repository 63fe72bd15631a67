"""CommLayout over real MPI ranks (mpiexec): each group holds exactly its ranks, with the right root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import RECIPES, ROOT

pytestmark = pytest.mark.mpi


def run_ranks(recipe: str, ranks: int) -> tuple[list[dict], str]:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    done = subprocess.run(["mpiexec", "--oversubscribe", "--bind-to", "none", "-n", str(ranks), sys.executable,
                           str(Path(__file__).parent / "comm_layout_ranks.py"), str(RECIPES / recipe)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def test_disaggregated_layout() -> None:
    seen, described = run_ranks("report.yaml", 4)  # 0 controller, 1 trainer, 2-3 rollout
    assert [s["trainers"] for s in seen] == [None, {"members": [1], "root": 1}, None, None]
    assert [s["rollouts"] is not None for s in seen] == [False, False, True, True]
    assert seen[2]["rollouts"] == {"members": [2, 3], "root": 2}
    broadcast = {"members": [1, 2, 3], "root": 1}  # the first trainer is the root
    assert [s["weight_broadcast"] for s in seen] == [None, broadcast, broadcast, broadcast]
    assert "weight_broadcast  3     root 1 -> 2,3" in described


def test_colocated_layout() -> None:
    seen, _ = run_ranks("report-colocated.yaml", 3)  # 0 controller, 1-2 trainer+rollout
    group = {"members": [1, 2], "root": 1}
    for name in ("trainers", "rollouts"):
        assert [s[name] for s in seen] == [None, group, group]
    # Both rollout ranks train and load their own trainer's weights: the broadcast has no receiver.
    assert [s["weight_broadcast"] for s in seen] == [None, {"members": [1], "root": 1}, None]
