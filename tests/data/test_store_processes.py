"""The store across processes: a writer killed with -9 mid-append, and a reader following a live run."""

from __future__ import annotations

import os
import random
import signal
import time

import h5py

from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore, open_store
from sfhpc.data.trajectory import Status
from tests.data.manager_writer import generated, prompt
from tests.data.processes import Child
from tests.data.records import fingerprint, make_trajectory


def _kill_after_flushes(child: Child, flushes: int, delay: float) -> int:
    """Let `child` report `flushes` flushes, kill -9 it `delay` s later; the last count it reported."""
    line = child.next_line()
    assert line is not None and line.startswith("start"), child.stderr()
    for _ in range(flushes):
        line = child.next_line()
        assert line is not None and line.startswith("flushed"), child.stderr()
    time.sleep(delay)  # it keeps appending and flushing: the kill lands mid-way
    os.kill(child.proc.pid, signal.SIGKILL)
    reported = [line for line in [child.seen[-1], *child.rest()] if line.startswith("flushed")]
    assert child.proc.returncode == -signal.SIGKILL
    return int(reported[-1].split()[1])


def test_kill_9_mid_append_keeps_every_flushed_trajectory(tmp_path):
    path = tmp_path / "run.h5"
    rng = random.Random(7)
    flushed = 0
    for round_ in range(4):  # each round reopens what the killed writer left and continues it
        child = Child("tests.data.store_writer", str(path), "16")
        flushed = _kill_after_flushes(child, rng.randint(2, 6), rng.uniform(0.0, 0.05))
        with open_store(path) as reader:
            assert reader.session == round_ + 1
            assert len(reader) >= flushed  # at least everything reported flushed; maybe a later flush too
            for i in range(len(reader)):
                back = reader.get(f"traj-{i:06d}")
                assert fingerprint(back) == fingerprint(make_trajectory(i)), i
    # The store is whole: a new writer continues it (numbering included) and closes it cleanly.
    with TrajectoryStore.reopen(path) as store:
        start = len(store.view())
        assert start >= flushed
        store.write(make_trajectory(start))
    with open_store(path) as reader:
        assert reader.session == 5 and reader.ids() == [f"traj-{i:06d}" for i in range(start + 1)]
        assert reader.summary().by_status["finished"] == start + 1


def test_a_flush_killed_before_its_commit_is_dropped_whole(tmp_path):
    path = tmp_path / "run.h5"
    child = Child("tests.data.store_writer", str(path), "10", "3")  # killed in its 3rd flush
    assert child.rest() == ["start 0", "flushed 10", "flushed 20"]
    assert child.proc.returncode == -signal.SIGKILL
    with h5py.File(path, "r", swmr=True) as raw:  # the killed flush left rows past the last commit
        assert raw["trajectories"].shape[0] == 30 and raw["commits"][-1]["trajectories"] == 20
    with open_store(path) as reader:
        assert reader.ids() == [f"traj-{i:06d}" for i in range(20)]
    child = Child("tests.data.store_writer", str(path), "10", "2")  # reopens, drops the tail, writes 20..29
    assert child.rest() == ["start 20", "flushed 30"]
    with open_store(path) as reader:
        assert len(reader) == 30 and reader.counts["segments"] == 30 * 6
        for i in range(30):
            assert fingerprint(reader.get(f"traj-{i:06d}")) == fingerprint(make_trajectory(i))


def test_manager_restarts_after_kill_9_with_partial_rollouts_intact(tmp_path):
    path = tmp_path / "run.h5"
    child = Child("tests.data.manager_writer", str(path))
    last = _kill_after_flushes(child, 3, 0.02)
    manager = TrajectoryManager(TrajectoryStore.reopen(path), max_token_lag=100)
    for k in range(last + 1):
        assert [manager.status(f"k{k}-{j}") for j in range(4)] == ["finished", "finished", "interrupted",
                                                                   "interrupted"]  # 3 was running: now interrupted
        for j in range(4):
            assert manager.context(f"k{k}-{j}") == prompt(k, j) + generated(k, j)
            record = manager.trajectory(f"k{k}-{j}")
            assert record.token_versions().tolist() == [-1] * 20 + [k] * 30
            assert record.segments[1].engine == "rank-1"
    # The interrupted turn continues where it stopped, and the group becomes a batch.
    assert manager.continuation(f"k{last}-3", 50).remaining_tokens == 20
    for j in (2, 3):
        manager.add_generated(f"k{last}-{j}", [5] * 20, [-0.1] * 20, last + 1, finish_reason="length")
        manager.finish(f"k{last}-{j}", reward=1.0)
    batch = manager.take_batch(policy_version=last + 1, num_groups=1, group_size=4)
    assert batch is not None and batch.step == 0  # the older groups still have interrupted members
    assert [t.id for t in batch.trajectories] == [f"k{last}-{j}" for j in range(4)]
    assert batch.trajectories[3].token_versions().tolist() == [-1] * 20 + [last] * 30 + [last + 1] * 20
    manager.close()
    with open_store(path) as reader:
        assert reader.session == 2
        assert reader.get(f"k{last}-3").context().tolist() == prompt(last, 3) + generated(last, 3) + [5] * 20


def test_reader_in_another_process_follows_the_run(tmp_path):
    path = tmp_path / "run.h5"
    store = TrajectoryStore.create(path)
    follower = Child("tests.data.store_follower", str(path), "40")
    try:
        assert follower.next_line() == "seen 0 ok", follower.stderr()
        for batch in range(1, 6):
            for i in range(8 * (batch - 1), 8 * batch):
                store.write(make_trajectory(i))
            store.flush()
            assert follower.next_line() == f"seen {8 * batch} ok"
        assert follower.rest() == []
        assert follower.proc.returncode == 0, follower.stderr()
    finally:
        follower.proc.kill()
        store.close()
    with open_store(path) as reader:
        assert len(reader) == 40 and reader.get("traj-000039").status is Status.FINISHED
