"""Bucket planning and the byte layout, without MPI."""

from __future__ import annotations

import pytest
import torch

from sfhpc.weights.manifest import ALIGN, pack, plan_buckets, unpack


def test_tensors_fill_buckets_in_order_and_an_oversized_one_travels_alone() -> None:
    named = [("a", torch.zeros(100, dtype=torch.bfloat16)),  # 200 B
             ("b", torch.zeros(10, dtype=torch.float32)),  # 40 B
             ("big", torch.zeros(300, dtype=torch.float32)),  # 1200 B > bucket
             ("c", torch.zeros(3, dtype=torch.int64))]
    m = plan_buckets(named, version=7, bucket_bytes=512)
    assert m.version == 7
    assert [(t.name, t.bucket, t.offset) for t in m.tensors] == [("a", 0, 0), ("b", 0, 256), ("big", 1, 0),
                                                                   ("c", 2, 0)]
    assert m.bucket_sizes == (320, 1216, 64)  # each tensor's end rounded up to the alignment
    assert all(t.offset % ALIGN == 0 for t in m.tensors)
    assert [t.name for t in m.bucket(0)] == ["a", "b"]
    with pytest.raises(ValueError, match="twice"):
        plan_buckets(named + [("a", torch.zeros(1))], 0, 512)


def test_pack_then_unpack_is_bit_exact_for_every_dtype() -> None:
    gen = torch.Generator().manual_seed(0)
    named = [("bf16", torch.randn(3, 5, generator=gen).to(torch.bfloat16)),
             ("f32", torch.randn(4, generator=gen)),
             ("t", torch.randn(6, 2, generator=gen).t()),
             ("i64", torch.arange(5)),
             ("f16", torch.randn(2, 2, 2, generator=gen).half())]
    m = plan_buckets(named, 0, 1 << 20)
    buffer = torch.zeros(m.bucket_sizes[0], dtype=torch.uint8)
    pack(m.bucket(0), [t for _, t in named], buffer)
    out = unpack(buffer, m.bucket(0))
    assert [n for n, _ in out] == [n for n, _ in named]
    for (_, want), (_, got) in zip(named, out):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
