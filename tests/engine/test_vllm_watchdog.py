"""The engine's watchdog: a rank killed outright leaves no engine process behind (`sfhpc.engine.vllm_engine`).

No vLLM is started: a real process named like vLLM's engine core, started with the stop signals blocked as a
rank starts its engine, stands in for it; the "rank" is a real process that the test kills with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

RANK = """
import multiprocessing, signal, sys, time
from sfhpc.engine import vllm_engine
from sfhpc.runtime import preemption

if __name__ == "__main__":
    with preemption.ignored_in_children():
        core = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(3600,), name="EngineCore_0")
        core.start()
        watchdog = vllm_engine._watch_engine()
    print(core.pid, watchdog.pid, flush=True)
    if sys.argv[1] == "shutdown":  # what VllmEngine.shutdown tells the watchdog once it ended the engine
        watchdog.communicate(b"done", timeout=10)
        print("done", flush=True)
    time.sleep(3600)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def start_rank(mode: str) -> tuple[subprocess.Popen[str], int, int]:
    rank = subprocess.Popen([sys.executable, "-c", RANK, mode], stdout=subprocess.PIPE, text=True)
    assert rank.stdout is not None
    core, watchdog = map(int, rank.stdout.readline().split())
    return rank, core, watchdog


def wait_gone(pid: int, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_a_rank_killed_outright_takes_its_engine_with_it() -> None:
    rank, core, watchdog = start_rank("run")
    try:
        assert alive(core) and alive(watchdog)
        rank.kill()  # no handler, no shutdown: what the OOM killer or `kill -9` does
        rank.wait()
        assert wait_gone(core), "the engine's core outlived its rank"
        assert wait_gone(watchdog)
    finally:
        for pid in (core, watchdog):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_an_engine_shut_down_by_its_rank_is_left_to_it() -> None:
    # After "done" the watchdog kills nothing: the engine is gone then, and its pid may belong to another process.
    rank, core, watchdog = start_rank("shutdown")
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "done"
        assert wait_gone(watchdog)
        rank.kill()
        rank.wait()
        assert alive(core)  # the rank's own shutdown would have ended it
    finally:
        if alive(core):
            os.kill(core, signal.SIGKILL)
