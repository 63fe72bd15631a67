"""Roles -> tags -> pools -> het components, for colocated and disaggregated recipes, and the errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sfhpc.config import load_cluster_map, load_recipe
from sfhpc.config.recipe import Recipe
from sfhpc.errors import ResolveError
from sfhpc.plan.local_map import local_cluster_map
from sfhpc.plan.resolve import resolve
from tests.conftest import RECIPES, assert_one_line_error, run_sfhpc

DEV = load_cluster_map(RECIPES / "cluster-dev.yaml")
SITE = load_cluster_map(RECIPES / "cluster-h100-l40s.yaml")


def with_role(recipe: Recipe, name: str, **changes: object) -> Recipe:
    roles = tuple(dataclasses.replace(r, **changes) if r.name == name else r for r in recipe.roles)  # type: ignore[arg-type]
    return dataclasses.replace(recipe, roles=roles)


def test_disaggregated_recipe_gives_one_component_per_role_with_nodes() -> None:
    plan = resolve(load_recipe(RECIPES / "report.yaml"), DEV)
    assert [(c.pool.partition, c.pool.constraint, c.nodes, c.num_tasks) for c in plan.components] == [
        ("train", "h100", 1, 2), ("rollout", "l40s", 2, 2)]
    ranks = plan.ranks()
    assert [(s.rank, s.component, s.roles) for s in ranks] == [
        (0, 0, ("controller",)), (1, 0, ("trainer",)), (2, 1, ("rollout",)), (3, 1, ("rollout",))]
    assert ranks[2].tags == ("rollout", "reward", "cpu")


def test_colocated_recipe_gives_one_component() -> None:
    plan = resolve(load_recipe(RECIPES / "report-colocated.yaml"), DEV)
    assert len(plan.components) == 1
    only = plan.components[0]
    assert (only.pool.name, only.nodes, only.num_tasks) == ("h100", 2, 3)
    assert only.task_roles == (("controller",), ("trainer", "rollout"), ("trainer", "rollout"))
    assert only.tasks_per_node is None  # the controller makes the first node hold one more task


def test_rollout_prefers_nodes_the_trainer_does_not_need() -> None:
    # Both pools carry `rollout`; the trainer nodes (h100) must be kept for the trainer.
    recipe = load_recipe(RECIPES / "report.yaml")
    plan = resolve(with_role(recipe, "rollout", nodes=1), DEV)
    assert [c.pool.name for c in plan.components] == ["h100", "l40s"]
    # A rollout role that also asks for `train` can only go to h100, next to the trainer's node.
    plan = resolve(with_role(recipe, "rollout", nodes=1, tags=("rollout", "train")), DEV)
    assert [c.pool.name for c in plan.components] == ["h100", "h100"]


def test_gpu_site_plan_places_controller_beside_trainers() -> None:
    plan = resolve(load_recipe(RECIPES / "h100-l40s-grpo.yaml"), SITE)
    trainer, rollout = plan.components
    assert (trainer.pool.name, trainer.nodes, trainer.num_tasks, trainer.gpus_per_node) == ("h100", 4, 33, 8)
    assert (rollout.pool.name, rollout.nodes, rollout.num_tasks, rollout.gpus_per_node) == ("l40s", 8, 32, 4)
    assert trainer.cpus_per_task == 10 and plan.world_size == 65


def test_tag_that_no_pool_offers() -> None:
    recipe = with_role(load_recipe(RECIPES / "report.yaml"), "rollout", tags=("rollout", "tpu"))
    with pytest.raises(ResolveError, match=r"role 'rollout' needs nodes tagged \[rollout, tpu\], but no pool"):
        resolve(recipe, DEV)


def test_more_nodes_than_the_pools_have() -> None:
    recipe = with_role(load_recipe(RECIPES / "report.yaml"), "rollout", nodes=3)
    with pytest.raises(ResolveError) as info:
        resolve(recipe, DEV)
    assert "needs 3 node(s) tagged [rollout]" in str(info.value)
    assert "pool 'l40s' (partition rollout) has 2 free of 2" in str(info.value)
    assert "pool 'h100' (partition train) has 1 free of 2" in str(info.value)  # one went to the trainer


def test_gpu_recipe_does_not_fit_cpu_cluster() -> None:
    with pytest.raises(ResolveError, match="needs 8 GPU\\(s\\) per node, pool 'h100' has 0"):
        resolve(load_recipe(RECIPES / "h100-l40s-grpo.yaml"), DEV)


def test_local_map_fits_every_recipe() -> None:
    for name in ("report.yaml", "report-colocated.yaml"):
        recipe = load_recipe(RECIPES / name)
        plan = resolve(recipe, local_cluster_map(recipe))
        assert plan.world_size == resolve(recipe, DEV).world_size
        assert plan.tasks_per_component == resolve(recipe, DEV).tasks_per_component


def test_cli_resolution_errors(tmp_path: Path) -> None:
    recipe = tmp_path / "big.yaml"
    recipe.write_text((RECIPES / "report.yaml").read_text().replace("nodes: 2", "nodes: 5"))
    assert_one_line_error(run_sfhpc("plan", str(recipe)), "needs 5 node(s)", "lower 'nodes'")
    assert_one_line_error(run_sfhpc("render", str(RECIPES / "h100-l40s-grpo.yaml")), "GPU")



AGENT_HOSTS = RECIPES / "guess-number-agent-hosts.yaml"


def test_an_agents_role_is_the_last_component_and_outside_the_mpi_world() -> None:
    plan = resolve(load_recipe(AGENT_HOSTS), DEV)
    assert [(c.pool.name, c.roles, c.num_tasks, c.in_world) for c in plan.components] == [
        ("h100", ("controller", "trainer"), 2, True), ("l40s", ("rollout",), 1, True), ("l40s", ("agents",), 2, False)]
    assert plan.world_size == 3 and plan.tasks_per_component == (2, 1)
    assert [s.roles for s in plan.ranks()] == [("controller",), ("trainer",), ("rollout",)]
    assert plan.agent_hosts is plan.components[2]
    assert "(agent hosts, outside the MPI world)" in plan.describe().splitlines()[-1]
    # Locally (sfhpc run) too, with the ranks' world unchanged.
    local = resolve(load_recipe(AGENT_HOSTS), local_cluster_map(load_recipe(AGENT_HOSTS)))
    assert local.tasks_per_component == (2, 1) and local.agent_hosts is not None and local.agent_hosts.num_tasks == 2


@pytest.mark.parametrize(("change", "message"), [
    ("  agents:     {tags: [cpu], nodes: 1, tasks_per_node: 2}", None),
    ("  agents:     {tags: [bigmem], nodes: 1}", "role 'agents' needs nodes tagged [bigmem], but no pool"),
    ("  agents:     {place_with: trainer, tasks: 2}", "runs on nodes of its own: give it tags and nodes"),
    ("  agents:     {tags: [cpu], gpus_per_task: 1}", "agent hosts use no GPU"),
])
def test_agents_role_errors_are_one_line_before_any_job(tmp_path: Path, change: str, message: str | None) -> None:
    recipe = tmp_path / "recipe.yaml"
    text = AGENT_HOSTS.read_text().replace("  agents:     {tags: [cpu], nodes: 1, tasks_per_node: 2}", change)
    recipe.write_text(text.replace("agents/guess_number.py", str(RECIPES / "agents" / "guess_number.py")))
    done = run_sfhpc("plan", str(recipe))
    if message is None:
        assert done.returncode == 0 and "[agents]" in done.stdout, done.stderr
    else:
        assert_one_line_error(done, message)


def test_an_agents_role_needs_an_agent_program(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    rollout = "  rollout:    {tags: [rollout], nodes: 2, tasks_per_node: 1}\n"
    recipe.write_text((RECIPES / "report.yaml").read_text().replace(rollout, rollout + "  agents: {tags: [cpu]}\n"))
    assert_one_line_error(run_sfhpc("plan", str(recipe)), "the recipe names none: add agent:")
