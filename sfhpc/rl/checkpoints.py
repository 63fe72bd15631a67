"""A run's checkpoints: one folder per checkpoint, complete only once its manifest is in place.

    checkpoints/step-000042/        trainer.pt (and any parts a backend writes beside it),
                                    controller.json (step, version, sampler, the episodes out),
                                    MANIFEST.json (written last: every file's size and sha256)

A checkpoint is built in a hidden temporary folder (``.step-000042.XXXX.partial``), its manifest is
written last (to a temporary file, fsynced, renamed), and the folder is renamed into place: a reader
sees a whole checkpoint or none. An existing checkpoint is never overwritten: a second checkpoint of the
same step (a run preempted again before its next step) becomes ``step-000042.1``. `latest` checks
manifests and checksums from the newest down, names every damaged checkpoint, and returns the newest
sound one. Only `prune` deletes, and only what ``training.keep_checkpoints`` lets go: complete checkpoints
of this run (its identity in their manifest) older than the newest N complete ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sfhpc.errors import SfhpcError
from sfhpc.rundir import RunPaths

MANIFEST = "MANIFEST.json"
TRAINER_FILE = "trainer.pt"
CONTROLLER_FILE = "controller.json"
FORMAT = "sfhpc-run-checkpoint"
FORMAT_VERSION = 1
_NAME = re.compile(r"^step-(\d{6,})(?:\.(\d+))?$")


class CheckpointCorrupt(SfhpcError):
    """A checkpoint folder that cannot be trusted (no manifest, a missing file, a checksum mismatch)."""


class CheckpointMismatch(SfhpcError):
    """A sound checkpoint written by another recipe or model than the one resuming from it."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    version: int
    manifest: dict[str, Any]

    @property
    def trainer_file(self) -> Path:
        return self.path / TRAINER_FILE

    @property
    def controller_file(self) -> Path:
        return self.path / CONTROLLER_FILE

    @property
    def identity(self) -> dict[str, Any]:
        return self.manifest.get("identity", {})


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _order(path: Path) -> tuple[int, int] | None:
    match = _NAME.match(path.name)
    return (int(match.group(1)), int(match.group(2) or 0)) if match else None


class RunCheckpoints:
    """The ``checkpoints/`` folder of one run."""

    def __init__(self, run_dir: Path) -> None:
        self.root = RunPaths(Path(run_dir)).checkpoints

    def begin(self, step: int) -> Path:
        """A fresh temporary folder for the checkpoint of `step` (the trainers write into it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".step-{step:06d}.", suffix=".partial", dir=self.root))

    def commit(self, partial: Path, *, step: int, version: int, identity: dict[str, Any], reason: str,
               extra: dict[str, Any] | None = None) -> CheckpointInfo:
        """Checksum every file of `partial`, write the manifest last and move the folder into place."""
        files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                 for p in sorted(partial.iterdir()) if p.is_file() and p.name != MANIFEST}
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step, "version": version,
                    "reason": reason, "written_at": time.time(), "identity": identity, "files": files,
                    **(extra or {})}
        temporary = partial / f".{MANIFEST}.tmp"
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        temporary.replace(partial / MANIFEST)
        _fsync_dir(partial)
        for sequence in range(10_000):
            final = self.root / (f"step-{step:06d}" + (f".{sequence}" if sequence else ""))
            try:
                # rename(2) onto an existing non-empty folder fails: an earlier checkpoint is never replaced.
                if final.exists():
                    continue
                partial.rename(final)
                break
            except OSError:
                if final.exists():
                    continue
                raise
        else:  # pragma: no cover - ten thousand checkpoints of one step
            raise SfhpcError(f"{self.root}: no free name for another checkpoint of step {step}")
        _fsync_dir(self.root)
        return CheckpointInfo(final, step, version, manifest)

    def folders(self) -> list[Path]:
        """Checkpoint folders (complete or not), oldest first."""
        if not self.root.is_dir():
            return []
        found = [(order, p) for p in self.root.iterdir() if p.is_dir() and (order := _order(p)) is not None]
        return [p for _, p in sorted(found)]

    def prune(self, keep: int, identity: dict[str, Any]) -> list[Path]:
        """Remove the complete checkpoints of this run (`identity` in their manifest) beyond the newest `keep`
        of them; returns what was removed, oldest first. The newest complete one always stays, and nothing
        else is touched: folders without a manifest (being written, or damaged: `latest` names those) and
        checkpoints another recipe or model wrote. Checksums are not read (a large checkpoint's sha256 takes
        minutes): deleting needs only to know whose checkpoint it is."""
        if keep < 1:
            raise ValueError(f"keep must be at least 1, found {keep}")
        mine = []
        for path in self.folders():
            try:
                manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(manifest, dict) and manifest.get("format") == FORMAT and manifest.get("identity") == identity:
                mine.append(path)
        removed = mine[:-keep]
        for path in removed:
            # Renamed away first, so an interrupted removal never leaves a half-deleted step-NNNNNN folder.
            doomed = path.with_name(f".{path.name}.removing")
            path.rename(doomed)
            shutil.rmtree(doomed)
        if removed:
            _fsync_dir(self.root)
        return removed

    def latest(self, warn: Callable[[str], None] | None = None) -> CheckpointInfo | None:
        """The newest sound checkpoint; each damaged one newer than it is named through `warn`."""
        for path in reversed(self.folders()):
            try:
                return verify(path)
            except CheckpointCorrupt as exc:
                if warn is not None:
                    warn(f"{exc}; using an earlier checkpoint")
        return None


def verify(path: Path) -> CheckpointInfo:
    """Read and check one checkpoint folder; CheckpointCorrupt says what is wrong."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointCorrupt(f"checkpoint {path} has no {MANIFEST} (written only partly)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointCorrupt(f"checkpoint {path}: unreadable {MANIFEST} ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointCorrupt(f"checkpoint {path}: {MANIFEST} is not an sfhpc run checkpoint manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointCorrupt(f"checkpoint {path}: format {manifest.get('format_version')} is not the "
                                f"supported {FORMAT_VERSION}")
    for name, expected in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            raise CheckpointCorrupt(f"checkpoint {path}: {name} is missing")
        if file.stat().st_size != expected["bytes"]:
            raise CheckpointCorrupt(f"checkpoint {path}: {name} has {file.stat().st_size} bytes, the manifest "
                                    f"says {expected['bytes']} (truncated)")
        if _sha256(file) != expected["sha256"]:
            raise CheckpointCorrupt(f"checkpoint {path}: {name} does not match its checksum")
    return CheckpointInfo(path, int(manifest["step"]), int(manifest["version"]), manifest)


def check_identity(info: CheckpointInfo, identity: dict[str, Any]) -> None:
    """Refuse to resume a run from a checkpoint of another recipe or model (names what differs)."""
    saved = info.identity
    differ = sorted(k for k in set(saved) | set(identity) if saved.get(k) != identity.get(k))
    if differ:
        details = "; ".join(f"{k}: checkpoint {saved.get(k)!r}, now {identity.get(k)!r}" for k in differ)
        raise CheckpointMismatch(f"checkpoint {info.path} was written by another recipe or model ({details}); "
                                 "resume with the recipe and model that started the run")


def run_identity(recipe: Any, model_dir: Path) -> dict[str, Any]:
    """What a checkpoint must agree on with the run that resumes from it: the recipe's name, the model
    (its config.json, byte for byte) and the shape of training. Budgets may change (a run may be extended)."""
    config = Path(model_dir) / "config.json"
    return {
        "recipe": recipe.name,
        "model_config_sha256": _sha256(config) if config.is_file() else None,
        "algorithm": recipe.algorithm.name,
        "group_size": recipe.algorithm.group_size,
        "backend": recipe.training.backend,
        "tensor_parallel": recipe.training.tensor_parallel,
        "pipeline_parallel": recipe.training.pipeline_parallel,
    }
