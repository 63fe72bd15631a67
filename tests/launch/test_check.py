"""``sfhpc check RECIPE [--cluster MAP]``: what `run` (or `launch`) would refuse before starting, one line per
problem, every independent problem in one pass, nothing written; silent on a recipe that would start."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import RECIPES, run_sfhpc

RUNNABLE = ["demo.yaml", "arith-word.yaml", "guess-number.yaml", "guess-number-agent.yaml", "bench-pipeline.yaml"]


@pytest.mark.parametrize("cluster", [None, "cluster-dev.yaml"])
def test_the_shipped_recipes_pass_in_silence(cluster: str | None) -> None:
    for name in RUNNABLE:
        args = ["check", str(RECIPES / name)] + (["--cluster", str(RECIPES / cluster)] if cluster else [])
        done = run_sfhpc(*args)
        assert (done.returncode, done.stdout, done.stderr) == (0, "", ""), (name, done.stderr)


def test_every_problem_is_one_line_and_nothing_is_written(tmp_path: Path) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("name: bad\ntask: {name: next-word}\nmodel: {path: nowhere}\n"
                      "roles:\n  controller: {place_with: trainer}\n  trainer: {tags: [train], nodes: 1}\n"
                      "  rollout: {tags: [tpu], nodes: 1}\n"
                      f"output_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("check", str(recipe), "--cluster", str(RECIPES / "cluster-dev.yaml"))
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 3 and all(line.startswith("sfhpc: error: ") for line in lines), lines
    assert "unknown task 'next-word'" in lines[0]
    assert f"model.path: {tmp_path / 'nowhere'}" in lines[1] or "model.path: nowhere" in lines[1]
    assert "role 'rollout' needs nodes tagged [tpu]" in lines[2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]  # nothing written


def test_a_recipe_that_does_not_load_is_one_line(tmp_path: Path) -> None:
    recipe = tmp_path / "typo.yaml"
    recipe.write_text((RECIPES / "demo.yaml").read_text().replace("budgets:", "budget:"))
    done = run_sfhpc("check", str(recipe))
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and "budget" in done.stderr, done.stderr


@pytest.mark.parametrize("teacher", ["nowhere", "empty"])
def test_a_distillation_teacher_that_cannot_be_loaded_is_one_line(tmp_path: Path, teacher: str) -> None:
    (tmp_path / "empty").mkdir()
    recipe = tmp_path / "distill.yaml"
    recipe.write_text("name: distill\ntask: {name: next-letter}\n"
                      f"algorithm: {{distill: {{teacher: {tmp_path / teacher}}}}}\n"
                      "roles:\n  controller: {place_with: trainer}\n  trainer: {tags: [train]}\n"
                      "  rollout: {tags: [rollout]}\n  teacher: {place_with: trainer}\n")
    done = run_sfhpc("check", str(recipe))
    assert done.returncode == 2 and done.stdout == "", done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"sfhpc: error: {recipe}: algorithm.distill.teacher: {tmp_path / teacher} ")
    assert {"nowhere": "does not exist", "empty": "is no Hugging Face folder (no config.json)"}[teacher] in line


@pytest.mark.parametrize("name", ["arith-word-distill.yaml", "arith-word-distill-lora.yaml"])
def test_the_distillation_recipes_start_once_given_their_teacher(tmp_path: Path, name: str) -> None:
    """As shipped they name a teacher run to make first (`sfhpc check` says so); given one, nothing is left."""
    from sfhpc.config import load_recipe
    from sfhpc.rl.program import runnable_problems

    done = run_sfhpc("check", str(RECIPES / name))
    assert done.returncode == 2 and "algorithm.distill.teacher: runs/arith-word does not exist" in done.stderr
    (tmp_path / "config.json").write_text("{}")
    recipe = load_recipe(RECIPES / name, {"algorithm.distill.teacher": str(tmp_path)})
    assert runnable_problems(recipe) == []
    assert recipe.role("teacher") is not None and recipe.model.build.layers == 2
    assert (recipe.model.lora is not None) == name.endswith("lora.yaml")
