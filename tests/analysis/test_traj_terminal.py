"""What ``sfhpc traj`` prints holds no terminal control: escapes, carriage returns and other C0/C1 characters
in trajectory text and in client-chosen ids, tasks and groups are shown escaped (``\\x1b``), newlines and tabs
of the text kept; an error that quotes such an id stays one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore
from sfhpc.engine.tokenizer import END, ByteTokenizer
from sfhpc.terminal import one_line, printable
from tests.conftest import run_sfhpc

EVIL_ID = "id\x1b]0;owned\x07\r"
EVIL_TEXT = "line one\tcol\n\x1b[2J\x1b[31mred\rover\x9b1m\x7f"


def controls(text: str) -> set[str]:
    return {c for c in text if (ord(c) < 0x20 and c not in "\n\t") or 0x7F <= ord(c) < 0xA0}


def test_printable_escapes_every_control_but_the_layout_ones() -> None:
    assert printable("a\x1b[31mb\rc\n\td\x00\x9b\x7f") == "a\\x1b[31mb\\rc\n\td\\x00\\x9b\\x7f"
    assert one_line("a\nb\tc") == "a\\nb\\tc"
    assert printable(printable(EVIL_TEXT)) == printable(EVIL_TEXT)  # escaping twice changes nothing
    assert printable("ümlaut → ok") == "ümlaut → ok"  # printable characters stay as they are


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("evil") / "run"
    folder.mkdir()
    tokenizer = ByteTokenizer()
    manager = TrajectoryManager(TrajectoryStore.create(folder / "trajectories.h5"), max_token_lag=4)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "say \x1b[5mhi"}])
    tid = manager.start(prompt, task="t\x1b[1m", group="g\r\x1b[K", trajectory_id=EVIL_ID)
    reply = tokenizer.encode(EVIL_TEXT) + [END]
    manager.add_generated(tid, reply, [-0.5] * len(reply), 1, engine="e\x1b", finish_reason="stop")
    manager.finish(tid, reward=1.0, turn_rewards=[1.0])
    manager.close()
    return folder


def test_show_and_summary_print_no_control(run_dir: Path) -> None:
    done = run_sfhpc("traj", "show", str(run_dir), EVIL_ID, "--tokens")
    assert done.returncode == 0, done.stderr
    assert not controls(done.stdout), controls(done.stdout)
    assert "trajectory id\\x1b]0;owned\\x07\\r  task t\\x1b[1m  group g\\r\\x1b[K" in done.stdout
    assert "\\x1b[2J\\x1b[31mred" in done.stdout and "line one\tcol" in done.stdout  # a tab stays a tab
    summary = run_sfhpc("traj", "summary", str(run_dir))
    assert summary.returncode == 0, summary.stderr
    assert not controls(summary.stdout)


def test_an_error_quoting_a_client_id_is_one_line_without_controls(run_dir: Path) -> None:
    done = run_sfhpc("traj", "show", str(run_dir), "no\x1b[2Jsuch\nid")
    assert done.returncode != 0 and not controls(done.stderr)
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("sfhpc: error: ")
