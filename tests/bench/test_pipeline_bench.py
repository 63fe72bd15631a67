"""The pipeline benchmark's own logic: the recipes it derives per mode and the figures it computes.

(Running it is `make bench`: two real runs with vLLM engines, minutes; the RL runs it is made of are
tested in tests/rl.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sfhpc.bench.pipeline import recipe_for_mode, summarize
from sfhpc.config import load_recipe
from sfhpc.errors import SfhpcError
from sfhpc.launch.local import local_cluster_map
from sfhpc.launch.resolve import resolve
from tests.conftest import ROOT, assert_one_line_error, run_sfhpc


def _resolved(data: dict, tmp_path: Path):  # type: ignore[no-untyped-def]
    path = tmp_path / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    recipe = load_recipe(str(path))
    return recipe, resolve(recipe, local_cluster_map(recipe))


def test_the_demo_recipe_becomes_a_short_async_run_and_a_colocated_sync_run(tmp_path: Path) -> None:
    demo = yaml.safe_load((ROOT / "recipes" / "demo.yaml").read_text())
    async_recipe, async_plan = _resolved(recipe_for_mode(demo, "async", 7, tmp_path / "out"), tmp_path)
    sync_recipe, sync_plan = _resolved(recipe_for_mode(demo, "sync", 7, tmp_path / "out"), tmp_path)
    for recipe, mode in ((async_recipe, "async"), (sync_recipe, "sync")):
        assert recipe.pipeline.mode == mode and recipe.budgets.steps == 7 and recipe.budgets.wall_minutes is None
        assert recipe.name == f"demo-{mode}" and recipe.output_dir == str(tmp_path / "out")
        assert recipe.algorithm == load_recipe(str(ROOT / "recipes" / "demo.yaml")).algorithm  # same learning
    # async keeps rollout on ranks of its own; sync runs it on the trainer's ranks.
    assert [sorted(c.roles) for c in async_plan.components] == [["controller", "trainer"], ["rollout"]]
    assert [sorted(c.roles) for c in sync_plan.components] == [["controller", "rollout", "trainer"]]
    assert demo == yaml.safe_load((ROOT / "recipes" / "demo.yaml").read_text())  # the loaded data is left as it was
    colocated = recipe_for_mode(demo, "sync", 3, tmp_path)
    with pytest.raises(SfhpcError, match="disaggregated"):
        recipe_for_mode(colocated, "async", 3, tmp_path)


def test_throughput_and_the_split_of_step_time_leave_the_first_step_out() -> None:
    def row(step: int, step_s: float, train_s: float, sync_s: float, reward: float) -> dict:
        return {"step": step, "step_s": step_s, "train_s": train_s, "sync_s": sync_s, "trained_tokens": 1000,
                "generated_tokens": 200, "reward_mean": reward, "max_staleness": step % 2}

    rows = [row(1, 30.0, 1.0, 1.0, 0.0), row(2, 2.0, 1.0, 0.5, 0.2), row(3, 2.0, 1.0, 0.1, 0.4)]
    got = summarize(rows)
    assert got["steps"] == 2 and got["step_seconds"] == 4.0
    assert got["trained_tokens_per_s"] == 500.0 and got["generated_tokens_per_s"] == 100.0
    assert got["train_share"] == 0.5 and got["sync_share"] == pytest.approx(0.15)
    assert got["wait_share"] == pytest.approx(0.35)
    assert (got["reward_first"], got["reward_last"], got["max_staleness"]) == (0.0, 0.4, 1)


def test_bad_options_get_one_line() -> None:
    assert_one_line_error(run_sfhpc("bench", "pipeline", "--modes", "seamless"), "--modes", "seamless")
    assert_one_line_error(run_sfhpc("bench", "pipeline", "--recipe", "nope.yaml"), "nope.yaml")
