"""A store written by the schema-1 writer (a fixture, kept gzipped) still opens and reads in full: its
trajectories, statuses and marks as written, no timeline, and sampling parameters unknown."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np
import pytest

from sfhpc.data.rank_intervals import RankInterval
from sfhpc.data.store import TrajectoryStore, open_store
from sfhpc.data.trajectory import Segment, SegmentKind, Status, Trajectory

FIXTURE = Path(__file__).parent / "fixtures" / "store_v1.h5.gz"
T0 = 1_700_000_000.0


@pytest.fixture
def v1_store(tmp_path: Path) -> Path:
    path = tmp_path / "v1.h5"
    with gzip.open(FIXTURE, "rb") as src, path.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    return path


def test_a_schema_1_store_reads_as_written(v1_store):
    with open_store(v1_store) as reader:
        assert reader.schema == 1
        assert reader.ids() == ["v1-finished", "v1-consumed", "v1-failed"]
        assert reader.run_metadata == {"recipe": "v1.yaml"}
        assert reader.statuses() == {"v1-finished": Status.FINISHED, "v1-consumed": Status.CONSUMED,
                                     "v1-failed": Status.FAILED}
        finished = reader.get("v1-finished")
        assert [s.tokens.tolist() for s in finished.segments] == [[1, 2, 3], [10, 11, 12, 13], [20, 21], [30]]
        assert finished.segments[1].logprobs.tolist() == [-0.5, -0.25, -1.0, -2.0]
        assert finished.token_versions().tolist() == [-1, -1, -1, 0, 0, 1, 1, -1, -1, 1]
        assert [s.engine for s in finished.segments] == ["", "rollout-0", "", "rollout-1"]
        assert finished.segments[3].finish_reason == "length" and finished.segments[3].t_end == T0 + 4
        assert (finished.group, finished.reward, finished.turn_rewards) == ("g0", 1.0, (0.5, 1.0))
        assert finished.metadata == {"n": 1}
        assert all(s.temperature is None and s.top_p is None for s in finished.segments)  # schema 1 has none
        assert reader.get("v1-failed").fail_reason == "ValueError: bad reply"
        [mark] = reader.marks()
        assert (mark.step, mark.trajectory_id, mark.policy_version) == (0, "v1-consumed", 0)
        assert len(reader.table("segments")) == 7
        summary = reader.summary()
        assert (summary.schema, summary.trajectories, summary.tokens, summary.generated_tokens) == (1, 3, 15, 7)


def test_a_schema_1_store_reads_with_no_timeline_and_reopens_in_its_own_schema(v1_store):
    with open_store(v1_store) as reader:
        assert not reader.records_timeline and len(reader.table("timeline")) == 0
        assert reader.bubble().format() == "not recorded"
        assert reader.summary().bubble is None and "not recorded" in reader.summary().format()
        assert np.isnan(reader.table("segments")["temperature"]).all()  # the current row type, values unknown
    # A run resumed on an old store goes on appending in schema 1: sampling and timeline are dropped there.
    with TrajectoryStore.reopen(v1_store) as store:
        assert not store.records_timeline
        store.write(Trajectory("v1-appended", (Segment.of(SegmentKind.PROMPT, -1, 0, [7]),
                                               Segment.of(SegmentKind.GENERATED, 0, 1, [8, 9], versions=2,
                                                          temperature=0.5, top_p=0.9)), status=Status.FINISHED))
        store.add_intervals([RankInterval(1, "trainer", "waiting", T0, T0 + 1)])
        assert not store.records_scores
        store.add_scores(1, "teacher", [("v1-appended", np.zeros(3, np.float32))])  # dropped, as the timeline
    with open_store(v1_store) as reader:
        assert reader.schema == 1 and reader.session == 2
        appended = reader.get("v1-appended")
        assert appended.segments[1].tokens.tolist() == [8, 9] and appended.segments[1].temperature is None
        assert reader.get("v1-finished").segments[3].tokens.tolist() == [30]
        assert len(reader.table("timeline")) == 0
        assert reader.scores("v1-appended") == {} and len(reader.table("scores")) == 0
