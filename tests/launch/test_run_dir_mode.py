"""Run folders are their user's alone (0700, whatever the umask); a recipe's ``output_group`` shares them with
one group (2750, that group); a group that is not the user's is one line, with no folder left behind."""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path

import pytest

from sfhpc.config.recipe import load_recipe
from sfhpc.errors import ConfigError, SfhpcError
from sfhpc.rundir import make_run_dir, new_run_dir


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_run_folder_is_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o000)
    try:
        run = new_run_dir(tmp_path / "runs", "r")
        job = make_run_dir(tmp_path / "runs" / "r-job7")
    finally:
        os.umask(old)
    assert mode(run) == 0o700 and mode(job) == 0o700
    existing = tmp_path / "given"
    existing.mkdir(mode=0o755)
    os.chmod(existing, 0o755)
    assert mode(make_run_dir(existing)) == 0o755  # a folder the user made keeps its mode


def test_output_group_shares_the_folder_with_that_group(tmp_path: Path) -> None:
    group = grp.getgrgid(os.getgid()).gr_name  # a group of this user's
    run = new_run_dir(tmp_path / "runs", "r", group=group)
    assert mode(run) == 0o2750 and run.stat().st_gid == os.getgid()
    (run / "logs").mkdir()
    assert (run / "logs").stat().st_gid == os.getgid()


def test_a_group_that_does_not_exist_is_one_line_and_no_folder(tmp_path: Path) -> None:
    with pytest.raises(SfhpcError) as raised:
        new_run_dir(tmp_path / "runs", "r", group="no-such-group-sfhpc")
    assert "output_group 'no-such-group-sfhpc'" in str(raised.value) and "\n" not in str(raised.value)
    assert list((tmp_path / "runs").iterdir()) == []


def test_the_recipe_key_takes_a_group_name(tmp_path: Path) -> None:
    base = ("name: r\nroles:\n  controller: {tags: [cpu]}\n  trainer: {tags: [cpu]}\n  rollout: {tags: [cpu]}\n"
            "engine: {name: test}\n")
    good = tmp_path / "good.yaml"
    good.write_text(base + "output_group: rl-team\n")
    assert load_recipe(good).output_group == "rl-team"
    bad = tmp_path / "bad.yaml"
    bad.write_text(base + "output_group: 'rl team'\n")
    with pytest.raises(ConfigError, match="output_group"):
        load_recipe(bad)
