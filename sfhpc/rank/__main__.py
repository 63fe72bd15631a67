"""``python -m sfhpc.rank``: the command line every batch script and ``sfhpc run`` starts on each rank
(`sfhpc.rank.main`)."""

from __future__ import annotations

import sys

from sfhpc.rank.main import main

if __name__ == "__main__":
    sys.exit(main())
