"""Run checkpoints: whole or absent, never overwritten, damaged ones named and skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sfhpc.rl.checkpoints import (
    MANIFEST,
    CheckpointCorrupt,
    CheckpointMismatch,
    RunCheckpoints,
    check_identity,
    verify,
)

IDENTITY = {"recipe": "r", "model_config_sha256": "abc"}


def write(checkpoints: RunCheckpoints, step: int, payload: bytes = b"weights") -> Path:
    partial = checkpoints.begin(step)
    (partial / "trainer.pt").write_bytes(payload)
    (partial / "controller.json").write_bytes(b"state")
    return checkpoints.commit(partial, step=step, version=step, identity=IDENTITY, reason="test").path


def test_a_checkpoint_is_a_folder_with_its_manifest_written_last(tmp_path: Path) -> None:
    checkpoints = RunCheckpoints(tmp_path)
    path = write(checkpoints, 3)
    assert path.name == "step-000003"
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["step"] == 3 and set(manifest["files"]) == {"trainer.pt", "controller.json"}
    assert manifest["files"]["trainer.pt"]["bytes"] == len(b"weights")
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000003"]  # no temporary left
    assert checkpoints.latest().path == path


def test_an_earlier_checkpoint_of_the_same_step_is_never_overwritten(tmp_path: Path) -> None:
    checkpoints = RunCheckpoints(tmp_path)
    first = write(checkpoints, 5, b"first")
    second = write(checkpoints, 5, b"second")
    assert (first.name, second.name) == ("step-000005", "step-000005.1")
    assert (first / "trainer.pt").read_bytes() == b"first"
    assert checkpoints.latest().path == second
    assert [p.name for p in checkpoints.folders()] == ["step-000005", "step-000005.1"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "no-manifest", "missing-file"])
def test_a_damaged_latest_checkpoint_is_named_and_the_previous_one_used(tmp_path: Path, damage: str) -> None:
    checkpoints = RunCheckpoints(tmp_path)
    good = write(checkpoints, 2)
    bad = write(checkpoints, 4, b"0123456789")
    if damage == "truncate":
        (bad / "trainer.pt").write_bytes(b"01234")
    elif damage == "flip":
        (bad / "trainer.pt").write_bytes(b"0123456780")
    elif damage == "no-manifest":
        (bad / MANIFEST).unlink()
    else:
        (bad / "controller.json").unlink()
    warnings: list[str] = []
    assert checkpoints.latest(warn=warnings.append).path == good
    assert len(warnings) == 1 and str(bad) in warnings[0]
    with pytest.raises(CheckpointCorrupt):
        verify(bad)
    assert bad.exists()  # named, never deleted


def test_no_sound_checkpoint_gives_none(tmp_path: Path) -> None:
    checkpoints = RunCheckpoints(tmp_path)
    assert checkpoints.latest() is None
    bad = write(checkpoints, 1)
    (bad / MANIFEST).write_text("{not json")
    assert checkpoints.latest(warn=lambda _: None) is None


def test_a_checkpoint_of_another_recipe_or_model_is_refused_naming_the_difference(tmp_path: Path) -> None:
    info = verify(write(RunCheckpoints(tmp_path), 1))
    check_identity(info, dict(IDENTITY))
    with pytest.raises(CheckpointMismatch, match="model_config_sha256"):
        check_identity(info, {**IDENTITY, "model_config_sha256": "other"})


def test_prune_keeps_the_newest_of_this_run_and_touches_nothing_else(tmp_path: Path) -> None:
    checkpoints = RunCheckpoints(tmp_path)
    for step in (2, 4, 6):
        write(checkpoints, step)
    other = checkpoints.begin(5)  # another recipe's checkpoint in the same folder
    (other / "trainer.pt").write_bytes(b"theirs")
    checkpoints.commit(other, step=5, version=5, identity={"recipe": "other"}, reason="test")
    damaged = tmp_path / "checkpoints" / "step-000003"  # no manifest: being written, or damaged
    damaged.mkdir()
    write(checkpoints, 8)
    removed = checkpoints.prune(2, IDENTITY)
    assert [p.name for p in removed] == ["step-000002", "step-000004"]
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["step-000003", "step-000005", "step-000006", "step-000008"]  # nothing hidden left behind
    assert checkpoints.latest().path.name == "step-000008"
    assert checkpoints.prune(1, IDENTITY)[0].name == "step-000006"
    assert checkpoints.prune(1, IDENTITY) == []  # the newest always stays
    with pytest.raises(ValueError):
        checkpoints.prune(0, IDENTITY)
