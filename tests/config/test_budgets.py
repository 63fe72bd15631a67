"""The budgets that make a faulty run stop: episode timeout, failed fraction, stall and heartbeat timeouts."""

from __future__ import annotations

from pathlib import Path

import pytest

from sfhpc.config import load_recipe
from sfhpc.errors import ConfigError
from tests.config.test_config_files import GOOD_RECIPE


def test_defaults_give_up_after_ten_minutes_and_at_half_failed(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(GOOD_RECIPE + "budgets: {episode_timeout_s: 30, max_failed_fraction: 1}\n")
    budgets = load_recipe(path).budgets
    assert (budgets.episode_timeout_s, budgets.max_failed_fraction, budgets.stall_timeout_s) == (30.0, 1.0, 600.0)
    path.write_text(GOOD_RECIPE)
    budgets = load_recipe(path).budgets
    assert (budgets.episode_timeout_s, budgets.max_failed_fraction) == (600.0, 0.5)
    assert budgets.heartbeat_timeout_s == 60.0  # a silent rank ends the run within a minute


@pytest.mark.parametrize(("budgets", "fragments"), [
    ("{episode_timeout_s: 0}", ["budgets.episode_timeout_s", "more than 0 seconds, found 0"]),
    ("{stall_timeout_s: -5}", ["budgets.stall_timeout_s", "more than 0 seconds, found -5"]),
    ("{stall_timeout_s: .nan}", ["budgets.stall_timeout_s", "found nan"]),
    ("{heartbeat_timeout_s: 1}", ["budgets.heartbeat_timeout_s", "at least 3 seconds", "found 1"]),
    ("{heartbeat_timeout_s: .nan}", ["budgets.heartbeat_timeout_s", "found nan"]),
    ("{max_failed_fraction: 1.5}", ["budgets.max_failed_fraction", "from 0", "to 1", "found 1.5"]),
    ("{max_failed_fraction: -0.1}", ["budgets.max_failed_fraction", "found -0.1"]),
])
def test_out_of_range_budgets_name_the_key(tmp_path: Path, budgets: str, fragments: list[str]) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(GOOD_RECIPE + f"budgets: {budgets}\n")
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
