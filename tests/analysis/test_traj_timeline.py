"""The ranks' timeline read back: the timeline frame, the bubble fraction in ``sfhpc traj summary`` and
``sfhpc traj compare``, the timeline panel of ``sfhpc traj plot``; a schema-1 store says "not recorded"."""

from __future__ import annotations

import base64
import gzip
import json
import re
import shutil
from pathlib import Path

import pytest
from PIL import Image

from sfhpc.analysis import open_run
from sfhpc.analysis.plots import PANELS_KEY
from sfhpc.analysis.summary import summarize
from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore
from sfhpc.rl.timeline import Timeline
from tests.analysis.runs import write_run
from tests.conftest import run_sfhpc

V1_FIXTURE = Path(__file__).parents[1] / "data" / "fixtures" / "store_v1.h5.gz"
T0 = 1_800_000_000.0
# Rank 1 (trainer): waits 4 s, trains 3 s, syncs 1 s. Rank 2 (rollout): generates 4 s, waits 2 s, generates
# 1 s, syncs 1 s. Waiting: 6 of 16 rank-seconds; the trainer 4 of 8, the rollout rank 2 of 8.
SCHEDULE = {1: [(0, "waiting", 1), (4, "training", 1), (7, "syncing", 1)],
            2: [(0, "generating", 1), (4, "waiting", 1), (6, "generating", 2), (7, "syncing", 2)]}
END = 8.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def write_timeline_run(folder: Path) -> Path:
    """A run folder whose store holds trajectories (as `write_run`'s) and the schedule's timeline, written
    through the manager's flushes as a run writes it."""
    write_run(folder)
    clock = Clock()
    timeline = Timeline(clock)
    manager = TrajectoryManager(TrajectoryStore.reopen(folder / "trajectories.h5"))
    manager.follow_timeline(timeline.drain)
    changes = sorted((t, rank, state, step) for rank, rows in SCHEDULE.items() for t, state, step in rows)
    for t, rank, state, step in changes:
        clock.now, timeline.step = T0 + t, step
        if t == 0:
            timeline.begin(rank, "trainer" if rank == 1 else "rollout", state)
        else:
            timeline.change(rank, state)
        manager.flush()  # some intervals reach the store at each flush, the rest at the close
    clock.now = T0 + END
    timeline.close()
    manager.close()
    return folder


@pytest.fixture(scope="module")
def timed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_timeline_run(tmp_path_factory.mktemp("timeline") / "timed")


@pytest.fixture
def v1_run(tmp_path: Path) -> Path:
    folder = tmp_path / "old"
    folder.mkdir()
    with gzip.open(V1_FIXTURE, "rb") as src, (folder / "trajectories.h5").open("wb") as dst:
        shutil.copyfileobj(src, dst)
    return folder


def test_the_timeline_frame_and_bubble_fraction(timed_run: Path) -> None:
    with open_run(timed_run) as run:
        frame = run.timeline()
        bubble = run.bubble()
        summary = summarize(run)
    assert list(frame.columns) == ["rank", "role", "state", "t_start", "t_end", "seconds", "step"]
    got = sorted(zip(frame["rank"], frame["state"], frame["t_start"] - T0, frame["seconds"], frame["step"]))
    assert got == [(1, "syncing", 7.0, 1.0, 1), (1, "training", 4.0, 3.0, 1), (1, "waiting", 0.0, 4.0, 1),
                   (2, "generating", 0.0, 4.0, 1), (2, "generating", 6.0, 1.0, 2), (2, "syncing", 7.0, 1.0, 2),
                   (2, "waiting", 4.0, 2.0, 1)]
    assert set(frame.loc[frame["rank"] == 2, "role"]) == {"rollout"}
    assert bubble.overall == 0.375 and bubble.by_role == {"trainer": 0.5, "rollout": 0.25}
    assert summary.as_dict()["bubble"] == {"overall": 0.375, "by_role": {"trainer": 0.5, "rollout": 0.25}}
    done = run_sfhpc("traj", "summary", str(timed_run))
    assert done.returncode == 0, done.stderr
    assert re.search(r"^bubble fraction +37\.5% \(trainer 50\.0%, rollout 25\.0%\)$", done.stdout, re.M), done.stdout


def test_a_store_without_a_timeline_says_not_recorded(v1_run: Path, tmp_path: Path) -> None:
    for folder in (v1_run, write_run(tmp_path / "no-timeline")):  # schema 1; schema 2 with no intervals
        done = run_sfhpc("traj", "summary", str(folder))
        assert done.returncode == 0, done.stderr
        assert re.search(r"^bubble fraction +not recorded$", done.stdout, re.M), done.stdout
    with open_run(v1_run) as run:
        assert run.bubble() is None and len(run.timeline()) == 0 and run.schema == 1
        assert run.segments()["temperature"].isna().all()


def test_plot_has_a_timeline_panel(timed_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "timeline.png"
    done = run_sfhpc("traj", "plot", str(timed_run), "--out", str(out))
    assert done.returncode == 0, done.stderr
    with Image.open(out) as png:
        assert png.text[PANELS_KEY] == ("reward; reply length; staleness when trained; tokens per policy version; "
                                        "rank timeline")
        assert png.size[0] > 1800


def test_compare_fills_its_bubble_column(timed_run: Path, v1_run: Path) -> None:
    done = run_sfhpc("traj", "compare", str(timed_run), str(v1_run))
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("bubble fraction"))
    assert re.split(r"\s{2,}", row.strip())[1:] == ["37.5% (trainer 50.0%, rollout 25.0%)", "not recorded"]


def test_trace_holds_the_schedule_as_spans_with_counters(timed_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    done = run_sfhpc("traj", "trace", str(timed_run), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "2 rank track(s)" in done.stdout
    trace = json.loads(out.read_text())["traceEvents"]
    spans = sorted((e["pid"], e["name"], e["ts"] / 1e6, e["dur"] / 1e6, e["args"]["step"]) for e in trace
                   if e["ph"] == "X")
    assert spans == [(1, "idle", 0.0, 4.0, 1), (1, "syncing", 7.0, 1.0, 1), (1, "training", 4.0, 3.0, 1),
                     (2, "generating", 0.0, 4.0, 1), (2, "generating", 6.0, 1.0, 2), (2, "idle", 4.0, 2.0, 1),
                     (2, "syncing", 7.0, 1.0, 2)]
    # Step 1 (whose metrics row says it made version 3) ended with its training, at 7 s; its bubble: 6 waiting
    # of the 14 rank-seconds stamped step 1.
    (version,) = [e for e in trace if e["ph"] == "i" and e["name"].startswith("version")]
    assert (version["name"], version["ts"], version["args"]["step"]) == ("version 3", 7e6, 1)
    counters = {e["name"]: e["args"][e["name"]] for e in trace if e["ph"] == "C"}
    assert counters["bubble"] == round(6 / 14, 4) and "reward" in counters
    again = run_sfhpc("traj", "trace", str(timed_run), "--out", str(out))  # never overwritten
    assert again.returncode == 2 and "exists" in again.stderr
    cut = tmp_path / "cut.json"
    done = run_sfhpc("traj", "trace", str(timed_run), "--out", str(cut), "--steps", "2:2", "--ranks", "2")
    assert done.returncode == 0, done.stderr
    shown = [e["name"] for e in json.loads(cut.read_text())["traceEvents"] if e["ph"] == "X"]
    assert shown == ["generating", "syncing"]


def test_the_report_carries_the_trace(timed_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    assert run_sfhpc("traj", "report", str(timed_run), "-o", str(out)).returncode == 0
    found = re.search(r'download="timed-trace\.json" href="data:application/json;base64,([A-Za-z0-9+/=]+)"',
                      out.read_text())
    assert found, "no trace link in the report"
    trace = json.loads(base64.b64decode(found.group(1)))["traceEvents"]
    assert sum(1 for e in trace if e["ph"] == "X") == sum(len(rows) for rows in SCHEDULE.values())
