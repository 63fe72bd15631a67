"""``seamless`` under `sfhpc launch` on the dev cluster (real Slurm, real MPI across the het components, real
torch training; the deterministic test engine): the test's own cluster map tags the train partition's nodes
``train,rollout``, so the trainer rank on the train node is lent to rollout while it waits for each batch
and reclaimed when the batch is ready; the run finishes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sfhpc.data.store import open_store
from tests.conftest import run_sfhpc

pytestmark = [pytest.mark.slurm]

STEPS = 3
RECIPE = f"""\
name: seamless-on-slurm
seed: 3
engine: {{name: test, token_delay_s: 0.02}}
model: {{max_seq_len: 192, build: {{layers: 1, hidden_size: 64, heads: 1}}}}
algorithm: {{group_size: 2}}
pipeline: {{mode: seamless, max_staleness: 1}}
budgets: {{steps: {STEPS}, prompts_per_step: 2, max_new_tokens: 64}}
task: {{name: repeat-letter, options: {{min_count: 20, max_count: 60}}}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train], nodes: 1}}
  rollout:    {{tags: [rollout], nodes: 1}}
launch: {{time_minutes: 10}}
"""
# The dev cluster's partitions; the admin allows lending by tagging the train nodes "rollout" too.
CLUSTER_MAP = """\
cluster: sfhpcdev
pools:
  h100: {partition: train, constraint: h100, nodes: 2, tags: [train, rollout], cpus_per_node: 4, memory_mb: 4000}
  l40s: {partition: rollout, constraint: l40s, nodes: 2, tags: [rollout], cpus_per_node: 4, memory_mb: 4000}
"""


def test_launch_accepts_seamless_and_lends_the_trainer_node(slurm_cluster: str, tmp_path: Path) -> None:
    recipe, cluster = tmp_path / "seamless.yaml", tmp_path / "cluster.yaml"
    recipe.write_text(RECIPE + f"output_dir: {tmp_path / 'runs'}\n")
    cluster.write_text(CLUSTER_MAP)
    done = run_sfhpc("launch", str(recipe), "--cluster", str(cluster), "--wait", "--timeout", "500", timeout=560)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    assert "seamless: trainer ranks 1 are lent to rollout" in done.stdout
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "finished" and events[-1]["step"] == STEPS
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Lent in every step whose batch was not ready when it began, and reclaimed in the same step.
    lent_steps = [r["step"] for r, before in zip(rows, [0] + [r["lends"] for r in rows]) if r["lends"] > before]
    assert lent_steps[:1] == [1] and [e["step"] for e in events if e["event"] == "reclaimed"] == lent_steps
    assert all(r["lends"] == r["reclaims"] for r in rows)
    assert all(r["reclaim_s"] < 5.0 for r in rows), [r["reclaim_s"] for r in rows]  # a cut, not a wait
    report = json.loads((run_dir / "launch_report.json").read_text())
    assert [(r["roles"], r["component"]) for r in report["ranks"]] == [(["controller"], 0), (["trainer"], 0),
                                                                         (["rollout"], 1)]
    with open_store(run_dir / "trajectories.h5") as store:
        engines = {s.engine for t in store.trajectories() for s in t.segments if s.generated}
    assert engines == {"test-r1", "test-r2"}  # the lent trainer's engine on the train node generated too
