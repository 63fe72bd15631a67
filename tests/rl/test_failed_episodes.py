"""A real run whose task raises on some episodes completes: those episodes are failed in the store with
their reason, their GRPO groups are dropped whole and replaced, and the run trains its full budget (mpiexec,
real torch, real HDF5; the deterministic test engine writes the replies the task judges)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sfhpc.data.store import open_store
from tests.conftest import run_sfhpc

pytestmark = [pytest.mark.mpi]

FLAKY_TASK = Path(__file__).parent / "flaky_letter.py"  # a user's task, by the path of its file

# Seed 2 draws the groups a, c, c, b, c, a, d, d, b, ...: the first group fails before its trajectories
# exist, a later one after the policy's reply; about half of the groups fail, under max_failed_fraction.
FLAKY = """\
name: flaky
seed: 2
engine: {name: test}
model: {build: {layers: 1, hidden_size: 64, heads: 1}}
pipeline: {mode: sync}
budgets: {steps: 3, prompts_per_step: 2, max_failed_fraction: 0.9}
algorithm: {group_size: 2}
task: {name: "FLAKY:FlakyLetterTask", options: {letters: "abcd"}}
roles:
  controller: {place_with: trainer}
  trainer:    {tags: [train, rollout], nodes: 1}
  rollout:    {colocate_with: trainer}
"""


def test_a_run_with_failing_episodes_completes_and_records_why(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    # The file beside the recipe, named relative to it: each rank (whatever its working folder) finds it.
    (tmp_path / FLAKY_TASK.name).write_text(FLAKY_TASK.read_text())
    recipe.write_text(FLAKY.replace("FLAKY", FLAKY_TASK.name) + f"output_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("run", str(recipe), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3]  # the whole budget was trained
    with open_store(run_dir / "trajectories.h5") as store:
        trajectories = list(store.trajectories())
    failed = [t for t in trajectories if t.status == "failed"]
    by_letter = {letter: [t for t in failed if t.group_key.endswith(f"-{letter}")] for letter in "ab"}
    assert by_letter["a"] and by_letter["b"] and len(failed) == len(by_letter["a"]) + len(by_letter["b"])
    for t in by_letter["a"]:  # failed before the first turn: recorded on a trajectory of its own
        assert t.fail_reason == "RuntimeError: no question can be asked about 'a'" and t.num_tokens == 0
    for t in by_letter["b"]:  # failed on the reply: the trajectory keeps what the policy wrote
        assert t.fail_reason.startswith("ValueError: cannot judge the reply ") and t.num_generated > 0
    # A failed member's group is never trained on: its other members were aborted, none consumed.
    spoiled = {t.group_key for t in failed}
    assert {t.status for t in trajectories if t.group_key in spoiled} <= {"failed", "aborted"}
    consumed = [t for t in trajectories if t.status == "consumed"]
    assert len(consumed) == 3 * 2 * 2 and not spoiled & {t.group_key for t in consumed}
