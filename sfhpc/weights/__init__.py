"""The weight publisher: versioned, bucketed broadcast of new weights from the trainer to every engine.

`manifest` lays a version out in buckets and messages, `transport` moves bytes (MPI, or a
`torch.distributed` group that `group` builds) and `publisher` holds the two ends.
"""

from sfhpc.weights.errors import WeightStreamError
from sfhpc.weights.manifest import Message, TensorMeta, WeightManifest
from sfhpc.weights.publisher import (
    DEFAULT_BUCKET_BYTES,
    IncomingWeights,
    PendingVersion,
    PublishStats,
    WeightPublisher,
    WeightReceiver,
)
from sfhpc.weights.transport import MPITransport, TorchTransport, Transfer, WeightTransport, connect

__all__ = ["DEFAULT_BUCKET_BYTES", "IncomingWeights", "MPITransport", "Message",
           "PendingVersion", "PublishStats", "TensorMeta", "Transfer", "WeightManifest", "WeightPublisher",
           "TorchTransport", "WeightReceiver", "WeightStreamError", "WeightTransport", "connect"]
