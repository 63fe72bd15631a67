"""``seamless`` in the real loop (mpiexec, real torch training, real HDF5; the deterministic test engine).

Rank 0 is the controller, rank 1 the trainer (its node carries ``rollout``: lendable), rank 2 a rollout
rank. A step whose batch is not ready lends rank 1 to rollout while the trainer waits and reclaims it when
the batch is ready: its generations are cut at a token boundary and continue on rank 2's engine from their
prefix. Lent with nothing to do (the step's new episodes went to rank 2), rank 1 first takes half of rank
2's running episodes (rebalancing), cut on rank 2 and continued on its own engine. The stored trajectories
must show it: replies in segments of two engines, each cut where its engine changes (``abort``), the text
the task judged equal to prefix + continuation, no generated token left off the reply.

Without a lendable rank (a cluster map whose trainer nodes lack ``rollout``) the same recipe runs as
``async`` and says so.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sfhpc.analysis import open_run
from sfhpc.data.store import open_store
from sfhpc.engine.tokenizer import load_tokenizer
from tests.conftest import run_sfhpc

pytestmark = [pytest.mark.mpi]

STEPS = 8
# repeat-letter (reply budgets from a long tail, which the test engine writes to), with every reply the task
# judges written to a file.
RECORDING_TASK = """\
import json, os

from sfhpc.tasks.long_tail import RepeatLetterTask


class RecordingRepeat(RepeatLetterTask):
    def episode(self, problem):
        inner = super().episode(problem)
        judge = inner.step

        def step(reply):
            with open(os.environ["SFHPC_TEST_REPLIES"], "a", encoding="utf-8") as f:
                f.write(json.dumps(reply) + "\\n")
            return judge(reply)

        inner.step = step
        return inner
"""
RECIPE = """\
name: lend
seed: 3
engine: {name: test, token_delay_s: 0.01}
algorithm: {group_size: 2}
pipeline: {mode: seamless, max_staleness: 3}
budgets: {steps: STEPS, prompts_per_step: 2, max_new_tokens: 128}
task: {name: "recording.py:RecordingRepeat", options: {min_count: 8, max_count: 120}}
roles:
  controller: {place_with: trainer}
  trainer:    {tags: [train], nodes: 1}
  rollout:    {tags: [rollout], nodes: 1}
"""
# This machine as two pools: the trainer's node without the rollout tag, so no rank may be lent.
NO_LENDING_MAP = """\
cluster: here
pools:
  trainers: {partition: train, nodes: 1, tags: [train], cpus_per_node: 8, memory_mb: 8000, gpus_per_node: 0}
  rollouts: {partition: rollout, nodes: 1, tags: [rollout], cpus_per_node: 8, memory_mb: 8000, gpus_per_node: 0}
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One small policy folder for both runs (as a run builds its own, with the task's text)."""
    from sfhpc.config.recipe import BuildSpec, ModelSpec
    from sfhpc.model.tiny import build_tiny_model
    from sfhpc.tasks.long_tail import RepeatLetterTask

    path = tmp_path_factory.mktemp("model") / "tiny"
    return build_tiny_model(ModelSpec(build=BuildSpec(layers=1, hidden_size=64, heads=1)), path, seed=3,
                            task=RepeatLetterTask(min_count=8, max_count=120))


def run(tmp_path: Path, model_dir: Path, *extra: str, steps: int = STEPS) -> tuple[Path, list[dict], list[dict], str]:
    (tmp_path / "recording.py").write_text(RECORDING_TASK)
    recipe = tmp_path / "lend.yaml"
    recipe.write_text(RECIPE.replace("STEPS", str(steps))
                      + f"model: {{path: {model_dir}}}\noutput_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("run", str(recipe), *extra, env={"SFHPC_TEST_REPLIES": str(tmp_path / "replies.jsonl")},
                     timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, events, rows, done.stdout


def test_a_lent_trainer_is_reclaimed_every_step_and_its_generations_finish_elsewhere(tmp_path: Path,
                                                                                  model_dir: Path) -> None:
    run_dir, events, rows, out = run(tmp_path, model_dir)
    assert "seamless: trainer ranks 1 are lent to rollout" in out
    lends = rows[-1]["lends"]
    assert f"seamless: {lends} lendings, {lends} reclaims; reclaim (batch ready -> training starts) mean" in out
    reclaims = [e for e in events if e["event"] == "reclaimed"]
    # Lent and reclaimed within a step, in every step whose batch was not ready when it began (the first one
    # at least: nothing is complete then); the latency (batch ready -> training may start) is reported.
    lent_steps = [r["step"] for r, before in zip(rows, [0] + [r["lends"] for r in rows]) if r["lends"] > before]
    assert lent_steps[:1] == [1] and [e["step"] for e in reclaims] == lent_steps, (lent_steps, reclaims)
    assert all(e["ranks"] == [1] for e in reclaims)
    assert all(r["lends"] == r["reclaims"] for r in rows)
    assert all(0 < r["reclaim_s"] < 1.0 if r["step"] in lent_steps else r["reclaim_s"] == 0 for r in rows), rows
    assert sum(e["interrupted"] for e in reclaims) >= 1 and sum(e["continued"] for e in reclaims) >= 1, reclaims
    assert [r["reclaim_moved"] for r in rows if r["step"] in lent_steps] == [e["moved"] for e in reclaims]

    judged = [json.loads(line) for line in (tmp_path / "replies.jsonl").read_text().splitlines()]
    tokenizer = load_tokenizer(model_dir)
    stops = set(tokenizer.chat_stop_ids)
    with open_store(run_dir / "trajectories.h5") as store:
        trajectories = [t for t in store.trajectories() if t.status in ("consumed", "finished")]
    reclaimed = rebalanced_replies = 0
    for t in trajectories:
        (reply, cut), = t.replies()  # single-turn, finished
        assert not cut
        generated = [s for s in t.segments if s.generated]
        assert sum(len(s) for s in generated) == len(reply) == t.num_generated  # no generated token discarded
        engines = [s.engine for s in generated]
        # Every reply, a continued one too, keeps its problem's own bound (N + slack), not the task-wide one.
        prompt = tokenizer.decode([int(x) for s in t.segments if not s.generated for x in s.tokens])
        asked = int(re.search(r"write (\d+) [a-z]", prompt).group(1))  # type: ignore[union-attr]
        assert len(reply) <= asked + 2, (asked, len(reply), [(s.engine, len(s)) for s in generated])
        for before, after in zip(generated, generated[1:]):
            if before.engine != after.engine:  # cut at a token boundary where it was, continued from the prefix
                assert before.finish_reason == "abort", [(s.engine, s.finish_reason) for s in generated]
        if len(set(engines)) > 1:
            assert [int(x) for s in generated for x in s.tokens] == [int(x) for x in reply]
            # Cut on the lent trainer's engine at a reclaim, continued on the rollout rank's.
            pairs = list(zip(generated, generated[1:]))
            reclaimed += any(a.engine == "test-r1" and b.engine == "test-r2" for a, b in pairs)
        # The lent rank plays no new episode (rebalancing sends those to the rollout rank): whatever it generated
        # was moved to it from rank 2, cut there after its tokens so far (possibly none yet, on a loaded machine:
        # an empty segment is not recorded) and continued here from that prefix.
        rebalanced_replies += "test-r1" in engines
        text = tokenizer.decode([int(x) for x in reply if int(x) not in stops])
        assert text in judged  # the task judged exactly the stored prefix + continuation
    assert reclaimed >= 1, "no reply was cut on the lent rank and finished on another engine"
    # Rebalancing: the step's new episodes go to the rollout rank, so the lent rank starts with none and takes
    # half of the rollout rank's running ones (the oldest groups'), cut there and continued on its engine.
    rebalanced = [e for e in events if e["event"] == "rebalanced"]
    assert rebalanced and rebalanced[0]["step"] == 1 and rows[0]["rebalanced"] == rebalanced[0]["moved"] > 0
    assert sum(r["rebalanced"] for r in rows) == sum(e["moved"] for e in rebalanced)
    assert all(e["donors"].keys() == {"2"} and e["drained"] == [1] for e in rebalanced), rebalanced
    assert rebalanced_replies >= 1, "no reply was moved from the rollout rank and continued on the lent one"
    assert {s.engine for t in trajectories for s in t.segments if s.generated} == {"test-r1", "test-r2"}

    # The trace anyone can open holds what the run's own timeline and event log hold.
    trace_file = tmp_path / "trace.json"
    done = run_sfhpc("traj", "trace", str(run_dir), "--out", str(trace_file))
    assert done.returncode == 0, done.stderr
    trace = json.loads(trace_file.read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    with open_run(run_dir) as analysed:
        timeline = analysed.timeline()
    assert len(spans) == len(timeline) and {e["pid"] for e in spans} == {1, 2}  # a track per rank, every interval
    assert sorted((e["pid"], e["name"], e["args"]["step"]) for e in spans) == sorted(
        (r, "idle" if state == "waiting" else state, step)
        for r, state, step in zip(timeline["rank"], timeline["state"], timeline["step"]))
    assert sum(e["dur"] for e in spans if e["pid"] == 1 and e["name"] == "lent") == pytest.approx(
        1e6 * timeline.loc[timeline["state"] == "lent", "seconds"].sum(), rel=1e-3)
    assert {e["args"]["step"] for e in spans if e["name"] == "lent"} == set(lent_steps)
    assert [e["args"]["step"] for e in trace if e["name"] == "reclaimed"] == lent_steps
    assert [e["name"] for e in trace if e["ph"] == "i" and e["name"].startswith("version")] == \
        [f"version {v}" for v in range(1, STEPS + 1)]
    assert all(e["ts"] >= 0 and {"name", "ph", "ts", "pid", "tid"} <= set(e) for e in trace)  # the format's rules
    names = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert names == {0: "rank 0 (controller)", 1: "rank 1 (trainer)", 2: "rank 2 (rollout)"}


def test_seamless_without_lendable_ranks_runs_as_async_and_says_so(tmp_path: Path, model_dir: Path) -> None:
    (tmp_path / "map.yaml").write_text(NO_LENDING_MAP)
    # Two steps: a lending would have shown in the first one (the other test reclaims in every step).
    run_dir, events, rows, out = run(tmp_path, model_dir, "--cluster", str(tmp_path / "map.yaml"), steps=2)
    assert "no trainer rank's node carries the 'rollout' tag" in out and "so this run is async" in out
    assert [e for e in events if e["event"] == "pipeline"][0]["mode"] == "async"
    assert not [e for e in events if e["event"] == "reclaimed"]
    assert len(rows) == 2 and not any("reclaim_s" in r for r in rows)
    with open_store(run_dir / "trajectories.h5") as store:
        engines = {s.engine for t in store.trajectories() for s in t.segments if s.generated}
    assert engines == {"test-r2"}  # only the rollout rank generated
