"""Heartbeats over real MPI ranks (mpiexec), with a clock the ranks set: who watches whom, silence past
the bound named, a rank that said goodbye no longer watched, a watcher's own pause not taken for silence.
A leaving rank is seen off by the controller before it goes (nothing can reach it after), and two ranks
that leave at once see each other go. The end-to-end case (a rank stopped mid-run, the run ended) is in
test_faults_on_ranks.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.mpi


def test_heartbeats_between_the_controller_and_every_rank() -> None:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    done = subprocess.run(["mpiexec", "--oversubscribe", "--bind-to", "none", "-n", "3", sys.executable,
                           str(Path(__file__).parent / "liveness_ranks.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    controller, first, other = json.loads(done.stdout)
    # The controller watches every rank; every other rank watches the controller, the first one at the
    # bound, the others later (the first one speaks for them when the controller goes silent).
    assert (controller["peers"], first["peers"], other["peers"]) == ([1, 2], [0], [0])
    assert (controller["bound"], first["bound"], other["bound"]) == (10.0, 10.0, 25.0)
    assert controller["heard"] == {"1": 101.0, "2": 101.0} and first["heard"] == other["heard"] == {"0": 101.0}
    assert controller["silent"] == {"1": 14.5, "2": 14.5} and first["silent"] == {"0": 14.5}
    assert other["silent"] == {}  # 14.5 s is within its later bound
    assert controller["line"] == (
        "no heartbeat from rank 1 (trainer, node a) for 14 s, rank 2 (rollout, node b) for 14 s "
        "(budgets.heartbeat_timeout_s = 10): the process is stopped, stuck or cut off from the others; see "
        "logs/rank-001.log, logs/rank-002.log in the run folder, and the node; raise budgets.heartbeat_timeout_s "
        "if a rank may hold Python's interpreter lock that long on purpose")
    assert controller["silent_after_own_gap"] == first["silent_after_own_gap"] == {}
    # Rank 1 said goodbye: no longer watched; rank 2 sent nothing since the fresh bound at 115.5.
    assert controller["silent_after_goodbye"] == {"2": 11.5}
    # ... and gets no more beats: a send to a rank that has exited holds MPI_Finalize (Open MPI over TCP).
    assert controller["beats_after_goodbye"] == [2]
    # Rank 1 left once the controller had seen it off: not at its bound (30 s here), nor after a fixed linger.
    assert first["seen_off"] is True and first["left_after_s"] < 10, first
