"""A rollout rank's vLLM engine killed mid-reply (SIGKILL of its engine core, as the kernel's OOM killer would)
is restarted inside the rank with the weights it had, and the run finishes every step: real vLLM, real torch
training, real MPI, the HDF5 store.

The rank keeps a copy of each version it receives (``engine.max_restarts``), and the new engine loads it: the
log-probabilities the new engine gives its tokens are the trainer's under that version (from the run's own
checkpoint, exported), not the starting folder's. The replies cut by the death continue from their prefix on
the new engine, in one reply the task judged as it is stored; the restart is in the event log and the metrics.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sfhpc.data.store import open_store
from sfhpc.engine.tokenizer import load_tokenizer
from sfhpc.trainer.batch import TrainBatch
from sfhpc.trainer.teacher import TeacherScorer
from tests.conftest import run_sfhpc
from tests.rl.recorded_replies import run_recording_replies, task_and_roles

pytestmark = [pytest.mark.vllm, pytest.mark.mpi]

STEPS = 4
REPLY_TOKENS = 48
RECIPE = f"""\
name: restart
seed: 4
algorithm: {{group_size: 2}}
pipeline: {{mode: sync}}
engine: {{name: vllm, max_restarts: 1}}
budgets: {{steps: {STEPS}, prompts_per_step: 2, max_new_tokens: {REPLY_TOKENS}}}
training: {{checkpoint_every: 1}}
""" + task_and_roles(REPLY_TOKENS)


def test_a_killed_engine_restarts_with_its_weights_and_the_run_finishes(tmp_path: Path) -> None:
    # Rank 2 is the rollout rank: its engine dies once it holds version 2, 0.1 s into the next generation.
    run_dir, judged = run_recording_replies(tmp_path, RECIPE, env={"SFHPC_INJECT_FAULTS": "engine=kill@2"})
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    [restarted] = [e for e in events if e["event"] == "engine-restarted"]
    assert restarted["rank"] == 2 and restarted["restarts"] == 1
    assert rows[-1]["engine_restarts"] == 1 and rows[0]["engine_restarts"] == 0
    log = (run_dir / "logs" / "rank-002.log").read_text()
    assert "engine 'vllm-r2': its engine core died under request" in log
    assert "engine 'vllm-r2' restarted with weights of version 2" in log

    tokenizer = load_tokenizer(run_dir / "model")
    stops = set(tokenizer.chat_stop_ids)
    with open_store(run_dir / "trajectories.h5") as store:
        trajectories = list(store.trajectories())
    cut = []
    for t in trajectories:
        generated = [s for s in t.segments if s.generated]
        if t.status in ("consumed", "finished"):  # one whole reply, every generated token kept
            (reply, was_cut), = t.replies()
            assert not was_cut and sum(len(s) for s in generated) == len(reply)
            assert tokenizer.decode([int(x) for x in reply if int(x) not in stops]) in judged
        if any(s.finish_reason == "abort" and len(s) > 0 for s in generated[:-1]):
            cut.append(t)
    assert cut, "no reply was cut by the engine's death"  # continued from its prefix: the checks above

    # The new engine's log-probabilities are the trainer's under the version it restored (version 2: the kill came
    # during step 3's generation), not the starting folder's: score what it sampled (each cut reply's last
    # segment) under both.
    assert all({int(v) for v in t.token_versions() if v >= 0} == {2} for t in cut), "cut outside step 3"
    exported = tmp_path / "v2"
    done = run_sfhpc("export", str(run_dir), "--step", "2", "--out", str(exported), "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    batch = TrainBatch.from_trajectories(cut)
    behaviour, generated = batch.behaviour_logprobs.numpy(), batch.generated.numpy().astype(bool)
    continued = np.zeros_like(generated)
    for row, t in enumerate(cut):  # the last generated segment came from the new engine
        positions = np.flatnonzero(generated[row])
        continued[row, positions[-len([s for s in t.segments if s.generated][-1]):]] = True
    gaps = {}
    for name, folder in (("v2", exported), ("folder", run_dir / "model")):
        ours = TeacherScorer(folder).score(batch)
        gaps[name] = float(np.abs(ours[continued] - behaviour[continued]).mean())
    assert gaps["v2"] < 0.05 and gaps["folder"] > 4 * gaps["v2"], gaps


def test_without_restarts_a_dead_engine_ends_the_run_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "recording.py").write_text("def reward(reply, answer):\n    return 0.0\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.replace("max_restarts: 1", "max_restarts: 0") + f"output_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("run", str(recipe), env={"SFHPC_INJECT_FAULTS": "engine=kill@2"}, timeout=600)
    assert done.returncode != 0
    assert "rank 2: engine 'vllm-r2' died (its processes are gone); engine.max_restarts restarts it inside the rank" \
        in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
