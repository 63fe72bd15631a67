"""``sfhpc eval RUN [--step N] [--data FILE]``: a trained run's checkpoint evaluated on held-out problems.

An offline evaluation is a run of no steps (``budgets.steps: 0``) of the run's own recipe, its model the
checkpoint (``model.init_from``), its ``evaluation`` section pointed at the file given (or the recipe's own),
made by overriding those keys (`sfhpc.config.overrides`): the same task, reward, agent program, engine and
sampling rules as in training, and the same scores (`sfhpc.rl.evaluation`). Its folder is a run folder of
its own under ``RUN/evaluations/``, with the replies in its store and the scores in its ``metrics.jsonl``
(one row, step 0); experiment trackers are left out, so the training run's charts do not get a second run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from sfhpc.config.recipe import Recipe, load_recipe
from sfhpc.errors import SfhpcError
from sfhpc.rundir import RunPaths, recorded_recipe


@dataclasses.dataclass(frozen=True)
class OfflineEvaluation:
    """What ``sfhpc eval`` runs: the recipe file, the keys set over it, the recipe they make, the checkpoint."""

    recipe_path: Path
    overrides: dict[str, Any]
    recipe: Recipe
    step: int
    checkpoint: Path


def prepare(run_dir: Path, *, step: int | None = None, data: Path | None = None, recipe_path: Path | None = None,
            samples: int | None = None, temperature: float | None = None, problems: int | None = None,
            extra: dict[str, Any] | None = None) -> OfflineEvaluation:
    """The evaluation of `run_dir`'s checkpoint of `step` (default: the newest); every problem is one line."""
    from sfhpc.rl.export import find_checkpoint

    run_dir = run_dir.absolute()
    if not run_dir.is_dir():
        raise SfhpcError(f"{run_dir}: no such run folder")
    info = find_checkpoint(run_dir, step)
    recorded = recorded_recipe(run_dir)
    if recipe_path is None:
        if recorded is None:
            raise SfhpcError(f"{run_dir}: the run did not note its recipe ({RunPaths(run_dir).recipe.name}); "
                             "pass --recipe with the recipe it was started with")
        recipe_path = recorded[0]
        if not recipe_path.is_file():
            raise SfhpcError(f"{run_dir}: its recipe {recipe_path} is gone; pass --recipe with a copy of it")
    overrides: dict[str, Any] = dict(recorded[1]) if recorded is not None else {}
    overrides.update({
        "model.path": None, "model.build": None, "model.init_from": str(info.path),
        "budgets.steps": 0,
        "evaluation.before_training": True,
        "output_dir": str(RunPaths(run_dir).evaluations),
        "logging": None,
    })
    if data is not None:
        if not data.is_file():
            raise SfhpcError(f"--data {data}: no such file")
        overrides["evaluation.path"] = str(data.resolve())
    for key, value in (("samples", samples), ("temperature", temperature), ("problems", problems)):
        if value is not None:
            overrides[f"evaluation.{key}"] = value
    overrides.update(extra or {})
    recipe = load_recipe(recipe_path, overrides)
    if recipe.evaluation is None or (recipe.evaluation.path is None and recipe.task.name == "dataset"):
        raise SfhpcError(f"{recipe_path}: no held-out problems to evaluate on: pass --data FILE (rows with the "
                         "task's prompt and answer keys)")
    return OfflineEvaluation(recipe_path, overrides, recipe, info.step, info.path)


def summary(evaluation: OfflineEvaluation, run_dir: Path, eval_dir: Path) -> str:
    """The line ``sfhpc eval`` ends with: what was evaluated, on what, and its scores."""
    rows = [json.loads(line) for line in RunPaths(eval_dir).metrics.read_text().splitlines() if line.strip()]
    row = next(r for r in rows if "eval_pass_at_1" in r)
    spec = evaluation.recipe.evaluation
    assert spec is not None  # prepare() refused a recipe without one
    on = spec.path or f"{evaluation.recipe.task.name}'s own draws"
    return (f"step {evaluation.step} of {run_dir} on {on}: pass@1 {row['eval_pass_at_1']:.3f}, "
            f"mean@{row['eval_k']} {row['eval_mean_at_k']:.3f}, pass@{row['eval_k']} {row['eval_pass_at_k']:.3f} "
            f"({row['eval_problems']} problems x {row['eval_k']}, {row['eval_failed']} failed); in {eval_dir}")
