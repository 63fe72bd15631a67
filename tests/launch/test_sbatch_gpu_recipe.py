"""The GPU site's recipe (recipes/h100-l40s-grpo.yaml) is a complete RL run: GRPO on the shipped dataset
shape with the numeric reward, the torch backend sharded over the trainer nodes, vLLM on the rollout nodes.
Everything but its model folder, which is not on this machine, passes the checks `sfhpc launch`
makes before it submits; the missing folder is one clear line, before Slurm is touched."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from sfhpc.config import load_cluster_map, load_recipe
from sfhpc.plan.resolve import resolve
from tests.conftest import RECIPES, ROOT, assert_one_line_error, run_sfhpc

RECIPE, SITE = RECIPES / "h100-l40s-grpo.yaml", RECIPES / "cluster-h100-l40s.yaml"


def test_the_gpu_recipe_is_a_complete_rl_run() -> None:
    recipe = load_recipe(RECIPE)
    assert recipe.task.name == "dataset"
    assert {k: recipe.task.options[k] for k in ("prompt", "answer", "reward")} == \
        {"prompt": "question", "answer": "answer", "reward": "numeric"}
    assert (recipe.training.backend, recipe.training.sharding, recipe.engine.name) == ("torch", "full", "vllm")
    assert recipe.model.max_seq_len > recipe.budgets.max_new_tokens
    plan = resolve(recipe, load_cluster_map(SITE))
    trainers = sum(1 for slot in plan.ranks() if "trainer" in slot.roles)
    assert trainers == 32 and recipe.training.shards(trainers, on_gpu=True)


def test_the_gpu_recipe_fits_its_gpus_by_the_memory_plan(tmp_path: Path) -> None:
    from sfhpc.model.shapes import shape
    from sfhpc.plan.memory import GIB
    from sfhpc.plan.run_memory import planned_ranks

    folder = tmp_path / "qwen2.5-1.5b"  # the config of the model it names (the plan reads nothing else)
    folder.mkdir()
    shape("qwen2.5-1.5b").config().to_json_file(folder / "config.json")
    recipe = load_recipe(RECIPE)
    recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, path=str(folder)))
    site = load_cluster_map(SITE)
    trainer, engine = planned_ranks(recipe, resolve(recipe, site), site)
    assert (trainer.role, trainer.ranks, engine.role, engine.ranks) == ("trainer", 32, "engine", 32)
    # Sharded over 32 ranks, a rank holds 1/32 of the 16 bytes a parameter; its micro-batch and logits dominate.
    assert trainer.memory.item("optimizer") == 8 * 1_543_714_304 // 32
    assert trainer.memory.fits and trainer.memory.total < 20 * GIB < trainer.memory.capacity
    assert engine.memory.fits and engine.memory.item("engine weights") == 2 * 1_543_714_304


def test_all_but_the_model_folder_is_runnable(tmp_path: Path) -> None:
    from sfhpc.model.hf_folder import build_hf_model
    from sfhpc.rl.program import check_runnable

    recipe = load_recipe(RECIPE)
    # A Qwen2 folder (2 key/value heads, as Qwen2.5-1.5B) where the site's copy would be: the dataset file,
    # the task's options, the reward, the model's tokenizer and chat template and the layout rules all pass.
    qwen2 = build_hf_model(tmp_path / "qwen2", "qwen2", heads=4, kv_heads=2, hidden_size=256)
    check_runnable(dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, path=str(qwen2))))


def test_launch_names_the_missing_model_folder_in_one_line(tmp_path: Path) -> None:
    recipe = load_recipe(RECIPE)
    path = recipe.model.path
    assert path is not None and not Path(path).exists()
    runs = ROOT / recipe.output_dir  # relative to where sfhpc runs
    before = set(runs.glob(f"{recipe.name}-*")) if runs.is_dir() else set()
    env = {"SLURM_CONF": str(tmp_path / "no-slurm.conf")}  # were Slurm touched, it would fail another way
    done = run_sfhpc("launch", os.path.relpath(RECIPE, ROOT), "--cluster", os.path.relpath(SITE, ROOT), env=env,
                     timeout=120)
    assert_one_line_error(done, f"model.path: {path} does not exist")
    assert (set(runs.glob(f"{recipe.name}-*")) if runs.is_dir() else set()) == before  # no run folder
