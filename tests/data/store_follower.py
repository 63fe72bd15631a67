"""A reader in another process that follows a store while its run writes it.

    python -m tests.data.store_follower STORE TARGET

Prints ``seen N ok`` (or ``seen N bad``) each time the committed count N changes, checking every new
trajectory against the one the writer wrote; exits when N reaches TARGET (or after 60 s).
"""

from __future__ import annotations

import sys
import time

from sfhpc.data.store import open_store
from tests.data.records import fingerprint, make_trajectory


def main(argv: list[str]) -> None:
    target, seen, deadline = int(argv[1]), -1, time.monotonic() + 60
    with open_store(argv[0]) as reader:
        while seen < target and time.monotonic() < deadline:
            reader.refresh()
            n = len(reader)
            if n != seen:
                good = all(fingerprint(reader.get(f"traj-{i:06d}")) == fingerprint(make_trajectory(i))
                           for i in range(max(seen, 0), n))
                print(f"seen {n} {'ok' if good else 'bad'}", flush=True)
                seen = n
            time.sleep(0.005)


if __name__ == "__main__":
    main(sys.argv[1:])
