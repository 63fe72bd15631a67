"""A console a person can follow: vLLM's INFO lines and warnings go to the rank's log, in the rank's process
and in the engine processes vLLM spawns; its errors reach the console too; ``--verbose`` leaves vLLM's own
set-up.

Real vLLM, no engine: each process applies vLLM's logging configuration from its environment as vLLM
does when an engine starts (``configure_logging(LoggingConfig())``), then logs what an engine logs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sfhpc.runtime import rank_log

pytestmark = [pytest.mark.vllm]  # vLLM's own logging, imported in two processes (no engine)

RANK = """\
import multiprocessing
import sys
from pathlib import Path

from sfhpc.runtime import rank_log


def vllm_logging():
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging, init_logger

    configure_logging(LoggingConfig())  # what vLLM does when an engine starts, in each of its processes
    return init_logger


def engine_core():
    vllm_logging()("vllm.v1.engine.core").info("engine core: weights reloaded")


if __name__ == "__main__":
    rank_log.set_up(Path(sys.argv[1]), 3, verbose=sys.argv[2] == "verbose")
    log = vllm_logging()("vllm.v1.engine.async_llm")
    log.info("generation paused")
    log.warning("a warning for the log")
    log.error("an error worth seeing")
    if sys.argv[2] == "quiet":
        child = multiprocessing.get_context("spawn").Process(target=engine_core, name="EngineCore_DP0")
        child.start()
        child.join()
"""


def run_rank(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    log = tmp_path / "logs" / "rank-003.log"
    done = subprocess.run([sys.executable, str(script), str(log), mode], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return done, log


def test_vllm_logs_go_to_the_rank_log_and_its_errors_to_the_console_too(tmp_path: Path) -> None:
    done, log = run_rank(tmp_path, "quiet")
    console = done.stdout + done.stderr
    for line in ("generation paused", "a warning for the log", "weights reloaded"):
        assert line not in console, console
    assert done.stdout == "" and "vllm ERROR an error worth seeing" in done.stderr.splitlines(), console
    lines = [line.split(" ", 2)[2] for line in log.read_text().splitlines()]  # after the time: who wrote what
    written = ["vllm MainProcess INFO generation paused", "vllm MainProcess WARNING a warning for the log",
               "vllm MainProcess ERROR an error worth seeing"]
    assert [line for line in lines if line in written] == written
    assert "vllm EngineCore_DP0 INFO engine core: weights reloaded" in lines  # the spawned engine process
    config = json.loads((log.parent / rank_log.VLLM_CONFIG_NAME).read_text())
    assert config == rank_log.vllm_logging_config()  # in the run folder, for whoever wonders where vLLM's lines went


def test_verbose_leaves_vllm_on_the_console(tmp_path: Path) -> None:
    done, log = run_rank(tmp_path, "verbose")
    assert "generation paused" in done.stdout and "a warning for the log" in done.stdout, done.stdout  # vLLM's
    assert not log.exists() or "generation paused" not in log.read_text()
    assert not (log.parent / rank_log.VLLM_CONFIG_NAME).exists()
