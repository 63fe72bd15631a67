"""``python -m sfhpc.runtime``: the command line every batch script and ``sfhpc run`` starts on each rank.

The rank's program sits above the RL loop (`sfhpc.rank.main`); this module only keeps the command line
that scripts already name. It is the one import from `sfhpc.runtime` upwards that the layering allows.
"""

from __future__ import annotations

import sys

from sfhpc.rank.main import main

if __name__ == "__main__":
    sys.exit(main())
