"""A run cut by a stop signal and resumed on one machine (mpiexec, real torch, real HDF5; the test engine).

The signal goes to every rank process, as Slurm delivers it to a step's tasks. The run checkpoints at the
next safe point and exits with 75; ``sfhpc run --resume`` continues it to its last step. What is checked is
the pipeline's bookkeeping (the trajectories in flight, the checkpoint, the store, multi-turn agents talking to
the endpoint over HTTP), so the deterministic test engine generates, paced so that episodes are in flight
whenever the signal comes; a cut of real vLLM engines is the exact-resume test's (`test_resume_exact.py`) and
the Slurm preemption tests'.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sfhpc.bench._processes import step_pids
from sfhpc.data.store import open_store
from tests.conftest import ROOT, assert_one_line_error, run_sfhpc

pytestmark = [pytest.mark.mpi]

STEPS, TURNS = 4, 8
# guess-number that notes every turn it judges in $SFHPC_TEST_TURNS, so that the test can cut the run when an
# episode is mid-play: one turn judged, more to come.
TURN_LOG_TASK = """\
import json, os

from sfhpc.tasks.guess_number import GuessNumberTask


class TurnLogGuess(GuessNumberTask):
    def episode(self, problem):
        inner = super().episode(problem)
        judge = inner.step

        def step(reply):
            result = judge(reply)
            with open(os.environ["SFHPC_TEST_TURNS"], "a", encoding="utf-8") as f:
                f.write(json.dumps({"turn": inner.turns, "done": result.done}) + "\\n")
            return result

        inner.step = step
        return inner
"""
# The test engine writes letters, never a digit: every episode guesses wrong and plays all its turns. Each reply is
# two paced tokens, letters or spaces, which the agent sends back as text: the built tokenizer may spell that text
# with other tokens, and the endpoint continues the recorded ones, across the restart too (no fork).
MULTI_TURN = f"""\
name: cut
seed: 5
engine: {{name: test, token_delay_s: 0.2, writes_to_budget: true}}
model: {{build: {{layers: 1, hidden_size: 64, heads: 1}}}}
algorithm: {{group_size: 4}}
pipeline: {{mode: async, max_staleness: 1}}
budgets: {{steps: {STEPS}, prompts_per_step: 4, max_new_tokens: 2}}
task: {{name: "turn_log.py:TurnLogGuess", options: {{max_turns: {TURNS}}}}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train], nodes: 1}}
  rollout:    {{tags: [rollout], nodes: 1}}
"""


def write_recipe(tmp_path: Path) -> Path:
    """The recipe, with its task's file beside it."""
    (tmp_path / "turn_log.py").write_text(TURN_LOG_TASK)
    recipe = tmp_path / "cut.yaml"
    recipe.write_text(MULTI_TURN + f"output_dir: {tmp_path / 'runs'}\n")
    return recipe


def start_run(recipe: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "sfhpc", "run", str(recipe), *extra], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def cut_after(recipe: Path, runs: Path, steps: int, *, env: dict[str, str] | None = None,
              then: Callable[[], bool] | None = None, stop: int = signal.SIGTERM) -> tuple[Path, str]:
    """Start the recipe, send `stop` (SIGTERM) to every process of the ranks (vLLM's engine too, as Slurm
    does) once `steps` steps are done (and, after that, `then()` holds); returns the run folder and the output."""
    process = start_run(recipe, env=env)
    deadline = time.monotonic() + 600
    run_dir, stepped = None, False
    while time.monotonic() < deadline and process.poll() is None:
        folders = list(runs.glob("cut-*")) if runs.exists() else []
        stepped = stepped or bool(folders and steps_done(run_dir := folders[0]) >= steps)
        if stepped and (then is None or then()):
            break
        time.sleep(0.02 if stepped else 0.2)
    if run_dir is None or process.poll() is not None:
        process.kill()
        pytest.fail(f"the run ended before it could be cut:\n{process.communicate()[0][-3000:]}")
    for pid in step_pids(run_dir):
        with contextlib.suppress(ProcessLookupError):  # a helper process that ended meanwhile
            os.kill(pid, stop)
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 75, out[-4000:]  # stopped at a safe point: resumable, not done
    return run_dir, out


def test_a_cut_run_resumes_its_trajectories_and_trains_nothing_twice(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path)
    turns = tmp_path / "turns.jsonl"
    logged: list[int] = []

    def mid_play() -> bool:
        """True once an episode was judged on a turn, with turns to come, since the first call: the episodes
        of the groups in flight play their turns in step, so that one's group is mid-play."""
        size = turns.stat().st_size if turns.exists() else 0
        if not logged:
            logged.append(size)
            return False
        lines = turns.read_bytes()[logged[0]:].decode().splitlines()[:-1]  # whole lines only
        return any(not json.loads(line)["done"] for line in lines)

    run_dir, out = cut_after(recipe, tmp_path / "runs", 2, env={"SFHPC_TEST_TURNS": str(turns)}, then=mid_play)
    assert "stop requested: SIGTERM" in out and f"--resume {run_dir}" in out
    before = events(run_dir)
    assert [e["event"] for e in before] == ["stop-requested", "checkpoint", "quiesced", "stopped"]
    cut_time, stopped_at = before[0]["time"], before[-1]["step"]
    assert stopped_at >= 2 and before[1]["reason"] == "stop:SIGTERM"
    with open_store(run_dir / "trajectories.h5") as store:
        open_at_cut = {t.id for t in store.trajectories() if t.status in ("interrupted", "running")}
    assert open_at_cut, "nothing was in flight at the cut"

    # A newer checkpoint whose weights were cut short (a write the kill interrupted, a damaged disk) is named
    # and skipped, never deleted; the run resumes from the sound one before it.
    damaged = run_dir / "checkpoints" / "step-000099"
    shutil.copytree(before[1]["path"], damaged)
    (damaged / "trainer.pt").write_bytes((damaged / "trainer.pt").read_bytes()[:1000])
    done = run_sfhpc("run", str(recipe), "--resume", str(run_dir), env={"SFHPC_TEST_TURNS": str(turns)}, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"checkpoint {damaged}: trainer.pt has 1000 bytes" in done.stderr + done.stdout
    assert damaged.exists()
    resumed = [e for e in events(run_dir) if e["event"] == "resumed"]
    assert len(resumed) == 1 and resumed[0]["step"] == stopped_at and resumed[0]["checkpoint"] == before[1]["path"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # continued, no step repeated
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))
    with open_store(run_dir / "trajectories.h5") as store:
        marks = store.marks()
        trajectories = {t.id: t for t in store.trajectories()}
    consumed_by = [m.trajectory_id for m in marks]
    assert len(consumed_by) == len(set(consumed_by)) == STEPS * 4 * 4  # nothing trained twice
    continued = [t for tid, t in trajectories.items() if tid in open_at_cut
                 and any(s.t_end < cut_time for s in t.segments[1:])
                 and any(s.generated and s.t_start > resumed[0]["time"] - resumed[0]["seconds"] for s in t.segments)]
    assert continued, "no trajectory went on across the restart"
    assert len(continued) <= resumed[0]["resumed"] + resumed[0]["replayed"]
    for trajectory_id in open_at_cut:  # every one of them finished (and maybe trained on), or was dropped
        assert trajectories[trajectory_id].status in ("consumed", "finished", "stale", "aborted"), trajectory_id
    stale = sum(1 for tid in open_at_cut if trajectories[tid].status == "stale")
    assert stale <= resumed[0]["dropped_stale"] + 4 * 4  # dropped at the restart, or later by the bound
    # Multi-turn agents over HTTP, across the restart too: the agent reports one reward per policy reply, one
    # environment answer (the hint) lies between consecutive replies, and every reply is at least one
    # generated segment (two when a weight update or the cut interrupted it).
    consumed = [trajectories[tid] for tid in consumed_by]
    assert [len(t.turn_rewards) for t in consumed] == [TURNS] * len(consumed)
    for trajectory in consumed:
        assert sum(1 for s in trajectory.segments if s.kind == "observation") == TURNS - 1, trajectory.id
        assert sum(1 for s in trajectory.segments if s.generated) >= TURNS, trajectory.id
        assert trajectory.history_mismatches == 0, trajectory.id  # every reply on the branch, as sampled
    assert all(len(reply) == 2 for t in consumed for reply, _ in t.replies())

    # Slurm may requeue a finished job: resuming a complete run changes nothing.
    listing = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert f"step-{STEPS:06d}" in listing
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    again = run_sfhpc("run", str(recipe), "--resume", str(run_dir), timeout=300)
    assert again.returncode == 0 and "is complete" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == listing
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics


def test_resume_refuses_what_is_not_a_run_of_this_recipe(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path)
    not_a_run = tmp_path / "photos"
    not_a_run.mkdir()
    done = run_sfhpc("run", str(recipe), "--resume", str(not_a_run))
    assert_one_line_error(done, "not a run folder")
    done = run_sfhpc("run", str(recipe), "--resume", str(tmp_path / "missing"))
    assert_one_line_error(done, "no such folder")
    assert not (tmp_path / "runs").exists()  # nothing written
    assert list(not_a_run.iterdir()) == []


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path: Path) -> None:
    from sfhpc.config import load_recipe
    from sfhpc.rl.checkpoints import RunCheckpoints, run_identity

    recipe = write_recipe(tmp_path)
    run_dir = tmp_path / "runs" / "cut-earlier"
    (run_dir / "model").mkdir(parents=True)
    (run_dir / "model" / "config.json").write_text('{"hidden_size": 256}')
    checkpoints = RunCheckpoints(run_dir)
    partial = checkpoints.begin(3)
    (partial / "trainer.pt").write_bytes(b"x")
    checkpoints.commit(partial, step=3, version=3, identity=run_identity(load_recipe(recipe), run_dir / "model"),
                       reason="test")
    (run_dir / "model" / "config.json").write_text('{"hidden_size": 512}')  # another model now
    before = sorted(str(p) for p in run_dir.rglob("*"))
    done = run_sfhpc("run", str(recipe), "--resume", str(run_dir))
    line = assert_one_line_error(done, "another recipe or model", "model_config_sha256")
    assert re.search(r"step-000003", line)
    assert sorted(str(p) for p in run_dir.rglob("*")) == before
