"""Reading a run's trajectory store after (or during) the run: summaries and exports for analysts.

Everything here reads through `sfhpc.data.open_store`, never the HDF5 layout itself.
"""

from sfhpc.analysis.trajectories import TRAJECTORY_COLUMNS, locate_store, plot_rows, trajectory_rows, write_csv

__all__ = ["TRAJECTORY_COLUMNS", "locate_store", "plot_rows", "trajectory_rows", "write_csv"]
