"""``seamless`` with rebalancing on a multi-turn task (mpiexec, the test engine, real torch training, the HDF5
store): episodes of three turns, each reply bounded by its problem, whose agents talk to the rank's endpoint
over HTTP. A lent rank that runs dry takes running episodes of the rollout rank mid-reply; the donor's
generation (its HTTP handler's turn too) stops before the episode continues on the lent rank, so no reply
holds tokens the donor wrote after the move, and every moved reply continues from its prefix. Once with the
test engine (which writes every reply to its bound) and once with real vLLM engines.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sfhpc.data.store import open_store
from sfhpc.engine.tokenizer import load_tokenizer
from tests.conftest import run_sfhpc

pytestmark = [pytest.mark.mpi]

TURNS = 3
# repeat-letter asked three times in one episode: each reply may hold N + 2 tokens, which the test engine
# writes to (it never ends a reply early), so a reply that held more was written by two engines at once.
MULTI_TURN_TASK = f"""\
from sfhpc.tasks.base import StepResult
from sfhpc.tasks.long_tail import RepeatLetterTask


class RepeatThrice(RepeatLetterTask):
    name = "repeat-thrice"
    max_turns = {TURNS}

    def episode(self, problem):
        inner = super().episode(problem)
        judge, turns = inner.step, []

        def step(reply):
            turns.append(judge(reply).reward)
            if len(turns) == {TURNS}:
                return StepResult(done=True, reward=sum(turns) / {TURNS}, turn_reward=turns[-1])
            return StepResult(done=False, observation=f"again: write {{inner.count}} {{inner.letter}}",
                              turn_reward=turns[-1])

        inner.step = step
        return inner
"""
RECIPE = """\
name: lend-multi-turn
seed: 5
engine: {name: test, token_delay_s: 0.01, writes_to_budget: true}
algorithm: {group_size: 2}
pipeline: {mode: seamless, max_staleness: 2}
budgets: {steps: 4, prompts_per_step: 2, max_new_tokens: 64}
task: {name: "multi_turn.py:RepeatThrice", options: {min_count: 8, max_count: 60}}
model: {build: {layers: 1, hidden_size: 64, heads: 1}}
roles:
  controller: {place_with: trainer}
  trainer:    {tags: [train], nodes: 1}
  rollout:    {tags: [rollout], nodes: 1}
"""


# Real vLLM engines holding two sequences each (so that what a move finds depends less on the machine's
# speed); an untrained policy may end a reply early, so moves are fewer and may come in any turn.
VLLM_ENGINE = "engine: {name: vllm, max_num_seqs: 2}"


@pytest.mark.parametrize("engine", ["test", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_moved_multi_turn_episodes_continue_from_their_prefix_and_the_donor_stops(tmp_path: Path,
                                                                                   engine: str) -> None:
    (tmp_path / "multi_turn.py").write_text(MULTI_TURN_TASK)
    recipe = tmp_path / "recipe.yaml"
    text = RECIPE if engine == "test" else RECIPE.replace(RECIPE.splitlines()[2], VLLM_ENGINE)
    recipe.write_text(text + f"output_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("run", str(recipe), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert sum(e["moved"] for e in events if e["event"] == "rebalanced") >= 1, events

    tokenizer = load_tokenizer(run_dir / "model")
    with open_store(run_dir / "trajectories.h5") as store:
        trajectories = list(store.trajectories())
    assert not [t.fail_reason for t in trajectories if t.status == "failed"]
    moved_later_turns = moves = 0
    for t in trajectories:
        prompt = tokenizer.decode([int(x) for x in t.segments[0].tokens])
        asked = int(re.search(r"write (\d+) [a-z]", prompt).group(1))  # type: ignore[union-attr]
        # On every path of the trajectory's tree (forks too), no reply holds more than its bound: a donor that
        # kept writing after the move would have added its own reply to what the recipient continues.
        for index, segment in enumerate(t.segments):
            written = len(segment) if segment.generated else 0
            child, at = segment, segment.parent
            while written and at >= 0 and t.segments[at].generated:  # the reply's earlier runs, up to the fork
                written += child.fork_at
                child, at = t.segments[at], t.segments[at].parent
            assert written <= asked + 2, (asked, index, [(s.engine, len(s), s.finish_reason, s.parent)
                                                         for s in t.segments])
        for turn, span in enumerate(t.reply_spans()):
            runs = [t.segments[i] for i, _ in span]
            for before, after in zip(runs, runs[1:]):
                if before.engine != after.engine:  # cut where it was, continued from the prefix elsewhere
                    assert before.finish_reason == "abort", [(s.engine, len(s), s.finish_reason) for s in runs]
                    moves += 1
                    moved_later_turns += turn > 0
    # Episodes moved in their second or third turn: the multi-turn state moved with them (with vLLM, a move
    # at all: its replies may end before a move finds them).
    assert moved_later_turns >= 1 if engine == "test" else moves >= 1, (moves, moved_later_turns)
