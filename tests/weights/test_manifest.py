"""Bucket planning and the byte layout, without MPI."""

from __future__ import annotations

import json

import pytest
import torch

from sfhpc.weights.manifest import ALIGN, WeightManifest, pack, plan_buckets, unpack


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


def test_a_module_travels_in_one_bucket_so_fused_parameters_load_whole() -> None:
    named = [(f"model.layers.0.self_attn.{p}_proj.weight", torch.zeros(64, dtype=torch.bfloat16)) for p in "qkv"]
    named.insert(0, ("model.embed_tokens.weight", torch.zeros(160, dtype=torch.bfloat16)))
    m = plan_buckets(named, 0, bucket_bytes=512)
    # embed (320 B) + the 3 projections (3 x 128 B) exceed 512: the projections move on together.
    assert [t.bucket for t in m.tensors] == [0, 1, 1, 1]
    assert [t.bucket for t in plan_buckets(named, 0, 512, group=None).tensors] == [0, 0, 1, 1]


def test_each_bucket_is_one_message_unless_it_exceeds_the_message_size() -> None:
    named = [("small.a", torch.zeros(10)), ("big", torch.zeros(1000)), ("small.b", torch.zeros(300)),
             ("small.c", torch.zeros(300)), ("empty", torch.zeros(0))]
    m = plan_buckets(named, 3, 2048, message_bytes=1024)
    assert m.bucket_sizes == (64, 4032, 1216, 1216)  # small.c (and the empty tensor) fill a fourth bucket
    # Bucket 1 (4032 B) is cut into 1024-byte messages, the others need one or two; the empty tensor adds nothing.
    assert [(x.bucket, x.offset, x.nbytes) for x in m.messages] == [
        (0, 0, 64), (1, 0, 1024), (1, 1024, 1024), (1, 2048, 1024), (1, 3072, 960), (2, 0, 1024), (2, 1024, 192),
        (3, 0, 1024), (3, 1024, 192)]
    assert [len(m.bucket_messages(b)) for b in range(m.num_buckets)] == [1, 4, 2, 2]
    assert sum(x.nbytes for x in m.messages) == m.total_bytes  # every byte of every bucket, once
    assert len(plan_buckets(named, 3, 2048).messages) == m.num_buckets  # the default: one message per bucket
    # The layout hash ignores the version and follows the layout.
    assert plan_buckets(named, 4, 2048, message_bytes=1024).layout == m.layout
    assert plan_buckets(named, 3, 2048).layout != m.layout
    with pytest.raises(ValueError, match="message_bytes"):
        plan_buckets(named, 0, 2048, message_bytes=8)


def test_pack_casts_into_the_wire_dtype() -> None:
    named = [("w", torch.randn(4, 4)), ("b", torch.randn(4))]
    m = plan_buckets(named, 0, 1 << 20, dtype=torch.bfloat16)
    buffer = torch.zeros(m.bucket_sizes[0], dtype=torch.uint8)
    pack(m.bucket(0), [t for _, t in named], buffer)
    for (_, want), (_, got) in zip(named, unpack(buffer, m.bucket(0))):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))


def test_a_manifest_survives_plain_json_as_it_crosses_to_an_engine_worker() -> None:
    named = [("a", torch.randn(40, 40)), ("b", torch.zeros(3, dtype=torch.int64)), ("c", torch.randn(7))]
    m = plan_buckets(named, 9, 2048, dtype=torch.bfloat16, message_bytes=1024)
    plain = json.loads(json.dumps(m.to_json()))  # lists and numbers only: what vLLM's RPC carries
    back = WeightManifest.from_json(plain)
    assert back == m and back.layout == m.layout and back.version == 9
    assert [back.bucket_messages(b) for b in range(back.num_buckets)] == \
        [m.bucket_messages(b) for b in range(m.num_buckets)]
