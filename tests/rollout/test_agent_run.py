"""An agent program inside a whole RL run (`sfhpc run`): real MPI ranks, real training, the real store; the
deterministic test engine answers the program's calls (an agent program over vLLM is the Slurm test's,
`test_agent_slurm.py`, which shares this recipe and these checks). The program imports nothing from sfhpc;
one of its episodes crashes and one hangs, and the run still trains its whole budget. The pipeline is
``sync``: a step waits for every episode it handed out, so the hung one holds the first step until its timeout
fails it (with ``async`` a quick run could train its budget on other groups and end before the timeout, and an
episode cut by the end of a run is not a failure)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from sfhpc.analysis import open_run
from sfhpc.data.store import open_store
from tests.conftest import run_sfhpc
from tests.rollout.test_agent_process import alive

pytestmark = [pytest.mark.mpi]

AGENT = Path(__file__).parent / "agents" / "guess_agent.py"

RECIPE = """\
name: agent-program
seed: 1
{model}
pipeline: {{mode: sync}}
budgets: {{steps: 2, prompts_per_step: 2, max_failed_fraction: 0.9}}
algorithm: {{group_size: 4}}
task: {{name: guess-number, options: {{max_turns: 4}}}}
agent:
  command: [{python}, {agent}, --turns, "4", --fault-dir, {faults}, --pid-file, {faults}/hang.pids]
  workers: 4
  timeout_s: {timeout_s}
  answer_to_program: true  # the program plays the environment: it knows the secret
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train], nodes: 1}}
  rollout:    {{tags: [rollout], nodes: 1}}
"""


# The policy the program talks to: a warm-started model on vLLM, or the test engine (a one-layer model).
VLLM = "model: {build: {warm_start_steps: 10}}"
TEST_ENGINE = "engine: {name: test}\nmodel: {build: {layers: 1, hidden_size: 64, heads: 1}}"


def agent_recipe(tmp_path: Path, *, engine: str = VLLM, timeout_s: int = 30) -> Path:
    faults = tmp_path / "faults"
    faults.mkdir()
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(python=sys.executable, agent=AGENT, faults=faults, model=engine,
                                    timeout_s=timeout_s) + f"output_dir: {tmp_path / 'runs'}\n")
    return recipe


def check_agent_run(run_dir: Path, faults: Path, *, timeout_s: int = 30) -> None:
    """The run trained its budget on the program's episodes, with every turn recorded, and the crash and the
    hang failed their own episodes only."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2]
    with open_store(run_dir / "trajectories.h5") as store:
        trajectories = list(store.trajectories())
    consumed = [t for t in trajectories if t.status == "consumed"]
    assert len(consumed) == 2 * 2 * 4
    turns = []
    for t in consumed:
        kinds = [s.kind for s in t.segments]
        # One reply per call (a reply a weight update cut is two segments, the first ending in 'abort'), and
        # the program's own hint before each later call: a reply the chat template does not render back into
        # the same tokens (a byte that is no UTF-8) makes that hint a fork, kept beside the branch.
        calls = sum(1 for s in t.segments if s.generated and s.finish_reason != "abort")
        assert kinds[0] == "prompt" and kinds.count("observation") == calls - 1
        # A reply can be empty: the policy may end its turn at once.
        assert t.task == "guess-number" and t.reward in (0.0, 1.0) and t.num_generated > 0
        turns.append(calls)
    assert max(turns) > 1  # the program drove several turns of one trajectory
    failed = [t for t in trajectories if t.status == "failed"]
    crashed = [t for t in failed if "crashed on purpose" in t.fail_reason]
    hung = [t for t in failed if t.fail_reason == f"timed out after {timeout_s} s"]
    assert len(crashed) == 1 and hung and len(crashed) + len(hung) == len(failed), [t.fail_reason for t in failed]
    assert crashed[0].fail_reason.startswith("AgentProgramFailed: the agent program exited with status 1; its "
                                             "stderr ends: RuntimeError: agent crashed on purpose after guessing")
    assert crashed[0].num_generated > 0 and all(t.num_generated > 0 for t in hung)  # their first turn is kept
    for pid in map(int, (faults / "hang.pids").read_text().split()):  # the hung program's group was killed
        assert not alive(pid)


# The hang holds the first step this long. An episode of the test engine (a program's start included) takes a
# second or two, so a normal one is far from it even on a loaded machine.
TIMEOUT_S = 20


def test_an_agent_program_plays_inside_the_rl_loop(tmp_path: Path) -> None:
    recipe = agent_recipe(tmp_path, engine=TEST_ENGINE, timeout_s=TIMEOUT_S)
    done = run_sfhpc("run", str(recipe), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Every program ended before its rank's loop did: asyncio's child watcher has nothing to complain of.
    assert "that handles pid" not in done.stdout + done.stderr
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    assert not any("that handles pid" in log.read_text(errors="replace") for log in run_dir.rglob("*.log"))
    check_agent_run(run_dir, tmp_path / "faults", timeout_s=TIMEOUT_S)


# Two agents per episode, the solver asking for two choices (n = 2): three trajectories an episode.
SEVERAL_TRAJECTORIES = """\
import json, sys
import openai
for line in sys.stdin:
    episode = json.loads(line)
    def agent(name):
        return openai.OpenAI(base_url=f"{episode['agents_base_url']}/{name}/v1", api_key=episode["api_key"],
                             max_retries=0)
    guesses = agent("solver").chat.completions.create(model="m", messages=episode["messages"], max_tokens=1, n=2)
    said = guesses.choices[0].message.content
    agent("checker").chat.completions.create(model="m", messages=[{"role": "user", "content": f"is {said} right?"}],
                                             max_tokens=1)
    print(json.dumps({"episode_id": episode["episode_id"], "rewards": {"solver": 1.0, "checker": 0.5}}), flush=True)
"""


@pytest.mark.parametrize("mode", ["sync", "seamless"])
def test_an_episode_of_several_trajectories_ends_once(tmp_path: Path, mode: str) -> None:
    """A rank's episodes in flight count episodes, not trajectories: in a sync run none is in flight when a
    step is reported (three ends an episode would leave the count at -8 after the first step); in a
    seamless one (the trainer rank lent while it waits; an agent program's episode moves by its generation,
    its end counted where it generates) at most the groups in flight's members."""
    (tmp_path / "two.py").write_text(SEVERAL_TRAJECTORIES)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: several\nseed: 2\n{TEST_ENGINE}\npipeline: {{mode: {mode}}}\n"
                      "budgets: {steps: 3, prompts_per_step: 2}\nalgorithm: {group_size: 2}\n"
                      "task: {name: guess-number}\n"
                      f"agent: {{command: [{sys.executable}, two.py], workers: 4, serve: true, timeout_s: 60}}\n"
                      "roles: {controller: {place_with: trainer}, trainer: {tags: [train], nodes: 1}, "
                      f"rollout: {{tags: [rollout], nodes: 1}}}}\noutput_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("run", str(recipe), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["trajectories"] for r in rows] == [2 * 2 * 3] * 3
    if mode == "sync":
        assert [r["episodes_in_flight"] for r in rows] == [0] * 3
    else:
        assert all(0 <= r["episodes_in_flight"] <= 2 * r["groups_in_flight"] for r in rows), rows
        assert rows[-1]["lends"] >= 1
    assert "that handles pid" not in done.stdout + done.stderr
    with open_run(run_dir) as run:
        frame = run.trajectories()
    if mode == "seamless":
        with open_store(run_dir / "trajectories.h5") as store:
            engines = {t.id: {s.engine for s in t.segments if s.generated} for t in store.trajectories()}
        # The lent trainer rank generated for programs of rank 2 (rebalanced: their generations routed to it);
        # no episode was played afresh.
        assert any(engines[tid] == {"test-r1"} for tid in frame.loc[frame["status"] == "consumed", "id"])
        assert "aborted" not in set(frame["status"])
    frame = frame[frame["status"] == "consumed"]  # (a seamless run ends with episodes of later steps begun)
    per_episode = frame.groupby("episode")["agent"].apply(sorted)
    assert len(per_episode) == 3 * 2 * 2 and all(a == ["checker", "solver", "solver"] for a in per_episode)
    assert set(frame.loc[frame["agent"] == "checker", "reward"]) == {0.5}
