"""The layout of one weight version on the wire: which tensor sits in which bucket, at which byte offset.

A version is sent as a manifest (names, shapes, dtypes, bucket and byte offset of every tensor), once,
then as raw bytes bucket by bucket. Tensors are packed whole, in the order given, into buckets of at
most ``bucket_bytes``; a tensor larger than that gets a bucket of its own, so a receiver can always
hand complete tensors to the engine. Bytes are dtype-agnostic, which is how bf16 travels over MPI
(MPI has no bf16 type).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

ALIGN = 64  # byte alignment of each tensor in a bucket: any dtype view of the slice is then aligned


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    bucket: int
    offset: int  # byte offset inside the bucket
    nbytes: int


@dataclasses.dataclass(frozen=True)
class WeightManifest:
    """Everything a receiver needs before the bytes: the version and where each tensor lies."""

    version: int
    tensors: tuple[TensorMeta, ...]
    bucket_sizes: tuple[int, ...]  # bytes of each bucket, padding included

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_sizes)

    def bucket(self, index: int) -> tuple[TensorMeta, ...]:
        return tuple(t for t in self.tensors if t.bucket == index)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a weight manifest")
    return dtype


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(named: Sequence[tuple[str, torch.Tensor]], version: int, bucket_bytes: int) -> WeightManifest:
    """Assign each tensor a bucket and offset, in order, filling a bucket up to `bucket_bytes`."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be at least {ALIGN}, found {bucket_bytes}")
    metas: list[TensorMeta] = []
    sizes: list[int] = []
    fill = 0
    seen: set[str] = set()
    for name, tensor in named:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in one weight version")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if not sizes or (fill and fill + nbytes > bucket_bytes):
            sizes.append(0)
            fill = 0
        metas.append(TensorMeta(name, tuple(tensor.shape), dtype_name(tensor.dtype), len(sizes) - 1, fill, nbytes))
        fill = _aligned(fill + nbytes)
        sizes[-1] = fill
    return WeightManifest(version=version, tensors=tuple(metas), bucket_sizes=tuple(sizes))


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as a flat uint8 tensor (a view when it is contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def pack(metas: Sequence[TensorMeta], tensors: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Copy `tensors` (one per meta, same order) into the uint8 buffer `out` at their offsets."""
    for meta, tensor in zip(metas, tensors):
        out[meta.offset:meta.offset + meta.nbytes].copy_(as_bytes(tensor))


def unpack(buffer: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for each meta, as views into the uint8 `buffer` (no copy)."""
    out = []
    for meta in metas:
        raw = buffer[meta.offset:meta.offset + meta.nbytes]
        out.append((meta.name, raw.view(dtype_of(meta.dtype)).view(meta.shape)))
    return out
