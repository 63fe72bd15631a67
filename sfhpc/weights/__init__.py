"""The weight publisher: versioned, bucketed broadcast of new weights from the trainer to every engine.

`manifest` lays a version out in buckets, `transport` moves bytes (MPI now; the NCCL seam is described
there) and `publisher` holds the two ends.
"""

from sfhpc.weights.manifest import TensorMeta, WeightManifest
from sfhpc.weights.publisher import DEFAULT_BUCKET_BYTES, IncomingWeights, PublishStats, WeightPublisher, WeightReceiver
from sfhpc.weights.transport import MPITransport, WeightTransport

__all__ = ["DEFAULT_BUCKET_BYTES", "IncomingWeights", "MPITransport", "PublishStats", "TensorMeta", "WeightManifest",
           "WeightPublisher", "WeightReceiver", "WeightTransport"]
