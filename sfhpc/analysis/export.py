"""Writing a data frame of a run to a file an analyst's tools read: Parquet (types kept) or JSON lines.

(CSV, today's columns and format, is `sfhpc.analysis.write_csv`.) A file is only ever created, never
overwritten; one that fails half-way is removed, so an error leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pandas as pd

from sfhpc.errors import SfhpcError

FORMATS = ("csv", "parquet", "jsonl")


def write_frame(df: pd.DataFrame, out: Path, fmt: str) -> int:
    """Create `out` holding `df` as ``parquet`` or ``jsonl``; returns the number of rows."""
    writers = {"parquet": _write_parquet, "jsonl": _write_jsonl}
    if fmt not in writers:
        raise SfhpcError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    try:
        handle = out.open("xb")  # "x": never overwrite a user's file, even one that appeared meanwhile
    except FileExistsError:
        raise SfhpcError(f"{out} exists; choose another --out (nothing was written)") from None
    try:
        with handle:
            writers[fmt](df, handle)
    except BaseException:
        with contextlib.suppress(OSError):
            out.unlink()  # ours: created above
        raise
    return len(df)


def frame_rows(df: pd.DataFrame) -> Iterator[dict[str, Any]]:
    """The rows of `df` as dicts, missing values (<NA>, NaN) as None (for `write_csv`)."""
    columns = list(df.columns)
    for values in df.itertuples(index=False, name=None):
        yield {k: _plain(v) for k, v in zip(columns, values)}


def _write_parquet(df: pd.DataFrame, handle: IO[bytes]) -> None:
    # pyarrow keeps the pandas types (nullable Int64/Float64, strings) in the file's metadata.
    df.to_parquet(handle, engine="pyarrow", index=False)


def _write_jsonl(df: pd.DataFrame, handle: IO[bytes]) -> None:
    # By hand rather than DataFrame.to_json, which rounds floats (Unix times lose their sub-second part).
    for record in df.to_dict("records"):
        line = json.dumps({k: _plain(v) for k, v in record.items()}, ensure_ascii=False, allow_nan=False)
        handle.write(line.encode("utf-8") + b"\n")


def _plain(value: Any) -> Any:
    """A JSON value: missing (<NA>, NaN) becomes null, numpy scalars plain numbers."""
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return None
    return value.item() if hasattr(value, "item") else value
