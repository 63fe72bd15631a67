"""The trajectory manager: partial rollouts, branching turns, staleness, GRPO batches, restarts."""

from __future__ import annotations

import threading

import pytest

from sfhpc.data.errors import InvalidRequest, TrajectoryExists, TrajectoryFinished, UnknownTrajectory
from sfhpc.data.manager import Continuation, TrajectoryManager
from sfhpc.data.store import TrajectoryStore, open_store
from sfhpc.data.trajectory import SegmentKind, Status
from sfhpc.errors import SfhpcError


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "run.h5"


def test_partial_rollout_continues_where_it_stopped(store_path):
    manager = TrajectoryManager(TrajectoryStore.create(store_path))
    tid = manager.start([1, 2, 3], task="math", metadata={"q": 1})
    manager.add_generated(tid, [10, 11, 12], [-0.1, -0.2, -0.3], 4, engine="rank-1", finish_reason="abort")
    manager.interrupt(tid)  # a weight update: the engine stopped mid-turn
    assert manager.status(tid) == "interrupted"
    cont = manager.continuation(tid, max_new_tokens=8)
    assert cont == Continuation(prompt_tokens=[1, 2, 3, 10, 11, 12], remaining_tokens=5)
    manager.add_generated(tid, [13, 14, 15, 16, 17], [-0.4] * 5, [5, 5, 5, 5, 5], engine="rank-2",
                          finish_reason="length")
    assert manager.status(tid) == "running"
    manager.finish(tid, reward=1.0)
    record = manager.trajectory(tid)
    assert record.context().tolist() == cont.prompt_tokens + [13, 14, 15, 16, 17]
    assert record.token_versions().tolist() == [-1, -1, -1, 4, 4, 4, 5, 5, 5, 5, 5]
    assert record.generated_mask().tolist() == [False] * 3 + [True] * 8
    assert [s.engine for s in record.segments] == ["", "rank-1", "rank-2"]
    assert record.oldest_version() == 4 and record.status is Status.FINISHED
    manager.close()
    with open_store(store_path) as reader:
        assert reader.get(tid) == record


def test_continuation_counts_only_the_current_turn():
    manager = TrajectoryManager()
    tid = manager.start([1])
    manager.add_generated(tid, [2, 3], [0.0, 0.0], 0)
    manager.observe(tid, [1, 2, 3, 4])  # a new turn
    assert manager.continuation(tid, 10).remaining_tokens == 10
    manager.add_generated(tid, [5] * 4, [0.0] * 4, 0)
    manager.interrupt(tid)
    assert manager.continuation(tid, 10).remaining_tokens == 6
    assert manager.continuation(tid, 3).remaining_tokens == 0


def test_observe_extends_the_branch_and_forks_where_a_prompt_diverges():
    manager = TrajectoryManager()
    tid = manager.start([1, 2, 3])
    manager.add_generated(tid, [4, 5, 6], [-1.0, -1.0, -1.0], 0)
    manager.observe(tid, [1, 2, 3, 4, 5, 6])  # the same history: nothing to add
    assert len(manager.trajectory(tid).segments) == 2
    manager.observe(tid, [1, 2, 3, 4, 5, 6, 7, 8])  # a tool result
    manager.add_generated(tid, [9], [-1.0], 1)
    manager.observe(tid, [1, 2, 3, 4, 5, 40, 41])  # re-tokenized differently from token 5 on
    record = manager.trajectory(tid)
    assert manager.context(tid) == [1, 2, 3, 4, 5, 40, 41]
    assert [(s.kind, s.parent, s.fork_at) for s in record.segments] == [
        (SegmentKind.PROMPT, -1, 0), (SegmentKind.GENERATED, 0, 3), (SegmentKind.OBSERVATION, 1, 3),
        (SegmentKind.GENERATED, 2, 2), (SegmentKind.OBSERVATION, 1, 2)]
    # The shared prefix keeps its generated tokens and their versions; the old branch is still in the tree.
    assert record.generated_mask().tolist() == [False, False, False, True, True, False, False]
    assert record.segments[3].tokens.tolist() == [9]
    manager.observe(tid, [1, 2])  # a prompt that is a prefix: a fork with nothing after it
    assert manager.context(tid) == [1, 2]
    manager.observe(tid, [77])  # nothing in common: a fork at the very start
    assert manager.context(tid) == [77]
    assert manager.trajectory(tid).segments[-1].parent == 0


def _group(manager: TrajectoryManager, name: str, size: int, version: int, *, finish: bool = True) -> list[str]:
    ids = []
    for j in range(size):
        tid = manager.start([1, 2], group=name, trajectory_id=f"{name}-{j}")
        manager.add_generated(tid, [3, 4], [-0.5, -0.5], version)
        if finish:
            manager.finish(tid, reward=float(j))
        ids.append(tid)
    return ids


def test_batches_are_whole_complete_groups_oldest_first(store_path):
    manager = TrajectoryManager(TrajectoryStore.create(store_path), max_token_lag=1)
    _group(manager, "a", 4, version=3)
    open_b = _group(manager, "b", 4, version=3, finish=False)
    _group(manager, "c", 3, version=3)  # short of the group size
    _group(manager, "d", 4, version=3)
    manager.finish(open_b[0], 0.0)
    assert manager.take_batch(policy_version=3, num_groups=3, group_size=4) is None  # only a and d are ready
    assert manager.status("a-0") == "finished"  # nothing was consumed
    batch = manager.take_batch(policy_version=3, num_groups=2, group_size=4)
    assert batch is not None and batch.step == 0 and batch.policy_version == 3
    assert [[t.id for t in g] for g in batch.groups] == [[f"a-{j}" for j in range(4)], [f"d-{j}" for j in range(4)]]
    assert all(t.status is Status.CONSUMED for t in batch.trajectories)
    assert len(batch) == 8 and batch.num_tokens == 32 and batch.num_generated == 16
    # Nothing is trained on twice: a and d are gone; b is still running, c too small.
    assert manager.take_batch(policy_version=3, num_groups=1, group_size=4) is None
    for tid in open_b[1:]:
        manager.finish(tid, 1.0)
    again = manager.take_batch(policy_version=4, num_groups=1, group_size=4)
    assert again is not None and again.step == 1 and [t.id for t in again.trajectories] == open_b
    with pytest.raises(TrajectoryFinished):
        manager.add_generated("a-0", [1], [0.0], 3)
    assert manager.status("a-0") == "consumed" and manager.exists("a-0")
    manager.close()
    with open_store(store_path) as reader:
        marks = [(m.step, m.trajectory_id, m.policy_version) for m in reader.marks()]
        assert marks == [(0, f"a-{j}", 3) for j in range(4)] + [(0, f"d-{j}", 3) for j in range(4)] \
            + [(1, tid, 4) for tid in open_b]
        assert reader.summary().by_status["consumed"] == 12
        assert reader.get("a-2").reward == 2.0  # the consumed record keeps the reward


def test_too_stale_groups_are_marked_and_never_trained_on(store_path):
    manager = TrajectoryManager(TrajectoryStore.create(store_path), max_token_lag=1)
    for key in ("old", "fresh", "mixed", "playing"):
        manager.book_group(key)
    old = _group(manager, "old", 2, version=0)
    fresh = _group(manager, "fresh", 2, version=1)
    mixed = manager.start([1], group="mixed")  # one member partly generated by an old policy
    manager.add_generated(mixed, [2, 3], [0.0, 0.0], [0, 2])
    manager.finish(mixed, 0.5)
    batch = manager.take_batch(policy_version=2, num_groups=1)
    assert batch is not None and [t.id for t in batch.trajectories] == fresh  # staleness 1: allowed
    assert [manager.status(t) for t in old] == ["stale", "stale"] and manager.status(mixed) == "stale"
    assert manager.take_batch(policy_version=2, num_groups=1) is None
    # Trained on, or dropped as stale ("old" and "mixed"): only the group not yet played is still in flight.
    assert manager.groups_in_flight() == 1 and manager.in_flight("playing")
    manager.close()
    with open_store(store_path) as reader:
        assert reader.summary().by_status["stale"] == 3
        assert {m.trajectory_id for m in reader.marks()} == set(fresh)


def test_every_policy_token_never_trained_on_is_counted_by_cause(store_path):
    """Stale groups, a group a failed member spoiled (its failed member, its finished one given up) and a
    fork's tokens left behind on a trained trajectory: each cause counts its tokens; trained ones do not."""
    manager = TrajectoryManager(TrajectoryStore.create(store_path), max_token_lag=1)
    for key in ("old", "fresh", "spoilt"):
        manager.book_group(key)
    _group(manager, "old", 2, version=0)  # 2 x 2 tokens, too stale at version 2
    fresh = _group(manager, "fresh", 2, version=2, finish=False)
    manager.observe(fresh[0], [1, 2, 9])  # a history that forks: 3, 4 stay behind on the old branch
    manager.add_generated(fresh[0], [5, 6, 7], [-0.5] * 3, 2)
    for tid in fresh:
        manager.finish(tid, reward=float(tid == fresh[0]))
    done, broken = _group(manager, "spoilt", 2, version=2, finish=False)
    manager.finish(done, reward=1.0)
    manager.add_generated(broken, [8], [-0.1], 2)
    manager.fail(broken, "ValueError: the agent crashed")
    batch = manager.take_batch(policy_version=2, num_groups=1)
    assert batch is not None and [t.id for t in batch.trajectories] == fresh
    assert manager.dropped_tokens() == {"stale": 4, "aborted": 2, "failed": 3, "off-branch": 2}
    manager.close()


def test_a_group_that_can_no_longer_be_fresh_is_dropped_while_it_plays(store_path):
    manager = TrajectoryManager(TrajectoryStore.create(store_path), max_token_lag=1)
    for key in ("doomed", "late", "waiting"):
        manager.book_group(key)
    doomed = _group(manager, "doomed", 2, version=0, finish=False)  # still generating, from version 0 on
    manager.finish(doomed[0], 1.0)
    late = manager.start([1], group="late")  # its first tokens come from version 1: staleness 1 at 2
    manager.add_generated(late, [5], [-0.1], 1)
    waiting = manager.start([1], group="waiting")  # no token yet: nothing is stale
    assert manager.drop_hopeless(policy_version=1) == []  # staleness 1 is allowed
    assert manager.drop_hopeless(policy_version=2) == ["doomed"]
    assert [manager.status(t) for t in doomed] == ["stale", "stale"]
    assert manager.status(late) == "running" and manager.status(waiting) == "running"
    # The dropped member's engine and agent may still report: their records are ignored, not errors.
    manager.add_generated(doomed[1], [6, 7], [-0.2, -0.2], 2, finish_reason="abort")
    manager.interrupt(doomed[1])
    manager.finish(doomed[1], 0.0)
    assert manager.status(doomed[1]) == "stale"
    assert manager.groups_in_flight() == 2 and not manager.in_flight("doomed")  # the caller replaces it
    assert manager.live_groups() == ["late", "waiting"]
    manager.close()
    with open_store(store_path) as reader:
        assert reader.summary().by_status["stale"] == 2


def test_a_group_key_the_run_used_is_never_booked_again(store_path):
    # The lost allocation: two members of g5-x finished and reached the store; the process died.
    manager = TrajectoryManager(TrajectoryStore.create(store_path))
    manager.book_group("g5-x")
    lost = _group(manager, "g5-x", 2, version=5)
    with pytest.raises(InvalidRequest, match="'g5-x' was handed out before"):
        manager.book_group("g5-x")  # in the same process
    manager.flush()
    manager.store.close()

    again = TrajectoryManager(TrajectoryStore.reopen(store_path))
    assert again.groups_in_flight() == 0  # the book lives in the process; the restart books what it keeps
    with pytest.raises(InvalidRequest, match="'g5-x' was handed out before"):
        again.book_group("g5-x")  # known from the store alone: its two new members would join the old two
    again.book_group("g5-x", again=True)  # kept, as its own group
    again.book_group("s2-g5-x")  # the same problem handed out anew: another group
    fresh = _group(again, "s2-g5-x", 2, version=5)
    assert again.groups_in_flight() == 2
    first = again.take_batch(policy_version=5, num_groups=1, group_size=2)
    second = again.take_batch(policy_version=5, num_groups=1, group_size=2)
    assert [[t.id for t in g] for g in first.groups] == [lost]  # two members each, never one group of four
    assert [[t.id for t in g] for g in second.groups] == [fresh]
    assert again.groups_in_flight() == 0
    again.close()


def test_tokens_newer_than_the_policy_are_never_fresh(store_path):
    manager = TrajectoryManager(TrajectoryStore.create(store_path), max_token_lag=2)
    manager.book_group("lost")
    lost = _group(manager, "lost", 2, version=6)  # by the weights of a step after the checkpoint
    manager.add_generated(manager.start([1], group="cut"), [2, 3, 4], [-0.1] * 3, [5, 6, 6])
    # Staleness 5 - 6 = -1 is within the bound as a number, and still not fresh: those weights are gone.
    assert manager.take_batch(policy_version=5, num_groups=1, group_size=2) is None
    assert [manager.status(t) for t in lost] == ["stale", "stale"] and not manager.in_flight("lost")
    assert manager.drop_newer(4) == (1, 3)  # the cut trajectory: three tokens of versions 5 and 6
    assert manager.drop_newer(6) == (0, 0)
    assert manager.live_groups() == []
    manager.close()


def test_tokens_newer_than_the_policy_take_their_whole_episode_with_them(store_path):
    """An episode of two agents: the solver finished on the restored policy's weights, the checker went on past
    them. The checker's tokens are lost, and the solver must not be trained without it."""
    manager = TrajectoryManager(TrajectoryStore.create(store_path))
    manager.book_group("g")
    solver = manager.start([1], group="g", metadata={"agent": "solver", "episode": "e1"})
    manager.add_generated(solver, [2, 3], [-0.1] * 2, 3)
    manager.finish(solver, reward=1.0)
    checker = manager.start([1], group="g", metadata={"agent": "checker", "episode": "e1"})
    manager.add_generated(checker, [4, 5], [-0.1] * 2, [3, 4])
    other = _group(manager, "g", 1, version=3)  # another episode of the group, wholly on the restored weights
    assert manager.drop_newer(3) == (2, 1)  # the checker (one token of version 4) and its solver
    assert [manager.status(t) for t in (solver, checker, *other)] == ["aborted", "aborted", "finished"]
    assert [[tid for tid, _, _ in members] for members in manager.group_episodes("g")] == [other]
    manager.close()


def test_restart_continues_the_run(store_path):
    manager = TrajectoryManager(TrajectoryStore.create(store_path), max_token_lag=10)
    _group(manager, "a", 2, version=0)
    assert manager.take_batch(policy_version=0, num_groups=1).step == 0
    _group(manager, "b", 2, version=1)  # finished, not consumed
    running = manager.start([1, 2, 3], group="c", trajectory_id="c-0")
    manager.add_generated(running, [4, 5], [-1.0, -1.0], 1)
    interrupted = manager.start([9], trajectory_id="solo")
    manager.add_generated(interrupted, [8], [-2.0], 1)
    manager.interrupt(interrupted)
    manager.flush()
    manager.store.close()  # the process ends without closing the manager (a preemption)

    again = TrajectoryManager(TrajectoryStore.reopen(store_path), max_token_lag=10)
    assert again.counts()["consumed"] == 2 and again.status("a-0") == "consumed"
    assert again.status("b-1") == "finished"
    assert again.status("c-0") == "interrupted"  # its engine died with the old process
    assert again.context("c-0") == [1, 2, 3, 4, 5] and again.continuation("c-0", 5).remaining_tokens == 3
    with pytest.raises(TrajectoryExists):
        again.start([1], trajectory_id="a-1")
    batch = again.take_batch(policy_version=1, num_groups=1)
    assert batch.step == 1 and [t.id for t in batch.trajectories] == ["b-0", "b-1"]
    again.add_generated("c-0", [6, 7, 8], [-1.0] * 3, 2)
    again.finish("c-0", 1.0)
    assert again.take_batch(policy_version=2, num_groups=1).step == 2
    again.close()
    with open_store(store_path) as reader:
        assert reader.session == 2 and sorted({m.step for m in reader.marks()}) == [0, 1, 2]
        assert reader.get("c-0").token_versions().tolist() == [-1, -1, -1, 1, 1, 2, 2, 2]
        assert [t.id for t in reader.resumable()] == ["solo"]


def test_errors_are_distinct_and_actionable():
    manager = TrajectoryManager()
    with pytest.raises(UnknownTrajectory, match="no trajectory with id 'ghost'") as caught:
        manager.status("ghost")
    assert isinstance(caught.value, KeyError) and isinstance(caught.value, SfhpcError)
    tid = manager.start([1], trajectory_id="t1")
    with pytest.raises(TrajectoryExists):
        manager.start([1], trajectory_id="t1")
    with pytest.raises(InvalidRequest, match="2 generated tokens need as many logprobs"):
        manager.add_generated(tid, [1, 2], [0.0], 0)
    with pytest.raises(InvalidRequest, match="JSON-able"):
        manager.start([1], metadata={"bad": {1, 2}})
    with pytest.raises(InvalidRequest, match="longer than 128 bytes"):
        manager.start([1], trajectory_id="x" * 129)
    manager.finish(tid, 0.0)
    for call in (lambda: manager.add_generated(tid, [1], [0.0], 0), lambda: manager.observe(tid, [1, 2]),
                 lambda: manager.interrupt(tid), lambda: manager.finish(tid, 1.0)):
        with pytest.raises(TrajectoryFinished, match="'t1' is finished"):
            call()
    assert not issubclass(TrajectoryFinished, UnknownTrajectory)


def test_flush_every_makes_finished_trajectories_durable(store_path):
    manager = TrajectoryManager(TrajectoryStore.create(store_path), flush_every=3)
    with open_store(store_path) as reader:
        for j in range(3):
            manager.finish(manager.start([j]), reward=0.0)
            reader.refresh()
            assert len(reader) == (3 if j == 2 else 0)
    manager.close()


def test_many_threads_at_once(store_path):
    manager = TrajectoryManager(TrajectoryStore.create(store_path), flush_every=16)
    errors = []

    def agent(worker: int) -> None:
        try:
            for n in range(40):
                tid = manager.start([worker, n], group=f"w{worker}-{n // 4}", trajectory_id=f"w{worker}-{n}")
                for turn in range(3):
                    manager.add_generated(tid, [turn] * 5, [-0.5] * 5, 0)
                    manager.observe(tid, manager.context(tid) + [99])
                manager.finish(tid, reward=1.0)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(w,)) for w in range(6)]
    for thread in threads:
        thread.start()
    taken = []
    while any(t.is_alive() for t in threads) or manager.ids(Status.FINISHED):
        batch = manager.take_batch(policy_version=0, num_groups=2, group_size=4)
        if batch is not None:
            taken.extend(t.id for t in batch.trajectories)
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(taken) == sorted(f"w{w}-{n}" for w in range(6) for n in range(40))  # each exactly once
    manager.close()
    with open_store(store_path) as reader:
        assert len(reader) == 240 and reader.summary().by_status["consumed"] == 240
        assert reader.get("w3-17").context().tolist() == [3, 17] + ([0] * 5 + [99]) + ([1] * 5 + [99]) \
            + ([2] * 5 + [99])
