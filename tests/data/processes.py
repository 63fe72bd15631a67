"""Run a helper module in a subprocess and read its output line by line, with timeouts."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Child:
    """``python -m MODULE ARGS`` from the repository root; its stdout lines arrive in a queue."""

    def __init__(self, module: str, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def next_line(self, timeout: float = 30.0) -> str | None:
        """The next line, or None at end of output; fails the test on a timeout."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.proc.kill()
            raise AssertionError(f"no output for {timeout} s; got {self.seen[-3:]}") from None
        if line is not None:
            self.seen.append(line)
        return line

    def rest(self, timeout: float = 30.0) -> list[str]:
        """Every remaining line (the process must end)."""
        lines = []
        while (line := self.next_line(timeout)) is not None:
            lines.append(line)
        self.proc.wait(timeout)
        return lines

    def stderr(self) -> str:
        assert self.proc.stderr is not None
        return self.proc.stderr.read()
