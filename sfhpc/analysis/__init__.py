"""Reading a run's trajectory store after (or during) the run: data frames (`run`, computed over whole
tables by `columns`), summaries (`summary`), exports (`export`), plots (`plots`), one trajectory as a
conversation (`conversation`), a report in one HTML file (`report`) and two runs side by side (`compare`).

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
