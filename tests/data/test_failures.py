"""Failed episodes: the reason reaches the store, the GRPO group is dropped whole, nothing waits on it."""

from __future__ import annotations

import pytest

from sfhpc.data.errors import InvalidRequest, TrajectoryFinished
from sfhpc.data.manager import FIRST_REASONS, TrajectoryManager
from sfhpc.data.store import TrajectoryStore, open_store
from sfhpc.data.trajectory import Status


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "run.h5"


def _member(manager: TrajectoryManager, group: str, j: int, *, finish: bool) -> str:
    tid = manager.start([1, 2], group=group, trajectory_id=f"{group}-{j}")
    manager.add_generated(tid, [3, 4], [-0.5, -0.5], 0)
    if finish:
        manager.finish(tid, reward=1.0)
    return tid


def test_a_failed_member_drops_its_whole_group_and_the_reason_is_stored(store_path):
    manager = TrajectoryManager(TrajectoryStore.create(store_path))
    manager.book_group("g")
    manager.book_group("h")
    done = _member(manager, "g", 0, finish=True)  # finished before the failure: waits for its group
    running = _member(manager, "g", 1, finish=False)  # still playing when the failure arrives
    failing = _member(manager, "g", 2, finish=False)
    healthy = [_member(manager, "h", j, finish=True) for j in range(4)]
    manager.fail(failing, "ValueError: invalid literal for int() with base 10: '²'")
    assert manager.status(failing) == "failed" and manager.status(done) == "aborted"
    assert manager.status(running) == "running"  # its agent is still at work: it is not cut off
    # The group leaves the book of groups in flight (the controller replaces it), once.
    assert not manager.in_flight("g") and manager.in_flight("h") and manager.groups_in_flight() == 1
    manager.add_generated(running, [5], [-0.1], 0)
    manager.finish(running, reward=0.5)  # ends like any episode, but is never trained on
    assert manager.status(running) == "aborted"
    # The fourth episode of the group fails before its first reply: start + fail, as a rollout rank does.
    early = manager.start([], group="g", trajectory_id="g-3")
    manager.fail(early, "RuntimeError: no opening")
    batch = manager.take_batch(policy_version=0, num_groups=1, group_size=4)
    assert batch is not None and [t.id for t in batch.trajectories] == healthy
    assert manager.take_batch(policy_version=0, num_groups=1, group_size=4) is None  # g never comes
    counts = manager.counts()
    assert (counts["failed"], counts["aborted"], counts["consumed"]) == (2, 2, 4)
    assert manager.fail_reasons() == ["ValueError: invalid literal for int() with base 10: '²'",
                                      "RuntimeError: no opening"]
    # Late calls for a trajectory the run gave up are dropped: a turn may still be generating when its
    # episode fails (a timeout) and report its tokens afterwards; every other call is still refused.
    manager.add_generated(failing, [6], [-0.1], 0)
    manager.interrupt(failing)
    manager.finish(done, reward=1.0)
    manager.fail(running, "TimeoutError")
    with pytest.raises(TrajectoryFinished):
        manager.observe(failing, [1, 2, 3, 4, 9])
    with pytest.raises(TrajectoryFinished):
        manager.fail(healthy[0], "too late")  # consumed: it ended well and was trained on
    manager.close()
    with open_store(store_path) as reader:
        failed = {t.id: t for t in reader.trajectories(status="failed")}
        assert failed[failing].fail_reason == "ValueError: invalid literal for int() with base 10: '²'"
        assert failed[early].fail_reason == "RuntimeError: no opening" and failed[early].num_tokens == 0
        assert failed[failing].context().tolist() == [1, 2, 3, 4]  # the tokens before the failure are kept
        assert failed[failing].reward is None and failed[failing].turn_rewards == ()
        aborted = reader.get(running)
        assert aborted.status is Status.ABORTED and aborted.reward == 0.5 and aborted.fail_reason == ""
        assert {m.trajectory_id for m in reader.marks()} == set(healthy)
        assert reader.summary().by_status["failed"] == 2


def test_an_orphan_of_a_failed_first_turn_is_aborted_once_the_group_has_ended(store_path):
    # The endpoint started a trajectory for an agent's first turn, then the agent timed out before it
    # learnt the id: its episode is reported as start + fail, and the endpoint's trajectory is an orphan.
    manager = TrajectoryManager(TrajectoryStore.create(store_path))
    orphan = _member(manager, "g", 0, finish=False)
    manager.fail(manager.start([], group="g", trajectory_id="g-0-failed"), "timed out after 5 s")
    _member(manager, "g", 1, finish=True)
    assert manager.take_batch(policy_version=0, num_groups=1, group_size=2) is None
    assert manager.status(orphan) == "aborted"  # both episodes of the group ended: no agent holds it
    manager.add_generated(orphan, [7], [-0.1], 0)  # its turn's tokens, arriving late, are dropped
    assert manager.ids() == []  # nothing of the group is left in memory


def test_a_restarted_manager_keeps_failed_groups_out_of_batches(store_path):
    manager = TrajectoryManager(TrajectoryStore.create(store_path))
    _member(manager, "g", 0, finish=True)
    survivor = _member(manager, "g", 1, finish=False)
    manager.fail(_member(manager, "g", 2, finish=False), "KeyError: 'answer'")
    manager.flush()
    manager.store.close()  # killed
    again = TrajectoryManager(TrajectoryStore.reopen(store_path))
    assert again.status(survivor) == "aborted"  # its group can never be trained on
    assert again.fail_reasons() == ["KeyError: 'answer'"] and again.counts()["failed"] == 1
    again.close()


def test_only_the_first_distinct_reasons_are_kept_in_memory():
    manager = TrajectoryManager()
    for key in ["g", *(f"g{i}" for i in range(1, FIRST_REASONS + 3))]:
        manager.book_group(key)
    manager.fail(manager.start([1], group="g"), "ValueError: 0")  # both members of a group, alike
    manager.fail(manager.start([1], group="g"), "ValueError: 0")
    for i in range(1, FIRST_REASONS + 2):
        manager.fail(manager.start([1], group=f"g{i}"), f"ValueError: {i}")
    assert manager.fail_reasons() == [f"ValueError: {i}" for i in range(FIRST_REASONS)]
    assert manager.counts()["failed"] == FIRST_REASONS + 3 and manager.groups_in_flight() == 1  # the last one


def test_the_store_keeps_reasons_only_for_failed_records(store_path):
    with TrajectoryStore.create(store_path) as store:
        store.add_trajectory("t")
        with pytest.raises(InvalidRequest, match="only a failed trajectory has a reason"):
            store.set_status("t", Status.ABORTED, reason="why")
        with pytest.raises(InvalidRequest, match="a failed trajectory has no rewards"):
            store.set_status("t", Status.FAILED, reward=1.0, reason="why")
        store.set_status("t", Status.FAILED, reason="ZeroDivisionError: división por cero")
    with open_store(store_path) as reader:
        assert reader.get("t").fail_reason == "ZeroDivisionError: división por cero"
