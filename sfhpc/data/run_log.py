"""The run folder's JSON-lines logs (``metrics.jsonl``, ``events.jsonl``): the one reader of them.

The controller appends one JSON object per line. A crash while it writes (a full disk, a kill) can leave
the last line cut: that line is left out with a warning naming the file and the line, never fatal, so a
resume and the analysis still read the run. A bad line anywhere else is damage nobody explains, and an
error naming the file and the line.

Two ways to read:

- `read_log`, for anyone (the analysis, the benchmarks; a run that is still writing may be read): the cut
  line is left out of what it returns, the file is not touched.
- `repair_log`, for the controller when it opens a run folder again, before it appends: the cut text is
  appended to ``<name>.damaged`` beside the log (nothing written is lost) and cut from the log, so that
  the next line starts on a line of its own instead of being glued to the cut one. The log is truncated
  in place rather than rewritten: that needs no free space, and the disk may still be full.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sfhpc.errors import SfhpcError
from sfhpc.rundir import RunPaths

Warn = Callable[[str], None]
_warned: set[tuple[str, int, int]] = set()  # (file, line, size): a reader that polls warns once per cut


def read_log(path: Path, *, warn: Warn | None = None) -> list[dict[str, Any]]:
    """The objects of the log at `path`, in order ([] without the file); a cut last line is left out with a
    warning (`warn`, else a ``sfhpc: warning:`` line on stderr). Raises `SfhpcError` for a bad line that is
    not the last."""
    rows, cut = _parse(path)
    if cut is not None:
        line, _, size = cut
        if (str(path), line, size) not in _warned:
            _warned.add((str(path), line, size))
            (warn or _stderr)(f"{path}: line {line} is cut (a crash while it was written, or the run is "
                              f"writing it now); left out")
    return rows


def last_event(run_dir: Path) -> dict[str, Any] | None:
    """The last whole event of a run's event log (None when it has none)."""
    events = read_log(RunPaths(run_dir).events)
    return events[-1] if events else None


def is_training_row(row: Mapping[str, Any]) -> bool:
    """Whether a ``metrics.jsonl`` row is a training step's; the row of step 0 holds only the evaluation before
    training (`sfhpc.rl.evaluation`), the one row without the step's training figures."""
    return not (is_evaluation_row(row) and "reward_mean" not in row)


def is_evaluation_row(row: Mapping[str, Any]) -> bool:
    """Whether a ``metrics.jsonl`` row holds an evaluation's scores (``eval_`` keys)."""
    return "eval_pass_at_1" in row


def repair_log(path: Path, *, warn: Warn | None = None) -> list[dict[str, Any]]:
    """`read_log`, and a cut last line moved from the log to ``<name>.damaged`` (with a warning), so that
    lines appended later stand on their own. Only for the log's writer, while nothing else writes it."""
    rows, cut = _parse(path)
    try:
        if cut is None:
            _terminate(path)
            return rows
        line, start, size = cut
        damaged = RunPaths.damaged(path)
        with path.open("rb") as f:
            f.seek(start)
            text = f.read()
        with damaged.open("ab") as f:  # first: the cut text is kept before the log loses it
            f.write(text.rstrip(b"\n") + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.truncate(path, start)
    except OSError as exc:
        raise SfhpcError(f"{path}: cannot repair the log's cut last line: {exc.strerror}; free some space "
                         f"and start again") from exc
    (warn or _stderr)(f"{path}: line {line} was cut (a crash while it was written); its {size - start} bytes "
                      f"are set aside in {damaged.name}, and the log goes on from line {line}")
    return rows


def _terminate(path: Path) -> None:
    """A whole last line whose newline was never written gets it, so that the next line is not glued on."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            f.write(b"\n")


def _parse(path: Path) -> tuple[list[dict[str, Any]], tuple[int, int, int] | None]:
    """The objects of the log, and (line number, byte offset, file size) of a cut last line (else None)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], None
    rows: list[dict[str, Any]] = []
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # the newline that ends the last line
    offset = 0
    for number, raw in enumerate(lines, start=1):
        start, offset = offset, offset + len(raw) + 1
        if not raw.strip():
            continue
        row = _object(raw)
        if row is not None:
            rows.append(row)
        elif number == len(lines):
            return rows, (number, start, len(data))
        else:
            raise SfhpcError(f"{path}: line {number} is not a JSON object; the file is damaged (only a cut last "
                             f"line, as a crash leaves it, is set aside)")
    return rows, None


def _object(raw: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _stderr(line: str) -> None:
    print(f"sfhpc: warning: {line}", file=sys.stderr, flush=True)
