"""The recipe's algorithm section: every setting of the loss and the optimiser, checked where it is written."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from sfhpc.config import load_recipe
from sfhpc.config.recipe import AlgorithmSpec, DistillSpec, FilterGroupsSpec, OverlongSpec
from sfhpc.errors import ConfigError
from tests.config.test_config_files import GOOD_RECIPE

EVERY_KEY = """\
algorithm:
  name: grpo
  group_size: 4
  learning_rate: 2.0e-5
  warmup_steps: 5
  lr_schedule: linear
  lr_decay_steps: 100
  min_learning_rate: 1.0e-6
  clip_ratio: 0.1
  clip_ratio_high: 0.28
  ratio_cap: 5
  kl_coef: 0.05
  loss_aggregation: sequence-mean
  loss_norm_tokens: 256
  normalize_std: false
  credit: turn
  turn_reward_weight: 0.5
  max_grad_norm: 0.5
  weight_decay: 0.01
  adam_beta1: 0.85
  adam_beta2: 0.95
  adam_eps: 1.0e-6
  advantage_eps: 1.0e-4
  temperature: 0.7
  overlong: {buffer_tokens: 4, penalty: 0.5, mask_truncated: true}
  filter_groups: {max_groups_per_step: 48}
  distill: {teacher: teacher-folder, weight: 0.5, task_reward: false}
"""
TEACHER_ROLE = "  teacher: {place_with: trainer}\n"  # continues GOOD_RECIPE's roles


def test_every_setting_is_a_recipe_key(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(GOOD_RECIPE + TEACHER_ROLE + EVERY_KEY)
    spec = load_recipe(path).algorithm
    assert spec == AlgorithmSpec(name="grpo", group_size=4, learning_rate=2e-5, warmup_steps=5, lr_schedule="linear",
                                 lr_decay_steps=100, min_learning_rate=1e-6, clip_ratio=0.1,
                                 clip_ratio_high=0.28, ratio_cap=5.0, kl_coef=0.05, loss_aggregation="sequence-mean",
                                 loss_norm_tokens=256, normalize_std=False, credit="turn", turn_reward_weight=0.5,
                                 max_grad_norm=0.5,
                                 weight_decay=0.01, adam_beta1=0.85, adam_beta2=0.95, adam_eps=1e-6, advantage_eps=1e-4,
                                 temperature=0.7,
                                 overlong=OverlongSpec(buffer_tokens=4, penalty=0.5, mask_truncated=True),
                                 filter_groups=FilterGroupsSpec(max_groups_per_step=48),
                                 distill=DistillSpec(teacher="teacher-folder", weight=0.5, task_reward=False))
    # The test names every field: a setting added later without a recipe key would show here.
    assert {f.name for f in dataclasses.fields(AlgorithmSpec)} == {
        line.split(":")[0].strip() for line in EVERY_KEY.splitlines()[1:]}


@pytest.mark.parametrize(("section", "fragments"), [
    ("{learning_rate: 0}", ["algorithm.learning_rate", "more than 0, found 0"]),
    ("{learning_rate: .nan}", ["algorithm.learning_rate", "found nan"]),
    ("{group_size: 1}", ["algorithm.group_size", "at least 2 for GRPO, found 1"]),
    ("{name: ppo, group_size: 0}", ["algorithm.group_size", "at least 1, found 0"]),
    ("{clip_ratio: 1.0}", ["algorithm.clip_ratio", "less than 1", "found 1.0"]),
    ("{clip_ratio_high: -0.1}", ["algorithm.clip_ratio_high", "0 or more", "found -0.1"]),
    ("{clip_ratio_high: 2.5}", ["algorithm.ratio_cap", "more than 1 + the upper clip range = 3.5", "found 3.0"]),
    ("{ratio_cap: 1.1}", ["algorithm.ratio_cap", "= 1.2", "found 1.1"]),
    ("{kl_coef: -1}", ["algorithm.kl_coef", "0 or more, found -1"]),
    ("{credit: turn, turn_reward_weight: -1}", ["algorithm.turn_reward_weight", "0 or more, found -1"]),
    ("{turn_reward_weight: 1}", ["algorithm.turn_reward_weight", "needs credit: turn", "found credit: episode"]),
    ("{max_grad_norm: 0}", ["algorithm.max_grad_norm", "more than 0"]),
    ("{weight_decay: -0.01}", ["algorithm.weight_decay", "0 or more"]),
    ("{adam_beta2: 1}", ["algorithm.adam_beta2", "less than 1, found 1"]),
    ("{adam_eps: 0}", ["algorithm.adam_eps", "more than 0"]),
    ("{advantage_eps: 0}", ["algorithm.advantage_eps", "more than 0"]),
    ("{temperature: 0}", ["algorithm.temperature", "more than 0 and at most 2", "greedy"]),
    ("{temperature: 2.5}", ["algorithm.temperature", "found 2.5"]),
    ("{adam_betas: [0.9, 0.99]}", ["algorithm.adam_betas", "unknown key"]),
])
def test_out_of_range_settings_name_the_key_and_line(tmp_path: Path, section: str, fragments: list[str]) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(GOOD_RECIPE + f"algorithm: {section}\n")
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    message = str(info.value)
    assert message.startswith(f"{path}:6: algorithm.") and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_the_defaults_are_in_range() -> None:
    assert AlgorithmSpec().problems() == []
    assert AlgorithmSpec(name="ppo", group_size=1).problems() == []  # PPO has no groups to compare


def test_the_learning_rate_decays_after_its_warm_up_to_the_floor(tmp_path: Path) -> None:
    linear = AlgorithmSpec(learning_rate=1e-3, warmup_steps=2, lr_schedule="linear", lr_decay_steps=4,
                           min_learning_rate=1e-4)
    assert [linear.learning_rate_at(s) for s in range(8)] == pytest.approx(
        [5e-4, 1e-3, 1e-3, 7.75e-4, 5.5e-4, 3.25e-4, 1e-4, 1e-4])
    cosine = AlgorithmSpec(learning_rate=1e-3, lr_schedule="cosine", lr_decay_steps=4)
    assert [cosine.learning_rate_at(s) for s in range(6)] == pytest.approx(
        [1e-3, 8.535534e-4, 5e-4, 1.464466e-4, 0.0, 0.0])
    # In a recipe, a decay without its length runs over the rest of the run.
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: lr\ntask: {name: next-letter}\nbudgets: {steps: 50}\n"
                      "algorithm: {warmup_steps: 10, lr_schedule: cosine, min_learning_rate: 1.0e-5}\n"
                      "roles:\n  controller: {place_with: trainer}\n  trainer: {tags: [train]}\n"
                      "  rollout: {colocate_with: trainer}\n")
    loaded = load_recipe(recipe).algorithm
    assert loaded.lr_decay_steps == 40 and loaded.learning_rate_at(49) == pytest.approx(
        1e-5 + (1e-4 - 1e-5) * 0.5 * (1 + math.cos(math.pi * 39 / 40)))
    bad = tmp_path / "bad.yaml"
    bad.write_text(recipe.read_text().replace("min_learning_rate: 1.0e-5", "min_learning_rate: 1.0"))
    with pytest.raises(Exception, match="min_learning_rate: must be from 0 to learning_rate"):
        load_recipe(bad)


def test_the_algorithm_page_lists_every_setting_with_its_default() -> None:
    import yaml

    from tests.conftest import ROOT

    page = (ROOT / "docs" / "algorithm.md").read_text()
    block = page.split("```yaml\n", 1)[1].split("```", 1)[0]
    listed = yaml.safe_load(block)["algorithm"]
    defaults = {f.name: getattr(AlgorithmSpec(), f.name) for f in dataclasses.fields(AlgorithmSpec)}
    assert listed == defaults


def test_dr_grpo_divides_by_the_reply_budget_unless_told() -> None:
    from sfhpc.config import load_recipe
    from tests.conftest import RECIPES

    recipe = load_recipe(RECIPES / "demo.yaml", {"algorithm.loss_aggregation": "token-sum-norm",
                                                 "algorithm.normalize_std": False})
    assert recipe.algorithm.loss_norm_tokens == recipe.budgets.max_new_tokens
    assert not recipe.algorithm.normalize_std
    told = load_recipe(RECIPES / "demo.yaml", {"algorithm.loss_aggregation": "token-sum-norm",
                                               "algorithm.loss_norm_tokens": 512})
    assert told.algorithm.loss_norm_tokens == 512


@pytest.mark.parametrize(("roles", "algorithm", "key", "fragment"), [
    ("", "{distill: {teacher: t}}", "algorithm.distill", "needs a teacher role to score the policy's tokens"),
    (TEACHER_ROLE, "{}", "roles.teacher", "scores tokens for algorithm.distill, which the recipe lacks"),
    ("  teacher: {colocate_with: trainer}\n", "{distill: {teacher: t}}", "roles.teacher",
     "runs on ranks of its own"),
    (TEACHER_ROLE, "{distill: {teacher: t, weight: 0}}", "algorithm.distill.weight", "more than 0, found 0"),
    (TEACHER_ROLE, "{distill: {weight: 1}}", "algorithm.distill", "missing required key 'teacher'"),
])
def test_distillation_needs_its_teacher_role_and_a_teacher(tmp_path: Path, roles: str, algorithm: str, key: str,
                                                            fragment: str) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(GOOD_RECIPE + roles + f"algorithm: {algorithm}\n")
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    message = str(info.value)
    assert f" {key}: " in message and fragment in message and "\n" not in message, message


def test_delta_updates_are_refused_with_lora_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(GOOD_RECIPE + "model: {lora: {rank: 8}}\nengine: {weight_delta: true}\n")
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    message = str(info.value)
    assert " engine.weight_delta: is refused with model.lora: a LoRA version is the adapter alone" in message
    assert "\n" not in message
    path.write_text(GOOD_RECIPE + "engine: {weight_delta: true}\n")
    assert load_recipe(path).engine.weight_delta
