"""Reading a run's trajectory store after (or during) the run: data frames, summaries, exports, one
trajectory as a conversation.

Everything here reads through `sfhpc.data.open_store`, never the HDF5 layout itself.
"""

from sfhpc.analysis.run import Run, open_run
from sfhpc.analysis.trajectories import (
    EXTRA_COLUMNS,
    TRAJECTORY_COLUMNS,
    locate_store,
    trajectory_row,
    trajectory_rows,
    write_csv,
)

__all__ = ["EXTRA_COLUMNS", "TRAJECTORY_COLUMNS", "Run", "locate_store", "open_run", "trajectory_row",
           "trajectory_rows", "write_csv"]
