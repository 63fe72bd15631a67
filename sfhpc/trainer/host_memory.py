"""Freed tensors go back to the system on CPU trainer ranks, so a rank's resident memory is what it holds.

glibc's allocator serves a large request from the heap once a block of that size has been freed (its mmap
threshold rises to 32 MiB on its own), and a heap returns memory only from its top: a training step frees
and allocates gradients, gathered layers and activations of every size, and the holes stay resident. On
a 0.4B model sharded over two CPU ranks a rank's peak grew step by step to 5.4 GiB against 3.6 GiB held
(`sfhpc bench train`); with blocks of 64 KiB and more mapped on their own (and so unmapped when freed) it
stays at 3.6 GiB. Fixing the threshold also stops its dynamic rise. No effect where the C library is not
glibc, and none on GPU memory, which torch's caching allocator manages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 << 10


@functools.cache
def return_freed_memory() -> bool:
    """Make this process map large blocks on their own and trim its heap; True where glibc took it."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, 0))
