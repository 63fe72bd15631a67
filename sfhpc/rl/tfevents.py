"""A run's per-step metrics as a TensorBoard event file (``tensorboard --logdir runs/`` works offline).

The file format is small enough to write without TensorBoard or TensorFlow: a sequence of records, each
the length of its data (uint64, little endian), a masked CRC-32C of those 8 bytes, the data, and a masked
CRC-32C of the data. The data are ``tensorflow.Event`` protocol buffers, written here by hand: the first
names the file version, every other carries a step and a ``Summary`` of scalar values.

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

SUFFIX = ".sfhpc"  # the files this writer owns end with it (TensorBoard reads any "*tfevents*" name)


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli's polynomial, reflected
        table.append(crc)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    """The record format's checksum: CRC-32C rotated and offset (so that a CRC of CRCs stays strong)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # int64 as protobuf writes it (a negative step takes ten bytes)
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event_bytes(wall_time: float, step: int | None = None, *, file_version: str | None = None,
                scalars: Mapping[str, float] | None = None) -> bytes:
    out = bytearray(_varint(1 << 3 | 1) + struct.pack("<d", wall_time))
    if step is not None:
        out += _varint(2 << 3) + _varint(step)
    if file_version is not None:
        out += _field(3, file_version.encode())
    if scalars:
        values = b"".join(_field(1, _field(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", value))
                          for tag, value in scalars.items())
        out += _field(5, values)
    return bytes(out)


def record_bytes(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))


def scalars_of(row: Mapping[str, Any]) -> dict[str, float]:
    """The numeric, finite values of a metrics row (the step itself is the event's step, not a scalar)."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


class EventFile:
    """One event file in a run folder, appended to step by step and flushed each time (a live run shows)."""

    def __init__(self, folder: Path) -> None:
        name = f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}{SUFFIX}"
        self.path = folder / name
        self._file: IO[bytes] = open(self.path, "xb")  # noqa: SIM115 - held open for the run's length
        self._write(event_bytes(time.time(), file_version="brain.Event:2"))

    def add(self, step: int, row: Mapping[str, Any], wall_time: float | None = None) -> None:
        self._write(event_bytes(time.time() if wall_time is None else wall_time, step, scalars=scalars_of(row)))

    def _write(self, data: bytes) -> None:
        self._file.write(record_bytes(data))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def rewrite(folder: Path, rows: Iterable[Mapping[str, Any]]) -> EventFile:
    """A new event file holding exactly `rows` (a resumed run's steps so far); this writer's older files in
    `folder` are removed, so that no step shows twice (the steps they held past `rows` were discarded)."""
    older = [p for p in folder.glob(f"events.out.tfevents.*{SUFFIX}") if p.is_file()]
    events = EventFile(folder)
    for row in rows:
        events.add(int(row["step"]), row)
    for path in older:
        path.unlink(missing_ok=True)
    return events
