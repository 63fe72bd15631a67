"""The trajectory store: one HDF5 file per run, one writer (the controller), any number of readers.

The store is three parts, one module each: its layout (`sfhpc.data.layout`), the writer
(`sfhpc.data.store_writer.TrajectoryStore`, with its lock in `sfhpc.data.store_lock`) and the readers
(`sfhpc.data.store_reader`: `open_store`, `StoreView`). This module gathers their public names, so a user
imports them from one place.
"""

from sfhpc.data.store_lock import lock_path
from sfhpc.data.store_reader import ConsumptionMark, StoreReader, StoreSummary, StoreView, open_store
from sfhpc.data.store_writer import StoreStats, TrajectoryStore

__all__ = ["ConsumptionMark", "StoreReader", "StoreStats", "StoreSummary", "StoreView", "TrajectoryStore",
           "lock_path", "open_store"]
