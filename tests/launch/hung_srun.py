"""A stand-in for srun in the step-guard tests (the real hang cannot be produced on demand).

    python -m tests.launch.hung_srun RANKS [--outcomes 0,0,2] [--marks K] [--linger S] [--exit CODE]

Starts RANKS rank processes that leave their step-guard mark the way real ranks do (`arm`, `finished`,
interpreter exit); the first K of them only (default: all). Then, like the hung srun, it lingers for S
seconds (default: forever) before exiting with CODE. SIGUSR1 makes it exit at once with code 10.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

RANK = """
import sys
from sfhpc.runtime import step_marks
step_marks.arm(int(sys.argv[1]))
step_marks.finished(int(sys.argv[2]))
"""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("ranks", type=int)
    parser.add_argument("--outcomes", default="")
    parser.add_argument("--marks", type=int, default=None)
    parser.add_argument("--linger", type=float, default=None)
    parser.add_argument("--exit", type=int, default=0)
    args = parser.parse_args()
    signal.signal(signal.SIGUSR1, lambda *_: sys.exit(10))
    outcomes = [int(o) for o in args.outcomes.split(",")] if args.outcomes else [0] * args.ranks
    marking = args.ranks if args.marks is None else args.marks
    for rank in range(marking):
        subprocess.run([sys.executable, "-c", RANK, str(rank), str(outcomes[rank])], check=True)
    print("ranks done", flush=True)
    deadline = None if args.linger is None else time.monotonic() + args.linger
    while deadline is None or time.monotonic() < deadline:
        time.sleep(0.05)
    return args.exit


if __name__ == "__main__":
    sys.exit(main())
