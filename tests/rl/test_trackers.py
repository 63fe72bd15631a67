"""Experiment trackers with the real packages, offline: a run cut after two steps and resumed logs its steps to
one wandb run (offline mode, under the run folder) and one MLflow run (a file store), each step once; read
back through MLflow's own client and through wandb's own files (config, history, summary)."""

from __future__ import annotations

import signal
import struct
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_sfhpc
from tests.rl.test_preemption_local import cut_after

pytestmark = [pytest.mark.mpi]

RECIPE = """\
name: cut
seed: 3
engine: {{name: test}}
model: {{build: {{layers: 1, hidden_size: 64, heads: 1}}}}
algorithm: {{group_size: 2}}
pipeline: {{mode: sync}}
budgets: {{steps: 4, prompts_per_step: 2}}
task: {{name: next-letter, options: {{letters: "abc"}}}}
logging:
  wandb: {{project: sfhpc-test, mode: offline}}
  mlflow: {{experiment: sfhpc-test, tracking_uri: "file://{mlruns}"}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train, rollout], nodes: 1}}
  rollout:    {{colocate_with: trainer}}
output_dir: {runs}
"""


def wandb_records(path: Path) -> list[Any]:
    """The records of a ``.wandb`` file: a 7-byte header, then 32 KiB blocks of records, each a 7-byte header
    (CRC-32, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes; a Record protocol buffer each."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, position, pending = [], 7, b""
    block = 32768
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # the block's tail is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0 and length == 0:
            position += left
            continue
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_a_resumed_run_continues_one_wandb_run_and_one_mlflow_run(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    mlruns, runs = tmp_path / "mlruns", tmp_path / "runs"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(mlruns=mlruns, runs=runs))
    # USR1, what Slurm sends ahead of a time limit: wandb's service process lives on to the safe point (TERM
    # would end it at once: `sfhpc.rl.trackers`).
    run_dir, _ = cut_after(recipe, runs, 2, env={"SFHPC_HOLD_PHASES": "train=2"}, stop=signal.SIGUSR1)
    done = run_sfhpc("run", str(recipe), "--resume", str(run_dir), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the run does for a file: URI
    client = MlflowClient(tracking_uri=f"file://{mlruns}")
    experiment = client.get_experiment_by_name("sfhpc-test")
    assert experiment is not None
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name
    assert run.data.params["name"] == "cut" and run.data.params["budgets.steps"] == "4"
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]  # every step once, across the two sessions
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"recipe.json", "reward.png"} <= artifacts

    sessions = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(sessions) == 2 and len({s.name.rsplit("-", 1)[1] for s in sessions}) == 1  # one run id
    steps: list[int] = []
    config: dict[str, str] = {}
    summary: dict[str, str] = {}
    for session in sessions:
        [file] = session.glob("run-*.wandb")
        for record in wandb_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                if "reward_mean" in items:
                    steps.append(int(items["_step"]))
            elif kind in ("run", "config"):  # the config comes with the run record, changes with config records
                update = record.run.config.update if kind == "run" else record.config.update
                config.update({i.key: i.value_json for i in update})
            elif kind == "summary":
                summary.update({i.key or "/".join(i.nested_key): i.value_json for i in record.summary.update})
    assert sorted(steps) == [1, 2, 3, 4]
    assert config["name"] == '"cut"' and "budgets" in config
    assert "reward_mean" in summary and "reward_curve" in summary
