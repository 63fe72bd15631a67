"""The data plane: trajectory records, the HDF5 store, the trajectory manager and its MPI service.

mpi4py is only imported inside `sfhpc.data.service` functions, so importing this package never starts MPI.
"""

from sfhpc.data.errors import (
    InvalidRequest,
    StoreError,
    StoreExists,
    TrajectoryConflict,
    TrajectoryExists,
    TrajectoryFinished,
    UnknownTrajectory,
)
from sfhpc.data.manager import Batch, Continuation, TrajectoryManager
from sfhpc.data.store import StoreReader, StoreSummary, TrajectoryStore, open_store
from sfhpc.data.trajectory import Segment, SegmentKind, Status, Trajectory

__all__ = [
    "Batch", "Continuation", "InvalidRequest", "Segment", "SegmentKind", "Status", "StoreError", "StoreExists",
    "StoreReader", "StoreSummary", "Trajectory", "TrajectoryConflict", "TrajectoryExists", "TrajectoryFinished",
    "TrajectoryManager", "TrajectoryStore", "UnknownTrajectory", "open_store",
]
