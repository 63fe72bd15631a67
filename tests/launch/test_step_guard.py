"""The step guard: transparent while srun behaves, ends it once it outlives every rank.

srun here is `tests.launch.hung_srun`, a stand-in (the Slurm 22.05 mpi/pmix hang cannot be produced on
demand); its ranks leave their marks through the same `arm`/`finished` calls real ranks use. Every Slurm
launch test runs its srun under the real guard too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sfhpc.launch.step_guard import guard
from tests.conftest import ROOT

STAND_IN = [sys.executable, "-m", "tests.launch.hung_srun"]


def test_a_hung_srun_is_ended_after_the_grace_and_the_ranks_outcome_returned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    start = time.monotonic()
    status = guard([*STAND_IN, "3"], ranks=3, grace_s=1.0, marks=tmp_path / "marks", poll_s=0.1)
    assert status == 0
    assert time.monotonic() - start < 60  # the stand-in lingers forever on its own
    assert not (tmp_path / "marks").exists()  # the guard cleans its marks up
    failing = guard([*STAND_IN, "3", "--outcomes", "0,2,0"], ranks=3, grace_s=0.5, marks=tmp_path / "m2",
                    poll_s=0.1)
    assert failing == 2  # the worst outcome a rank reported


def test_srun_that_ends_by_itself_keeps_its_status_and_missing_marks_keep_the_guard_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    assert guard([*STAND_IN, "2", "--linger", "0", "--exit", "3"], ranks=2, grace_s=0.2,
                 marks=tmp_path / "a", poll_s=0.05) == 3
    # One rank of three left no mark (it crashed): the guard must not end srun, however long it takes.
    start = time.monotonic()
    assert guard([*STAND_IN, "3", "--marks", "2", "--linger", "2", "--exit", "0"], ranks=3, grace_s=0.2,
                 marks=tmp_path / "b", poll_s=0.05) == 0
    assert time.monotonic() - start >= 2


def test_signals_reach_srun_through_the_guard(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    process = subprocess.Popen([sys.executable, "-m", "sfhpc.launch.step_guard", "--ranks", "9", "--",
                                *STAND_IN, "1"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ranks done"
    process.send_signal(signal.SIGUSR1)  # as scancel --signal=USR1 --batch would
    assert process.wait(timeout=30) == 10
    assert not (tmp_path / ".sfhpc-steps").exists()
