"""Start the standalone endpoint (``python -m sfhpc.endpoint``) as its own process, as an agent's author would."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@contextlib.contextmanager
def standalone(*args: str, timeout: float = 60.0) -> Iterator[str]:
    """The base URL (``http://127.0.0.1:PORT/v1``) of ``python -m sfhpc.endpoint --port 0 ARGS`` while it runs."""
    process = subprocess.Popen([sys.executable, "-m", "sfhpc.endpoint", "--port", "0", *args], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + timeout
        lines = []
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
            found = re.search(r"at (http://\S+/v1)$", line.strip())
            if found:
                yield found.group(1)
                return
        raise AssertionError(f"the endpoint did not start: {''.join(lines)[-2000:]}")
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
