"""The trajectory record: the tree, the current branch and the per-token views a trainer uses."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from sfhpc.data.trajectory import NO_VERSION, Segment, SegmentKind, Status, Trajectory
from tests.data.records import make_trajectory


def _tree() -> Trajectory:
    prompt = Segment.of(SegmentKind.PROMPT, -1, 0, [1, 2, 3])
    gen = Segment.of(SegmentKind.GENERATED, 0, 3, [4, 5, 6], logprobs=[-0.5, -0.25, -1.0], versions=[2, 2, 3])
    obs = Segment.of(SegmentKind.OBSERVATION, 1, 3, [7])
    fork = Segment.of(SegmentKind.OBSERVATION, 1, 1, [8, 9])  # branches after token 4
    gen2 = Segment.of(SegmentKind.GENERATED, 3, 2, [10], logprobs=[-0.125], versions=5)
    return Trajectory("t", (prompt, gen, obs, fork, gen2), group="g")


def test_current_branch_follows_the_last_segment_and_forks_inside_a_parent():
    t = _tree()
    assert t.branch() == [(0, 3), (1, 1), (3, 2), (4, 1)]
    assert t.context().tolist() == [1, 2, 3, 4, 8, 9, 10]
    assert t.generated_mask().tolist() == [False, False, False, True, False, False, True]
    assert t.token_versions().tolist() == [-1, -1, -1, 2, -1, -1, 5]
    assert t.token_logprobs().tolist() == [0, 0, 0, -0.5, 0, 0, -0.125]
    assert (t.num_tokens, t.num_generated) == (7, 2)


def test_staleness_counts_from_the_oldest_generated_token_on_the_branch():
    t = _tree()
    newer = Trajectory("n", (*t.segments[:4], Segment.of(SegmentKind.GENERATED, 2, 1, [11], versions=1)))
    assert newer.oldest_version() == 1  # the branch through `obs` uses tokens of versions 2, 2, 3 and 1
    assert t.oldest_version() == 2
    assert t.staleness(4) == 2
    assert t.staleness(1) == 0
    prompt_only = Trajectory("p", (Segment.of(SegmentKind.PROMPT, -1, 0, [1]),))
    assert prompt_only.oldest_version() is None and prompt_only.staleness(100) == 0


def test_non_generated_tokens_get_no_version_and_zero_logprob():
    seg = Segment.of(SegmentKind.OBSERVATION, 0, 0, [5, 6])
    assert seg.versions.tolist() == [NO_VERSION, NO_VERSION] and seg.logprobs.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="version must be -1"):
        Segment.of(SegmentKind.OBSERVATION, 0, 0, [5], versions=1)
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        Segment.of(SegmentKind.GENERATED, 0, 0, [5, 6], logprobs=[0.1], versions=1)


def test_tree_shape_is_checked():
    root = Segment.of(SegmentKind.PROMPT, -1, 0, [1, 2])
    with pytest.raises(ValueError, match="parent must come before"):
        Trajectory("x", (root, Segment.of(SegmentKind.OBSERVATION, 1, 0, [3])))
    with pytest.raises(ValueError, match="forks at 3"):
        Trajectory("x", (root, Segment.of(SegmentKind.OBSERVATION, 0, 3, [3])))
    with pytest.raises(ValueError, match="root"):
        Trajectory("x", (Segment.of(SegmentKind.PROMPT, 0, 0, [1]),))


def test_records_are_values_that_cannot_be_edited():
    t = make_trajectory(3)
    with pytest.raises(ValueError):
        t.segments[0].tokens[0] = 7  # read-only arrays
    meta = t.metadata
    meta["i"] = -1
    assert t.metadata["i"] == 3
    tokens = [1, 2, 3]
    seg = Segment.of(SegmentKind.PROMPT, -1, 0, tokens)
    tokens[0] = 99
    assert seg.tokens.tolist() == [1, 2, 3]


def test_equality_and_pickle_round_trip():
    t = make_trajectory(11)
    copy = pickle.loads(pickle.dumps(t))
    assert copy == t and copy is not t
    assert not copy.segments[1].tokens.flags.writeable
    assert make_trajectory(12) != t
    assert Status("stale") is Status.STALE and Status.from_code(Status.CONSUMED.code) is Status.CONSUMED
    assert np.array_equal(copy.context(), t.context())


def test_metadata_must_be_json():
    with pytest.raises(ValueError, match="JSON-able"):
        Trajectory.encode_metadata({"x": object()})
