"""Atomic checkpoint files: a reader sees the previous checkpoint or the new one, never half of one.

The state is written to a temporary file in the same folder, flushed to disk, then renamed over the
target with `os.replace` (atomic on POSIX within one file system), and the folder entry is synced so the
rename itself survives a crash. A preempted job killed mid-write leaves only a stray ``.tmp`` file.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sfhpc.trainer.errors import CheckpointError

FORMAT = "sfhpc-trainer-checkpoint"
# 2: tensors and plain data only, read with torch.load(weights_only=True), so that a run folder another user
# can write cannot make a resume run code (1 held numpy's RNG state as a pickled array).
FORMAT_VERSION = 2


def save_atomic(state: dict[str, Any], path: str | Path) -> Path:
    """Write `state` with torch.save to `path` atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format": FORMAT, "format_version": FORMAT_VERSION, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, (OSError, RuntimeError)):  # torch's writer reports a failed write as RuntimeError
            free = shutil.disk_usage(path.parent).free
            full = (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or free < 2**20
            why = "No space left on device" if full else _first_line(exc)
            raise CheckpointError(f"{path}: cannot write the checkpoint ({why}; {free / 2**20:.1f} MiB free on "
                                  "its file system); the checkpoints written before stay as they were") from None
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def load(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by `save_atomic`; raises CheckpointError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        # Tensors and plain data only: unpickling anything else would run whatever code the file names.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same to the user
        raise CheckpointError(f"{path}: cannot read checkpoint as tensors and plain data "
                              f"({exc.__class__.__name__}: {_first_line(exc)}); a checkpoint of format 1, written "
                              "before checkpoints held nothing else, cannot be resumed by this version") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an sfhpc trainer checkpoint")
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {state.get('format_version')} is not the supported "
                              f"{FORMAT_VERSION}")
    return state


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def rng_state() -> dict[str, Any]:
    """Every random generator a training step may draw from, as tensors and plain values (numpy's key array
    becomes a tensor: ``weights_only`` loading refuses numpy objects)."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": [name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss),
                      float(cached)]}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))


def restore(path: str | Path, model_dir: str | Path, state: dict[str, Any], load_weights: Callable[[], None]) -> None:
    """Run `load_weights` (the backend's model + optimizer restore) and then restore the RNG streams;
    a checkpoint that does not fit the model becomes one CheckpointError naming both."""
    try:
        load_weights()
    except (RuntimeError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise CheckpointError(f"{path}: does not fit the model in {model_dir} ({first})") from None
    set_rng_state(state["rng"])
