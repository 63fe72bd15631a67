"""The run folder's JSON-lines logs: a last line cut by a crash is left out (reading) or set aside beside the
log (the writer's repair), with a warning naming the file and the line; damage elsewhere is an error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sfhpc.data.run_log import read_log, repair_log
from sfhpc.errors import SfhpcError

ROWS = [{"step": 1, "reward_mean": 0.25}, {"step": 2, "reward_mean": 0.5}, {"step": 3, "reward_mean": "é"}]


def write(path: Path, rows: list[dict], tail: bytes = b"") -> bytes:
    data = b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows) + tail
    path.write_bytes(data)
    return data


def test_a_cut_last_line_is_left_out_with_a_warning_and_the_file_untouched(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    data = write(path, ROWS[:2], b'{"step": 3, "rew')
    heard: list[str] = []
    assert read_log(path, warn=heard.append) == ROWS[:2]
    assert heard == [f"{path}: line 3 is cut (a crash while it was written, or the run is writing it now); left out"]
    assert path.read_bytes() == data
    read_log(path, warn=heard.append)
    assert len(heard) == 1  # a reader that polls is told once


def test_the_writers_repair_sets_the_cut_text_aside_so_the_next_line_stands_alone(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    write(path, ROWS[:2], b'{"event": "finis')
    (tmp_path / "events.jsonl.damaged").write_bytes(b'{"earlier": "damage"}\n')
    heard: list[str] = []
    assert repair_log(path, warn=heard.append) == ROWS[:2]
    assert heard and f"{path}: line 3 was cut" in heard[0] and "events.jsonl.damaged" in heard[0]
    assert (tmp_path / "events.jsonl.damaged").read_bytes() == b'{"earlier": "damage"}\n{"event": "finis\n'
    with path.open("a", encoding="utf-8") as f:  # what the controller does next
        f.write(json.dumps(ROWS[2]) + "\n")
    assert read_log(path, warn=heard.append) == ROWS and len(heard) == 1
    assert repair_log(path, warn=heard.append) == ROWS and len(heard) == 1  # nothing more to repair


@pytest.mark.parametrize("tail", [b"\x00" * 64, '{"step": 3, "reward_mean": "é'.encode()[:-1], b"{\n"],
                         ids=["zeros", "inside-a-character", "a-bare-brace"])
def test_what_a_crash_leaves_is_a_cut_line(tmp_path: Path, tail: bytes) -> None:
    path = tmp_path / "metrics.jsonl"
    write(path, ROWS[:2], tail)
    heard: list[str] = []
    assert repair_log(path, warn=heard.append) == ROWS[:2] and len(heard) == 1
    assert path.read_bytes() == write(tmp_path / "whole.jsonl", ROWS[:2])
    assert (tmp_path / "metrics.jsonl.damaged").read_bytes() == tail.rstrip(b"\n") + b"\n"


def test_a_whole_last_line_without_its_newline_is_kept_and_terminated(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    write(path, ROWS[:2], json.dumps(ROWS[2]).encode())
    heard: list[str] = []
    assert read_log(path, warn=heard.append) == ROWS
    assert repair_log(path, warn=heard.append) == ROWS and heard == []
    assert path.read_bytes().endswith(b"}\n") and not (tmp_path / "metrics.jsonl.damaged").exists()


def test_damage_before_the_last_line_is_an_error_naming_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    data = write(path, ROWS[:1], b'{"step": 2, "rew\n' + json.dumps(ROWS[2]).encode() + b"\n")
    for read in (read_log, repair_log):
        with pytest.raises(SfhpcError, match=r"metrics.jsonl: line 2 is not a JSON object; the file is damaged"):
            read(path)
    assert path.read_bytes() == data and not (tmp_path / "metrics.jsonl.damaged").exists()


def test_no_file_and_blank_lines(tmp_path: Path) -> None:
    assert read_log(tmp_path / "none.jsonl") == [] and repair_log(tmp_path / "none.jsonl") == []
    assert not (tmp_path / "none.jsonl").exists()
    path = tmp_path / "metrics.jsonl"
    path.write_text('\n{"step": 1}\n\n', encoding="utf-8")
    assert read_log(path) == [{"step": 1}]
