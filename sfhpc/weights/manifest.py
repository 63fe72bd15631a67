"""The layout of a weight set on the wire: which tensor sits in which bucket, and the messages that carry it.

Tensors are packed whole, in the order given, into buckets of at most ``bucket_bytes``; a receiver hands
complete buckets to its engine. Consecutive tensors of one *group* (by default: one module, such as a
layer's ``self_attn`` or ``mlp``) share a bucket, because engines fuse them (vLLM stacks q/k/v and
gate/up into one parameter) and a load that brings half of a fused parameter corrupts the other half. A
group larger than a bucket gets a bucket of its own.

On the wire a bucket is one *message*: the source casts or copies every tensor into a persistent
staging buffer that holds the buckets back to back, and sends each bucket from there (one contiguous
range of memory, which moves between ranks as fast as a plain broadcast of the same bytes). A bucket
larger than one MPI message may hold is cut into several.

Receivers only see byte ranges and land every message in place in one bucket buffer. Bytes are
dtype-agnostic, which is how bf16 travels over MPI (MPI has no bf16 type). The `layout` hash covers
everything but the version: while it holds, a version travels as a tiny header plus the bytes, and the
manifest is sent only when the layout changes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

ALIGN = 64  # byte alignment of each tensor in a bucket: any dtype view of the slice is then aligned
MAX_MESSAGE = 1 << 30  # bytes per message: Open MPI 4 counts are C ints, so stay well below 2 GiB


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    bucket: int
    offset: int  # byte offset inside the bucket
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Message:
    """One broadcast: ``nbytes`` bytes at ``offset`` of bucket ``bucket``."""

    bucket: int
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclasses.dataclass(frozen=True)
class WeightManifest:
    """Everything a receiver needs before the bytes: the version, where each tensor lies, the messages."""

    version: int
    tensors: tuple[TensorMeta, ...]
    bucket_sizes: tuple[int, ...]  # bytes of each bucket, padding included
    messages: tuple[Message, ...] = ()  # in wire order, bucket by bucket
    layout: int = 0  # hash of all of the above but the version

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_sizes)

    def bucket(self, index: int) -> tuple[TensorMeta, ...]:
        return self._by_bucket[0][index]

    def bucket_messages(self, index: int) -> tuple[Message, ...]:
        return self._by_bucket[1][index]

    @functools.cached_property
    def _by_bucket(self) -> tuple[list[tuple[TensorMeta, ...]], list[tuple[Message, ...]]]:
        tensors: list[list[TensorMeta]] = [[] for _ in self.bucket_sizes]
        messages: list[list[Message]] = [[] for _ in self.bucket_sizes]
        for t in self.tensors:
            tensors[t.bucket].append(t)
        for m in self.messages:
            messages[m.bucket].append(m)
        return [tuple(b) for b in tensors], [tuple(b) for b in messages]

    def to_json(self) -> dict[str, Any]:
        """Plain lists and numbers (what crosses a process boundary that encodes dataclasses as dicts, such as
        vLLM's ``collective_rpc``); `from_json` rebuilds the manifest."""
        return {"version": self.version, "layout": self.layout, "bucket_sizes": list(self.bucket_sizes),
                "tensors": [[t.name, list(t.shape), t.dtype, t.bucket, t.offset, t.nbytes] for t in self.tensors],
                "messages": [[m.bucket, m.offset, m.nbytes] for m in self.messages]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WeightManifest:
        return cls(version=data["version"], layout=data["layout"], bucket_sizes=tuple(data["bucket_sizes"]),
                   tensors=tuple(TensorMeta(n, tuple(shape), d, b, o, nb) for n, shape, d, b, o, nb in data["tensors"]),
                   messages=tuple(Message(*m) for m in data["messages"]))

    def __getstate__(self) -> dict[str, object]:
        # The per-bucket index is rebuilt on arrival; it need not travel.
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __setstate__(self, state: dict[str, object]) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a weight manifest")
    return dtype


def module_group(name: str) -> str:
    """The default bucket group of a parameter: its module's parent (``model.layers.0.self_attn`` for
    ``model.layers.0.self_attn.q_proj.weight``), which holds every projection an engine may fuse."""
    parts = name.split(".")
    return ".".join(parts[:-2]) if len(parts) >= 3 else name


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout_hash(tensors: Sequence[TensorMeta], bucket_sizes: Sequence[int], messages: Sequence[Message]) -> int:
    digest = hashlib.blake2b(repr((tuple(tensors), tuple(bucket_sizes), tuple(messages))).encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1  # 63 bits: fits a signed int64 header word


def plan_buckets(named: Sequence[tuple[str, torch.Tensor]], version: int, bucket_bytes: int, *,
                 dtype: torch.dtype | None = None, group: Callable[[str], str] | None = module_group,
                 message_bytes: int = MAX_MESSAGE) -> WeightManifest:
    """Lay `named` out in buckets of at most `bucket_bytes`, each sent as one message (or several of at
    most `message_bytes`, for a bucket beyond what one MPI message may hold).

    `dtype` is the wire dtype (None: each tensor's own); `group` maps a name to its bucket group (None:
    every tensor alone).
    """
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be at least {ALIGN}, found {bucket_bytes}")
    if not ALIGN <= message_bytes <= MAX_MESSAGE:
        raise ValueError(f"message_bytes must be between {ALIGN} and {MAX_MESSAGE}, found {message_bytes}")
    names = [name for name, _ in named]
    if len(set(names)) != len(names):
        twice = next(n for i, n in enumerate(names) if n in names[:i])
        raise ValueError(f"tensor {twice!r} appears twice in one weight version")
    wire = [dtype or t.dtype for _, t in named]
    sizes = [t.numel() * w.itemsize for (_, t), w in zip(named, wire)]

    # Groups: maximal runs of consecutive tensors with the same group key.
    runs: list[list[int]] = []
    previous: str | None = None
    for i, name in enumerate(names):
        key = group(name) if group is not None else None
        if not runs or key is None or key != previous:
            runs.append([])
        runs[-1].append(i)
        previous = key

    offsets = [0] * len(names)
    buckets = [0] * len(names)
    bucket_sizes: list[int] = []
    fill = 0
    for run in runs:
        need = 0
        for i in run:
            need = _aligned(need + sizes[i])
        if not bucket_sizes or (fill and fill + need > bucket_bytes):
            bucket_sizes.append(0)
            fill = 0
        for i in run:
            offsets[i], buckets[i] = fill, len(bucket_sizes) - 1
            fill = _aligned(fill + sizes[i])
        bucket_sizes[-1] = fill

    # A bucket of only empty tensors has no bytes, hence no message.
    messages = tuple(Message(b, start, min(start + message_bytes, size) - start)
                     for b, size in enumerate(bucket_sizes) for start in range(0, size, message_bytes))
    metas = tuple(TensorMeta(n, tuple(t.shape), dtype_name(w), b, o, s)
                  for (n, t), w, b, o, s in zip(named, wire, buckets, offsets, sizes))
    return WeightManifest(version=version, tensors=metas, bucket_sizes=tuple(bucket_sizes),
                          messages=tuple(messages), layout=layout_hash(metas, bucket_sizes, messages))


def typed_view(buffer: torch.Tensor, meta: TensorMeta, base: int = 0) -> torch.Tensor:
    """The tensor `meta` describes, as a view into the uint8 `buffer` whose byte 0 is bucket byte `base`."""
    start = meta.offset - base
    return buffer[start:start + meta.nbytes].view(dtype_of(meta.dtype)).view(meta.shape)


def pack(metas: Sequence[TensorMeta], tensors: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Copy `tensors` (one per meta, same order) into the uint8 buffer `out` at their offsets, casting to
    each meta's dtype on the way."""
    for meta, tensor in zip(metas, tensors):
        typed_view(out, meta).copy_(tensor)


def unpack(buffer: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for each meta, as views into the uint8 `buffer` (no copy)."""
    return [(meta.name, typed_view(buffer, meta)) for meta in metas]
