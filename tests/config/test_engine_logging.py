"""The recipe's engine knobs (what reaches vLLM: `tests/engine/test_vllm_engine.py`) and logging sections:
their defaults, and every bad value named by its key in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from sfhpc.config import load_recipe
from sfhpc.errors import ConfigError
from tests.config.test_config_files import GOOD_RECIPE


def test_defaults_leave_vllm_as_it_was_and_log_nowhere_else(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(GOOD_RECIPE)
    recipe = load_recipe(path)
    engine = recipe.engine
    knobs = (engine.tensor_parallel_size, engine.gpu_memory_utilization, engine.max_num_seqs, engine.enforce_eager)
    assert knobs == (1, 0.9, None, True)
    assert recipe.logging.wandb is None and recipe.logging.mlflow is None
    path.write_text(GOOD_RECIPE + "logging: {wandb: {project: p, mode: offline}, mlflow: {experiment: e}}\n")
    logging = load_recipe(path).logging
    assert logging.wandb is not None and (logging.wandb.project, logging.wandb.mode) == ("p", "offline")
    assert logging.mlflow is not None and logging.mlflow.experiment == "e"


@pytest.mark.parametrize(("extra", "fragments"), [
    ("engine: {max_num_seqs: 0}", ["engine.max_num_seqs", "at least 1"]),
    ("engine: {gpu_memory_utilization: 1.5}", ["engine.gpu_memory_utilization", "at most 1", "found 1.5"]),
    ("engine: {gpu_memory_utilization: .nan}", ["engine.gpu_memory_utilization", "found nan"]),
    ("engine: {tensor_parallel_size: 0}", ["engine.tensor_parallel_size", "at least 1"]),
    ("engine: {tensor_parallel_size: 2}", ["engine.tensor_parallel_size", "2 spans 2 GPUs, but each rollout rank has 0",
                                           "roles.rollout.gpus_per_task: 2"]),
    ("engine: {name: test, max_num_seqs: 4}", ["engine.max_num_seqs", "configures vLLM only"]),
    ("logging: {wandb: {mode: offline}}", ["logging.wandb.project", "required"]),
    ("logging: {wandb: {project: p, mode: shared}}", ["logging.wandb.mode"]),
    ("logging: {mlflow: {tracking_uri: file:///x}}", ["logging.mlflow.experiment", "required"]),
])
def test_bad_engine_and_logging_values_name_the_key(tmp_path: Path, extra: str, fragments: list[str]) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(GOOD_RECIPE + extra + "\n")
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    assert "\n" not in str(info.value)
