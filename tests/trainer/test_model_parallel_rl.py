"""Trainer ranks in the RL loop under tensor and pipeline parallelism (megatron-core on CPU through the
test-only shim, `tests/trainer/megatron_shim`), and the batch sent once over the trainers' communicator.

Publishing the weights is collective over the first trainer's model-parallel group (tensor-parallel
shards gathered, pipeline stages broadcast): if only the first trainer iterated them, the run would hang
at its first weight update. Here `sfhpc run` itself finishes with tensor parallel 2 and with pipeline
parallel 2, under a timeout that turns a hang into a failure; and on the real communicators of a run, the
rollout rank receives exactly the trainer's full weights after a step. The controller sends the batch to
the first trainer only, which broadcasts it: two DDP trainer ranks still train as one rank does on the
whole batch, and two that also serve rollout (colocated) get their step's command in their rollout loop.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.mpi

# On PYTHONPATH, it puts the CPU shim into every process that imports the megatron backend: the launcher
# passes the environment on to the ranks, so `sfhpc run` needs nothing else.
SHIM_SITE = ROOT / "tests" / "trainer" / "megatron_shim" / "site"


def _shim_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=f"{SHIM_SITE}:{ROOT}", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`command` in a session of its own; past `timeout` every process of it (mpiexec and its ranks
    included) is killed and the test fails, so a deadlock cannot hang the suite."""
    process = subprocess.Popen(command, cwd=ROOT, env=_shim_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"no end within {timeout} s (a deadlock?):\n{stdout[-2000:]}\n{stderr[-2000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


LOOP_RECIPE = """\
name: megatron-{name}
seed: 1
engine: {{name: test}}
training: {{backend: {backend}, tensor_parallel: {tp}, pipeline_parallel: {pp}}}
model: {{build: {{layers: 2}}}}
algorithm: {{group_size: 2}}
pipeline: {{mode: sync}}
budgets: {{steps: 2, prompts_per_step: 2}}
task: {{name: next-letter}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [{trainer_tags}], nodes: 1, tasks_per_node: 2}}
  rollout:    {rollout}
"""
OWN_NODE, COLOCATED = "{tags: [rollout], nodes: 1}", "{colocate_with: trainer}"  # where the rollout ranks run


@pytest.mark.parametrize(("backend", "tp", "pp", "rollout"), [
    ("megatron", 2, 1, OWN_NODE), ("megatron", 1, 2, OWN_NODE),
    ("torch", 1, 1, COLOCATED),  # two DDP ranks that also serve rollout: the step's command reaches them there
], ids=["tp2", "pp2", "ddp-colocated"])
def test_rl_loop_finishes_with_several_trainer_ranks(tmp_path: Path, backend: str, tp: int, pp: int,
                                                       rollout: str) -> None:
    recipe = tmp_path / "recipe.yaml"
    tags = "train" if rollout == OWN_NODE else "train, rollout"
    recipe.write_text(LOOP_RECIPE.format(name=f"{backend}-tp{tp}pp{pp}", backend=backend, tp=tp, pp=pp,
                                         rollout=rollout, trainer_tags=tags) + f"output_dir: {tmp_path / 'runs'}\n")
    done = _run([sys.executable, "-m", "sfhpc", "run", str(recipe)], timeout=480)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2]  # two steps trained, each published to the engine
    assert all(r["trained_tokens"] > 0 for r in rows)
    # The run's last checkpoint exports as a whole Hugging Face model: megatron's tensor shards and pipeline
    # stages joined (the torch backend's ranks shard it too), every weight of the model at its shape and where
    # the folder's was, up to what two Adam steps of the default 1e-4 can move it (a shard put in the wrong
    # place, or q, k and v split wrongly, would be off by the weights' own size, about 0.02).
    out = tmp_path / "export"
    exported = _run([sys.executable, "-m", "sfhpc", "export", str(run_dir), "--out", str(out), "--dtype", "float32"],
                    timeout=120)
    assert exported.returncode == 0, exported.stderr[-3000:]
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    weights = load_file(out / "model.safetensors")
    initial = AutoModelForCausalLM.from_pretrained(run_dir / "model").state_dict()
    tied = initial["lm_head.weight"].data_ptr() == initial["model.embed_tokens.weight"].data_ptr()
    assert set(weights) == set(initial) - ({"lm_head.weight"} if tied else set())
    assert all(weights[n].shape == initial[n].shape for n in weights)
    assert max(float((weights[n] - initial[n].float()).abs().max()) for n in weights) <= 2 * 1.5e-4
    loaded = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(loaded.state_dict()["model.norm.weight"], weights["model.norm.weight"])


PUBLISH_RECIPE = """\
name: publish-{name}
seed: 1
model: {{path: {model}, dtype: {dtype}}}
training: {{backend: {backend}, tensor_parallel: {tp}, pipeline_parallel: {pp}}}
algorithm: {{group_size: 4, learning_rate: 1.0e-3}}
task: {{name: next-letter}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train], nodes: 1, tasks_per_node: 2}}
  rollout:    {{tags: [rollout], nodes: 1}}
"""
LAYOUTS = {"ddp": ("torch", 1, 1, "float32"), "tp2": ("megatron", 2, 1, "bfloat16"),
           "pp2": ("megatron", 1, 2, "bfloat16")}


def test_trainer_ranks_publish_what_they_trained(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from tests.trainer.megatron_shim.models import build_gqa_model

    model = build_gqa_model(tmp_path / "model")  # 2 key/value heads: one query group per tensor-parallel rank
    for name, (backend, tp, pp, dtype) in LAYOUTS.items():
        (tmp_path / f"{name}.yaml").write_text(PUBLISH_RECIPE.format(name=name, model=model, dtype=dtype,
                                                                     backend=backend, tp=tp, pp=pp))
    done = _run(["mpiexec", "--oversubscribe", "--bind-to", "none", "-n", "4", sys.executable, "-m",
                 "tests.trainer.megatron_shim.publish_ranks", str(tmp_path), str(tmp_path), *LAYOUTS], timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    initial = {n: t.float() for n, t in load_file(str(model / "model.safetensors")).items()}
    for name in LAYOUTS:
        folder = tmp_path / name
        received = json.loads((folder / "received.json").read_text())
        first, second = (json.loads((folder / f"trainer{r}.json").read_text()) for r in (0, 1))
        assert received["version"] == first["version"] == 1
        assert set(received["weights"]) == set(initial), name  # every tensor, in the engine's names
        # Bit for bit what the trainers hold after the step (cast to the engine's dtype), on both ranks ...
        assert received["weights"] == first["weights"] == second["weights"], name
        # ... and not the weights it started from: the step happened and its result went out.
        wire = getattr(torch, LAYOUTS[name][3])
        changed = [n for n, v in received["weights"].items()
                   if not torch.equal(torch.tensor(v), initial[n].flatten().to(wire).float())]
        assert len(changed) > len(initial) // 2, name
    # Two DDP ranks, the batch broadcast from the first: one rank trained on the whole batch gets the same.
    single = json.loads((tmp_path / "ddp" / "single.json").read_text())
    ddp = json.loads((tmp_path / "ddp" / "received.json").read_text())
    for name, values in single["weights"].items():
        torch.testing.assert_close(torch.tensor(ddp["weights"][name]), torch.tensor(values), rtol=1e-4, atol=1e-5)
