"""``sfhpc traj summary --follow`` on a store that another process is writing (SWMR)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT

BATCHES = 6


def _sfhpc(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "sfhpc", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _writer(run: Path, batches: int, pause: float) -> subprocess.Popen[str]:
    """The live run, started and past its first batch (it then waits for a line on its stdin)."""
    writer = subprocess.Popen([sys.executable, "-m", "tests.analysis.live_run", str(run), str(batches), str(pause)],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    assert writer.stdout is not None
    line = writer.stdout.readline()
    assert line.startswith("step 0 flushed"), line + (writer.stderr.read() if writer.stderr else "")
    return writer


def _following(follow: subprocess.Popen[str]) -> list[str]:
    """The lines `follow` printed up to its "following ..." line (the first summary)."""
    assert follow.stdout is not None
    lines = []
    while not lines or not lines[-1].startswith("following "):
        line = follow.stdout.readline()
        assert line, "sfhpc traj summary --follow ended early"
        lines.append(line.rstrip("\n"))
    return lines


def test_follow_prints_updates_until_the_run_finishes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    writer = _writer(run, BATCHES, 0.5)
    follow = _sfhpc("traj", "summary", str(run), "--follow", "--interval", "0.1")
    first = _following(follow)
    assert ["trajectories", "4"] in [line.split() for line in first]  # only the first batch so far
    writer.communicate("go\n", timeout=60)
    assert writer.returncode == 0
    out, err = follow.communicate(timeout=120)
    assert follow.returncode == 0 and "Traceback" not in err, err
    lines = out.splitlines()
    updates = [line for line in lines if "  trajectories " in line and line[:2].isdigit()]
    counts = [int(line.split("trajectories ")[1].split()[0]) for line in updates]
    # New batches showed up as lines (about one per batch: reads are 5 times as frequent as the flushes), the
    # last one before the run's end; each line says how many trajectories were new.
    assert len(updates) >= 2 and counts == sorted(set(counts)) and counts[-1] == 4 * BATCHES, out
    assert [f"(+{b - a})" in line for a, b, line in zip([4, *counts], counts, updates)] == [True] * len(updates)
    final = lines[lines.index("the run finished"):]
    table = [line.split() for line in final]
    assert ["trajectories", f"{4 * BATCHES}"] in table and ["consumed", f"{4 * BATCHES}"] in table, out
    assert ["training", "steps", f"{BATCHES}"] in table


def test_follow_ends_on_ctrl_c(tmp_path: Path) -> None:
    run = tmp_path / "run"
    writer = _writer(run, 2, 0)  # waits after its first batch: the run goes on
    follow = _sfhpc("traj", "summary", str(run), "--follow", "--interval", "0.1")
    _following(follow)
    time.sleep(0.5)
    follow.send_signal(signal.SIGINT)
    out, err = follow.communicate(timeout=30)
    assert follow.returncode == 0 and "stopped following" in out and "Traceback" not in err, err
    writer.communicate("go\n", timeout=60)
