"""Evaluation during training: held-out problems played on the engines, scored, never trained on.

A seamless run with the test engine evaluates before training, every 2 steps and after the last; its scores
are recomputed from the store, every evaluation token is of the version evaluated, the lent trainer rank
plays evaluation episodes, and no evaluation trajectory reaches a batch. (The same run leaves the replies its
length budget cut out of the loss, DAPO's over-long filtering, and checks that from the store too; then
`sfhpc eval` evaluates its last checkpoint offline.) The parts: the scores, the book of
evaluation groups, a restart's handling of a cut evaluation, the endpoint's sampling for evaluation turns,
and the recipe's refusals. Greedy evaluation on real vLLM engines rises with the reward in
`tests/rl/test_rl_run.py`.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from sfhpc.analysis import open_run
from sfhpc.config.recipe import EvaluationSpec
from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore, open_store
from sfhpc.data.trajectory import Status
from sfhpc.endpoint.errors import BadRequest
from sfhpc.endpoint.service import Sampling, SamplingRule
from sfhpc.rl.evaluation import Evaluation, score
from sfhpc.rl.resume import ControllerState, plan_resume
from sfhpc.tasks.letters import NextLetterTask
from tests.conftest import ROOT, assert_one_line_error, run_sfhpc

DATA = ROOT / "data" / "arith-word"
# Some spread, so that the scores are not all 0 or all 1: a reply passes when its length is even.
EVEN_REWARD = "def reward(reply, answer):\n    return float(len(reply) % 2 == 0)\n"
RECIPE = f"""\
name: evaluated
seed: 5
engine: {{name: test}}
model: {{build: {{layers: 1, hidden_size: 64, heads: 1}}}}
algorithm: {{group_size: 4, overlong: {{buffer_tokens: 4, mask_truncated: true}}}}
pipeline: {{mode: seamless, max_staleness: 1}}
budgets: {{steps: 5, prompts_per_step: 4}}
task:
  name: dataset
  options: {{path: {DATA / 'train.jsonl'}, prompt: question, answer: answer, reward: even.py:reward,
             max_reply_tokens: 8}}
evaluation: {{path: {DATA / 'test.jsonl'}, problems: 6, every: 2, samples: 3, temperature: 0.5}}
roles:
  controller: {{place_with: trainer}}
  trainer: {{tags: [train, rollout], nodes: 1}}
  rollout: {{tags: [rollout], nodes: 1}}
"""


def test_a_run_evaluates_held_out_problems_and_never_trains_on_them(tmp_path: Path) -> None:
    (tmp_path / "even.py").write_text(EVEN_REWARD)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE + f"output_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("run", str(recipe), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "evaluation: 6 problems" in done.stdout and "evaluation pass@1:" in done.stdout
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Before training (a row of its own, step 0), every 2 steps, and after the last.
    evaluated = {r["step"]: r for r in rows if "eval_pass_at_1" in r}
    assert sorted(evaluated) == [0, 2, 4, 5] and rows[0]["step"] == 0 and "reward_mean" not in rows[0]
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2, 3, 4, 5]
    assert all(r["eval_version"] == step and r["eval_problems"] == 6 and r["eval_k"] == 3
               for step, r in evaluated.items())

    with open_run(run_dir) as run:
        frame = run.trajectories()
    with open_store(run_dir / "trajectories.h5") as store:
        store_trajectories = list(store.trajectories())
    segments = {t.id: [s for s in t.segments if s.generated] for t in store_trajectories}
    evaluation = frame[frame["group"].str.startswith("eval-")]
    training = frame[~frame["group"].str.startswith("eval-")]
    assert len(evaluation) == 4 * 6 * 3 and set(evaluation["status"]) == {"evaluated"}
    assert evaluation["consumed_step"].isna().all()
    assert training["consumed_step"].notna().sum() == sum(r["trajectories"] for r in rows if "reward_mean" in r)
    for step, row in evaluated.items():
        these = evaluation[evaluation["group"].str.contains(f"-t{step}-p")]
        # The scores, recomputed from the store's rewards.
        by_problem = these.groupby("group")["reward"].apply(list)
        assert len(by_problem) == 6 and all(len(r) == 3 for r in by_problem)
        passed = [[r >= 1.0 for r in rewards] for rewards in by_problem]
        assert row["eval_pass_at_1"] == pytest.approx(np.mean([np.mean(p) for p in passed]))
        assert row["eval_pass_at_k"] == pytest.approx(np.mean([any(p) for p in passed]))
        assert row["eval_mean_at_k"] == pytest.approx(np.mean([r for rs in by_problem for r in rs]))
        # No weight update came between: every token is of the version evaluated.
        assert set(these["min_version"]) == set(these["max_version"]) == {step}
    assert 0 < np.mean([r["eval_pass_at_1"] for r in evaluated.values()]) < 1  # the scores carry information
    eval_segments = [s for tid in evaluation["id"] for s in segments[tid]]
    assert {s.temperature for s in eval_segments} == {0.5}
    assert {s.temperature for tid in training["id"] for s in segments[tid]} == {1.0}
    # seamless: the trainer rank, lent while the run evaluated, played evaluation episodes.
    assert {s.engine for s in eval_segments} == {"test-r1", "test-r2"}
    # DAPO's over-long handling (algorithm.overlong): the replies the 8-token budget cut left the loss.
    trained = [t for t in store_trajectories if t.status is Status.CONSUMED]
    cut = [t for t in trained if t.segments[-1].finish_reason == "length"]
    assert 0 < len(cut) < len(trained)
    assert sum(r["overlong_cut_replies"] for r in rows if "reward_mean" in r) == len(cut)
    assert sum(r["loss_tokens"] for r in rows if "reward_mean" in r) == sum(
        int(t.generated_mask().sum()) for t in trained if t.id not in {c.id for c in cut})
    assert all(r["overlong_penalty_mean"] > 0 for r in rows if r.get("overlong_cut_replies"))
    assert (run_dir / "reward.png").stat().st_size > 1000
    report = run_sfhpc("traj", "report", str(run_dir), "--out", str(tmp_path / "report.html"))
    assert report.returncode == 0, report.stderr
    html = (tmp_path / "report.html").read_text()
    evaluations = html.split("<h2>Evaluations on held-out problems</h2>")[1].split("</table>")[0]
    assert evaluations.count("<tr>") == 1 + 4  # a row per evaluation, under its header

    # Offline: the newest checkpoint (step 5) on 4 rows of another file, greedily, by the run's own recipe.
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text("".join((DATA / "test.jsonl").read_text().splitlines(keepends=True)[10:14]))
    done = run_sfhpc("eval", str(run_dir), "--data", str(held_out), "--temperature", "0", "--samples", "1",
                     timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (eval_dir,) = (run_dir / "evaluations").iterdir()
    (row,) = [json.loads(line) for line in (eval_dir / "metrics.jsonl").read_text().splitlines()]
    assert (row["eval_problems"], row["eval_k"], row["eval_version"]) == (4, 1, 0)  # every row of the file
    assert done.stdout.splitlines()[-1] == (
        f"step 5 of {run_dir} on {held_out}: pass@1 {row['eval_pass_at_1']:.3f}, mean@1 {row['eval_mean_at_k']:.3f}, "
        f"pass@1 {row['eval_pass_at_k']:.3f} (4 problems x 1, 0 failed); in {eval_dir}")
    assert json.loads((eval_dir / "model" / "sfhpc_export.json").read_text())["step"] == 5  # the trained policy
    with open_run(eval_dir) as run:
        frame = run.trajectories()
    assert len(frame) == 4 and set(frame["status"]) == {"evaluated"}
    assert row["eval_pass_at_1"] == pytest.approx(float(np.mean(frame["reward"] >= 1.0)))
    with open_store(eval_dir / "trajectories.h5") as store:
        assert {s.temperature for t in store.trajectories() for s in t.segments if s.generated} == {0.0}
    assert_one_line_error(run_sfhpc("eval", str(run_dir), "--data", str(tmp_path / "nothing.jsonl")),
                          "--data", "no such file")
    assert_one_line_error(run_sfhpc("eval", str(tmp_path)), str(tmp_path), "no complete checkpoint")


def test_a_run_of_no_steps_evaluates_the_initial_policy_and_keeps_nothing_else(tmp_path: Path) -> None:
    """``budgets.steps: 0``: what evaluating a checkpoint takes (with ``model.init_from``; here the built model)."""
    (tmp_path / "even.py").write_text(EVEN_REWARD)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.replace("steps: 5,", "steps: 0,") + f"output_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("run", str(recipe), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "the initial policy only (budgets.steps: 0)" in done.stdout
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == row["eval_version"] == 0 and row["eval_problems"] == 6 and "reward_mean" not in row
    assert f"evaluation pass@1: {row['eval_pass_at_1']:.3f} (version 0), 1 evaluation of 6" in done.stdout
    with open_run(run_dir) as run:
        frame = run.trajectories()
    assert len(frame) == 6 * 3 and set(frame["status"]) == {"evaluated"}
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    text = RECIPE.replace("steps: 5,", "steps: 0,")
    recipe.write_text(re.sub(r"^evaluation: .*\n", "", text, flags=re.M))
    assert_one_line_error(run_sfhpc("check", str(recipe)), "budgets.steps", "add an evaluation section")


def test_scores_of_an_evaluation() -> None:
    ended = {"p0": {"a": 1.0, "b": 0.0, "c": None},  # one of three passes; one failed
             "p1": {"a": 0.5, "b": 0.5, "c": 0.5},   # none passes
             "p2": {"a": 1.0, "b": 1.0, "c": 2.0}}   # every one passes
    pass_at_1, mean_at_k, pass_at_k, failed = score(ended, pass_reward=1.0)
    assert pass_at_1 == pytest.approx((1 / 3 + 0 + 1) / 3)
    assert mean_at_k == pytest.approx((1.0 + 0 + 0 + 1.5 + 4.0) / 9)
    assert pass_at_k == pytest.approx(2 / 3) and failed == 1
    assert score(ended, pass_reward=0.5)[0] == pytest.approx((1 / 3 + 1 + 1) / 3)


def test_evaluations_are_due_with_fixed_problems_and_leave_the_training_draws_alone() -> None:
    task = NextLetterTask()
    spec = EvaluationSpec(every=3, problems=5, samples=2, temperature=1.0)
    evaluation = Evaluation(spec, task, source="r.yaml", seed=7, last_step=10)
    assert [s for s in range(11) if evaluation.due(s)] == [0, 3, 6, 9, 10]
    assert not Evaluation(EvaluationSpec(before_training=False), task, source="r", seed=7, last_step=4).due(0)
    again = Evaluation(spec, task, source="r.yaml", seed=7, last_step=10)
    assert evaluation.problems == again.problems and len(evaluation.problems) == 5
    tickets, groups = evaluation.tickets(session=3, step=6)
    assert groups == [f"eval-s3-t6-p{i}" for i in range(5)]
    assert [t.group for t in tickets] == [g for g in groups for _ in range(2)]
    assert [t.problem for t in tickets[::2]] == evaluation.problems
    assert len({t.seed for t in tickets}) == 10
    with pytest.raises(Exception, match="evaluation.path.*reads no data file"):
        Evaluation(EvaluationSpec(path="held-out.jsonl"), task, source="r.yaml", seed=7, last_step=10)


def test_the_book_closes_evaluation_trajectories_as_they_end_and_never_batches_them(tmp_path: Path) -> None:
    manager = TrajectoryManager(TrajectoryStore.open(tmp_path / "t.h5"))
    ids = []
    for _ in range(2):  # a whole "group" of two finished members: a training group of this size would be a batch
        tid = manager.start([1, 2], group="eval-s1-t0-p0")
        manager.add_generated(tid, [3], [-0.1], 0, finish_reason="stop")
        ids.append(tid)
    failing = manager.start([1], group="eval-s1-t0-p1")
    manager.book_group("g-train")
    trained = [manager.start([1, 2], group="g-train") for _ in range(2)]
    for tid in trained:
        manager.add_generated(tid, [3], [-0.1], 0, finish_reason="stop")
        manager.finish(tid, 1.0)
    manager.finish(ids[0], 1.0)
    assert manager.status(ids[0]) == Status.EVALUATED
    assert manager.take_evaluation(["eval-s1-t0-p0", "eval-s1-t0-p1"], 2) is None  # not every episode ended
    manager.finish(ids[1], 0.0)
    manager.fail(failing, "timed out")
    assert manager.take_evaluation(["eval-s1-t0-p0", "eval-s1-t0-p1"], 2) is None  # p1 has one of its two
    assert manager.take_evaluation(["eval-s1-t0-p0", "eval-s1-t0-p1"], 1) == {
        "eval-s1-t0-p0": {ids[0]: 1.0, ids[1]: 0.0}, "eval-s1-t0-p1": {failing: None}}
    batch = manager.take_batch(0, 1, 2)
    assert batch is not None and {t.id for t in batch.trajectories} == set(trained)
    assert manager.take_batch(0, 1, 2) is None
    assert manager.counts()["evaluated"] == 2 and manager.counts()["failed"] == 1
    manager.close()


def test_a_restart_aborts_an_evaluation_the_stop_cut(tmp_path: Path) -> None:
    store_path = tmp_path / "t.h5"
    manager = TrajectoryManager(TrajectoryStore.open(store_path))
    ended = manager.start([1], group="eval-s1-t4-p0")
    manager.add_generated(ended, [3], [-0.1], 4, finish_reason="stop")
    manager.finish(ended, 1.0)
    cut = manager.start([1], group="eval-s1-t4-p0")
    manager.add_generated(cut, [3], [-0.1], 4, finish_reason="abort")
    manager.close()
    manager = TrajectoryManager(TrajectoryStore.open(store_path))
    state = ControllerState(step=4, version=4, rng=random.Random(0).getstate(), next_group=0, open_groups={})
    plan = plan_resume(state, manager, max_token_lag=None, group_size=2)
    assert plan.episodes == [] and plan.waiting_groups == 0 and plan.abandoned == 1
    assert manager.status(cut) == Status.ABORTED and manager.status(ended) == Status.EVALUATED
    assert manager.groups_in_flight() == 0
    manager.close()


def test_evaluation_turns_sample_as_the_section_says_greedy_included() -> None:
    rule = SamplingRule(default_temperature=1.0, evaluation_temperature=0.0)
    assert rule.apply(Sampling(), "eval-s1-t0-p0").temperature == 0.0
    assert rule.apply(Sampling(temperature=0.7, top_p=0.9), "eval-s1-t0-p0").top_p == 0.9
    assert rule.apply(Sampling(), "s1-g0-3").temperature == 1.0
    with pytest.raises(BadRequest, match="greedy"):
        rule.apply(Sampling(temperature=0.0), "s1-g0-3")
    with pytest.raises(BadRequest, match="greedy"):  # a run that evaluates nothing takes no group for one
        SamplingRule(1.0).apply(Sampling(temperature=0.0), "eval-s1-t0-p0")


@pytest.mark.parametrize(("section", "fragments"), [
    ("{samples: 4}", ["evaluation.temperature", "same reply 4 times"]),
    ("{every: 0}", ["evaluation.every", "at least 1"]),
    ("{temperature: 3}", ["evaluation.temperature", "from 0 (greedy) to 2"]),
    ("{every: 2}", ["evaluation.path", "required for the dataset task"]),
    ("{path: missing.jsonl}", ["evaluation.path", "missing.jsonl does not exist"]),
])
def test_a_bad_evaluation_section_is_one_line(tmp_path: Path, section: str, fragments: list[str]) -> None:
    recipe = tmp_path / "recipe.yaml"
    text = RECIPE.replace("reward: even.py:reward", "reward: numeric")
    recipe.write_text(re.sub(r"^evaluation: .*$", f"evaluation: {section}", text, flags=re.M))
    assert_one_line_error(run_sfhpc("check", str(recipe)), *fragments)
    assert not (tmp_path / "runs").exists()
