"""The HDF5 store: round trips, appending across reopens, and refusing files it must not touch."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from sfhpc.data import layout
from sfhpc.data.errors import InvalidRequest, StoreError, StoreExists, UnknownTrajectory
from sfhpc.data.rank_intervals import RankInterval, from_rows
from sfhpc.data.store import TrajectoryStore, lock_path, open_store
from sfhpc.data.trajectory import Segment, SegmentKind, Status, Trajectory
from tests.data.records import fingerprint, make_trajectory


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "run.h5"


def test_round_trip_is_exact(store_path):
    written = [make_trajectory(i) for i in range(30)]
    written.append(Trajectory("empty-gen", (Segment.of(SegmentKind.PROMPT, -1, 0, []),), status=Status.ABORTED))
    with TrajectoryStore.create(store_path, run_metadata={"recipe": "r.yaml", "seed": 3}) as store:
        for t in written:
            store.write(t)
    with open_store(store_path) as reader:
        assert reader.ids() == [t.id for t in written]
        for t in written:
            back = reader.get(t.id)
            assert back == t
            assert fingerprint(back) == fingerprint(t)
        assert [t.id for t in reader.trajectories()] == [t.id for t in written]
        assert reader.run_metadata == {"recipe": "r.yaml", "seed": 3}
        assert reader.get("traj-000007").reward is None and reader.get("traj-000003").reward == 1.0
        assert reader.get("traj-000005").group is None and reader.get("traj-000006").group == "group-1"
        assert reader.get("traj-000002").metadata == {"i": 2, "note": "ünïcode"}
        summary = reader.summary()
        assert summary.trajectories == 31 and summary.by_status["finished"] == 30
        assert summary.tokens == sum(len(s) for t in written for s in t.segments)
        assert summary.generated_tokens == sum(len(s) for t in written for s in t.segments if s.generated)
        assert "trajectories" in summary.format()
        with pytest.raises(UnknownTrajectory, match="no trajectory with id 'nope'"):
            reader.get("nope")


def test_nothing_is_visible_before_flush_and_status_records_supersede(store_path):
    store = TrajectoryStore.create(store_path)
    t = make_trajectory(1, status=Status.RUNNING)
    store.write(t)
    with open_store(store_path) as reader:
        assert len(reader) == 0
        store.flush()
        assert reader.refresh() and len(reader) == 1 and reader.get(t.id).status is Status.RUNNING
        store.set_status(t.id, Status.FINISHED, when=5.0, reward=0.5, turn_rewards=[0.1, 0.4])
        store.mark_consumed(3, [t.id], policy_version=7, when=6.0)
        store.set_status(t.id, Status.CONSUMED, when=6.0, reward=0.5, turn_rewards=[0.1, 0.4])
        store.flush()
        assert reader.refresh()
        back = reader.get(t.id)
        assert (back.status, back.reward, back.turn_rewards, back.updated) == (Status.CONSUMED, 0.5, (0.1, 0.4), 6.0)
        assert [(m.step, m.trajectory_id, m.policy_version) for m in reader.marks()] == [(3, t.id, 7)]
        assert not reader.refresh()  # nothing new
    store.close()


def test_reopen_appends_and_continues(store_path):
    with TrajectoryStore.create(store_path) as store:
        for i in range(5):
            store.write(make_trajectory(i, status=Status.RUNNING if i == 4 else Status.FINISHED))
    with TrajectoryStore.reopen(store_path) as store:
        assert store.session == 2 and "traj-000004" in store
        store.add_segment("traj-000004", Segment.of(SegmentKind.OBSERVATION, 5, 3, [1, 2, 3]))
        store.set_status("traj-000004", Status.INTERRUPTED)
        for i in range(5, 9):
            store.write(make_trajectory(i))
        with pytest.raises(InvalidRequest, match="already in the store"):
            store.add_trajectory("traj-000001")
    with TrajectoryStore.open(store_path) as store:  # open = reopen when the file exists
        assert store.session == 3
    with open_store(store_path) as reader:
        assert reader.session == 3 and len(reader) == 9
        for i in (0, 3, 5, 8):
            assert reader.get(f"traj-{i:06d}") == make_trajectory(i)
        resumed = reader.get("traj-000004")
        assert resumed.status is Status.INTERRUPTED and len(resumed.segments) == 7
        assert resumed.context()[-3:].tolist() == [1, 2, 3]
        assert [t.id for t in reader.resumable()] == ["traj-000004"]
        assert len(reader.unconsumed()) == 8


def test_create_never_overwrites(store_path):
    with TrajectoryStore.create(store_path) as store:
        store.write(make_trajectory(0))
    before = _sha(store_path)
    with pytest.raises(StoreExists, match=f"{store_path}: already exists"):
        TrajectoryStore.create(store_path)
    assert _sha(store_path) == before


def test_one_writer_at_a_time(store_path):
    store = TrajectoryStore.create(store_path)
    with pytest.raises(StoreError, match="another process is writing this store"):
        TrajectoryStore.reopen(store_path)
    store.close()
    TrajectoryStore.reopen(store_path).close()


def test_values_that_do_not_fit_are_refused_not_cut(store_path):
    with TrajectoryStore.create(store_path) as store, pytest.raises(InvalidRequest, match="at most 128"):
        store.add_trajectory("x" * 200)


def _bad_files(tmp_path: Path, good: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, what the error must say)."""
    text = tmp_path / "notes.h5"
    text.write_text("these are not the trajectories you are looking for\n")
    truncated = tmp_path / "truncated.h5"
    shutil.copy(good, truncated)
    os.truncate(truncated, good.stat().st_size // 2)
    corrupt = tmp_path / "corrupt.h5"
    shutil.copy(good, corrupt)
    with open(corrupt, "r+b") as f:  # damage the superblock (its checksum no longer matches)
        f.seek(12)
        f.write(b"\xff" * 8)
    newer = tmp_path / "newer.h5"
    shutil.copy(good, newer)
    with h5py.File(newer, "r+") as f:
        f.attrs[layout.SCHEMA_ATTR] = layout.SCHEMA_VERSION + 1
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = np.arange(3)
    return {"text": (text, "is not an HDF5 file"), "truncated": (truncated, "is truncated"),
            "corrupt": (corrupt, "is damaged"),
            "newer": (newer, f"newer sfhpc (store schema {layout.SCHEMA_VERSION + 1}"),
            "foreign": (foreign, "not an sfhpc trajectory store")}


def test_bad_files_give_one_clear_error_and_stay_untouched(tmp_path, store_path):
    with TrajectoryStore.create(store_path) as store:
        for i in range(10):
            store.write(make_trajectory(i))
    for name, (path, expected) in _bad_files(tmp_path, store_path).items():
        before = _sha(path)
        for attempt in (open_store, TrajectoryStore.reopen, TrajectoryStore.open, TrajectoryStore.create):
            with pytest.raises(StoreError) as caught:
                attempt(path)
            message = str(caught.value)
            assert message.startswith(f"{path}: "), (name, attempt, message)
            if attempt != TrajectoryStore.create:
                assert expected in message, (name, message)
            assert "\n" not in message
        assert _sha(path) == before, name
        assert not lock_path(path).exists(), name


def test_missing_file(tmp_path):
    with pytest.raises(StoreError, match="no such file"):
        open_store(tmp_path / "absent.h5")
    with pytest.raises(StoreError, match="does not exist"):
        TrajectoryStore.create(tmp_path / "no-dir" / "run.h5")


def test_sampling_and_timeline_round_trip(store_path):
    sampled = Trajectory("sampled", (Segment.of(SegmentKind.PROMPT, -1, 0, [1, 2]),
                                     Segment.of(SegmentKind.GENERATED, 0, 2, [3, 4], versions=0, temperature=0.7,
                                                top_p=0.95),
                                     Segment.of(SegmentKind.GENERATED, 1, 2, [5], versions=1)),
                         status=Status.FINISHED)
    intervals = [RankInterval(1, "trainer", "training", 10.0, 12.5, 1),
                 RankInterval(2, "rollout", "generating", 10.0, 11.0, 1),
                 RankInterval(2, "rollout", "waiting", 11.0, 12.5, 1)]
    with TrajectoryStore.create(store_path) as store:
        assert store.records_timeline
        store.write(sampled)
        store.add_intervals(intervals[:1])
        store.flush()
        store.add_intervals(intervals[1:])
    with open_store(store_path) as reader:
        assert reader.schema == layout.SCHEMA_VERSION == 3 and reader.records_timeline
        back = reader.get("sampled")
        assert back == sampled
        assert (back.segments[1].temperature, back.segments[1].top_p) == (0.7, 0.95)  # exactly
        assert back.segments[2].temperature is None and back.segments[0].top_p is None  # NaN on disk
        assert from_rows(reader.table("timeline")) == intervals
        assert reader.bubble().overall == pytest.approx(1.5 / 5.0)
        assert reader.bubble().of("rollout") == pytest.approx(0.6) and reader.bubble().of("trainer") == 0.0
        assert reader.summary().format().count("30.0% (trainer 0.0%, rollout 60.0%)") == 1
    with TrajectoryStore.create(store_path.with_name("bad.h5")) as store, \
            pytest.raises(InvalidRequest, match="rank state 'w{20}'... is 20 bytes long; the store holds at most 16"):
        store.add_intervals([RankInterval(1, "trainer", "w" * 20, 0.0, 1.0)])


def test_teacher_scores_round_trip_per_step(store_path):
    """Distillation's per-token teacher log-probabilities go into /scores with their step and come back per
    trajectory, one value per token of its trained branch; an unknown trajectory is refused."""
    first = make_trajectory(0)
    second = make_trajectory(1)
    values = np.linspace(-3.0, 0.0, len(first.context()), dtype=np.float32)
    with TrajectoryStore.create(store_path) as store:
        store.write(first)
        store.write(second)
        assert store.records_scores
        store.add_scores(4, "teacher", [(first.id, values)])
        store.flush()
        store.add_scores(5, "teacher", [(first.id, values + 1), (second.id, np.zeros(3, np.float32))])
    with open_store(store_path) as reader:
        scores = reader.scores(first.id)
        assert sorted(scores) == [4, 5]
        assert scores[4].tolist() == values.tolist() and scores[5].tolist() == (values + 1).tolist()
        assert reader.scores(second.id)[5].tolist() == [0.0, 0.0, 0.0]
        assert reader.scores(first.id, scorer="other") == {}
        assert len(reader.table("scores")) == 3 and reader.counts["blobs/scores"] == 2 * len(values) + 3
        with pytest.raises(UnknownTrajectory):
            reader.scores("absent")
