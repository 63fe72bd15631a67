"""Writing a data frame of a run to a file an analyst's tools read: Parquet (types kept), JSON lines, or CSV
(the columns and format of `sfhpc.analysis.write_csv`, which writes the same from rows). A file is only
ever created, never overwritten; one that fails half-way is removed, so an error leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import IO, Any

import pandas as pd

from sfhpc.analysis.trajectories import TRAJECTORY_COLUMNS
from sfhpc.errors import SfhpcError

FORMATS = ("csv", "parquet", "jsonl")


def write_frame(df: pd.DataFrame, out: Path, fmt: str) -> int:
    """Create `out` holding `df` as ``parquet``, ``jsonl`` or ``csv`` (the CSV columns of `write_csv`, in
    its format: empty cells for missing values); returns the number of rows."""
    writers = {"parquet": _write_parquet, "jsonl": _write_jsonl, "csv": _write_csv}
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


def _write_csv(df: pd.DataFrame, handle: IO[bytes]) -> None:
    # Byte for byte what `write_csv` writes from the rows (the csv module's quoting and line ends, floats in
    # their shortest exact form), at pandas' speed.
    df[list(TRAJECTORY_COLUMNS)].to_csv(handle, index=False, na_rep="", lineterminator="\r\n", encoding="utf-8")


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
