"""A recipe's model.path that cannot be a policy is refused before any job starts, in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import RECIPES, assert_one_line_error, run_sfhpc


def _recipe(tmp_path: Path, model_path: Path) -> Path:
    recipe = tmp_path / "demo.yaml"
    text = (RECIPES / "demo.yaml").read_text().replace("  warm_start_steps: 60\n", f"  path: {model_path}\n")
    recipe.write_text(text + f"output_dir: {tmp_path / 'runs'}\n")
    return recipe


def _folder(tmp_path: Path, *files: str) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    for name in files:
        (folder / name).write_text("{}")
    return folder


@pytest.mark.parametrize(("make", "what"), [
    (lambda tmp: tmp / "nowhere", "does not exist"),
    (lambda tmp: _folder(tmp, "config.json") / "config.json", "is not a folder"),
    (lambda tmp: _folder(tmp), "has no config.json"),
    (lambda tmp: _folder(tmp, "config.json", "tokenizer.json"), "has no weights (*.safetensors or pytorch_model"),
], ids=["missing", "a-file", "empty-folder", "no-weights"])
def test_run_refuses_a_model_path_it_cannot_load(tmp_path: Path, make, what: str) -> None:  # type: ignore[no-untyped-def]
    model = make(tmp_path)
    done = run_sfhpc("run", str(_recipe(tmp_path, model)), timeout=60)
    assert_one_line_error(done, f"model.path: {model} {what}")
    assert not (tmp_path / "runs").exists()  # refused before a run folder (or a job) exists


def test_launch_refuses_it_too_before_touching_slurm(tmp_path: Path) -> None:
    model = _folder(tmp_path)
    done = run_sfhpc("launch", str(_recipe(tmp_path, model)), timeout=60)
    assert_one_line_error(done, f"model.path: {model} has no config.json")
    assert not (tmp_path / "runs").exists()


def test_a_model_folder_with_config_and_weights_passes(tmp_path: Path) -> None:
    from sfhpc.config import load_recipe
    from sfhpc.rl.program import check_runnable

    check_runnable(load_recipe(_recipe(tmp_path, _folder(tmp_path, "config.json", "model.safetensors"))))
