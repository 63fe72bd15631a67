"""The megatron <-> Hugging Face name and layout mapping, on plain tensors (no megatron-core needed)."""

from __future__ import annotations

import pytest
import torch

from sfhpc.trainer import megatron_names as names
from sfhpc.trainer.errors import TrainerError

# 4 query heads sharing 2 key/value heads, head_dim 3, a vocabulary that tensor parallel 4 must pad.
LAYOUT = names.LlamaLayout(num_layers=2, hidden_size=12, num_heads=4, num_kv_heads=2, head_dim=3,
                           ffn_hidden_size=8, vocab_size=10, padded_vocab_size=12)


def hf_state(layout: names.LlamaLayout = LAYOUT) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, d = layout.hidden_size, layout.head_dim
    shapes = {"model.embed_tokens.weight": (layout.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (layout.vocab_size, h)}
    for i in range(layout.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (layout.num_heads * d, h),
                       p + "self_attn.k_proj.weight": (layout.num_kv_heads * d, h),
                       p + "self_attn.v_proj.weight": (layout.num_kv_heads * d, h),
                       p + "self_attn.o_proj.weight": (h, layout.num_heads * d),
                       p + "mlp.gate_proj.weight": (layout.ffn_hidden_size, h),
                       p + "mlp.up_proj.weight": (layout.ffn_hidden_size, h),
                       p + "mlp.down_proj.weight": (h, layout.ffn_hidden_size)})
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def to_hf(mg: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t for name, full in mg.items() for n, t in names.megatron_to_hf(name, full, LAYOUT)}


@pytest.mark.parametrize("fused_norms", [False, True])
def test_hf_to_megatron_to_hf_is_bit_identical(fused_norms: bool) -> None:
    hf = hf_state()
    mg = names.hf_to_megatron(hf, LAYOUT, fused_norms=fused_norms)
    assert mg["embedding.word_embeddings.weight"].shape == (12, 12)  # padded to the TP multiple
    assert not mg["output_layer.weight"][10:].any()  # padding rows are zero
    norm = "self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight"
    assert f"decoder.layers.1.{norm}" in mg
    back = to_hf(mg)
    assert set(back) == set(hf)
    for n, t in hf.items():
        assert back[n].shape == t.shape and torch.equal(back[n], t), n


def test_megatron_to_hf_to_megatron_is_bit_identical() -> None:
    mg = names.hf_to_megatron(hf_state(), LAYOUT)
    mg = {n: (torch.randn_like(t) if "layers" in n else t) for n, t in mg.items()}  # any megatron tensors
    again = names.hf_to_megatron(to_hf(mg), LAYOUT)
    assert set(again) == set(mg)
    for n, t in mg.items():
        assert torch.equal(again[n], t), n


def test_fused_qkv_is_grouped_per_key_value_head() -> None:
    # Row r of q_proj holds the value r, of k_proj 100 + r, of v_proj 200 + r: the fused rows must read
    # [q heads 0,1 | k head 0 | v head 0 | q heads 2,3 | k head 1 | v head 1], head_dim rows each.
    d = LAYOUT.head_dim
    q = torch.arange(4 * d, dtype=torch.float32).unsqueeze(1)
    k = 100 + torch.arange(2 * d, dtype=torch.float32).unsqueeze(1)
    v = 200 + torch.arange(2 * d, dtype=torch.float32).unsqueeze(1)
    fused = names.fuse_qkv(q, k, v, LAYOUT).squeeze(1).tolist()
    want = [*range(0, 2 * d), *range(100, 100 + d), *range(200, 200 + d),
            *range(2 * d, 4 * d), *range(100 + d, 100 + 2 * d), *range(200 + d, 200 + 2 * d)]
    assert fused == [float(x) for x in want]
    assert all(torch.equal(a, b) for a, b in zip(names.split_qkv(names.fuse_qkv(q, k, v, LAYOUT), LAYOUT), (q, k, v)))


def test_fc1_is_gate_then_up() -> None:
    hf = hf_state()
    fc1 = names.hf_to_megatron(hf, LAYOUT)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:8], hf["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(fc1[8:], hf["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_shards_round_trip(tp: int) -> None:
    mg = names.hf_to_megatron(hf_state(), LAYOUT)
    for name, full in mg.items():
        parts = [names.shard(name, full, r, tp) for r in range(tp)]
        assert torch.equal(names.unshard(name, parts), full), name
    # Each rank's fc1 shard is its slice of gate followed by its slice of up (megatron's SwiGLU split).
    fc1 = mg["decoder.layers.0.mlp.linear_fc1.weight"]
    part = names.shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, 1, 2)
    assert torch.equal(part, torch.cat([fc1[4:8], fc1[12:16]]))
    # Row-parallel weights split along columns, norms are replicated.
    assert names.shard_dim("decoder.layers.0.self_attention.linear_proj.weight") == 1
    assert names.shard_dim("decoder.layers.0.mlp.linear_fc2.weight") == 1
    assert names.shard_dim("decoder.final_layernorm.weight") is None
    # A QKV shard holds whole query groups: rank 1 of 2 holds group 1 exactly.
    qkv = mg["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(names.shard("decoder.layers.0.self_attention.linear_qkv.weight", qkv, 1, 2), qkv[12:])


def test_pipeline_stage_names_get_their_layer_offset() -> None:
    local = "decoder.layers.0.mlp.linear_fc2.weight"
    assert names.with_layer_offset(local, 3) == "decoder.layers.3.mlp.linear_fc2.weight"
    assert names.with_layer_offset("output_layer.weight", 3) == "output_layer.weight"


def test_layout_from_hf_config_pads_the_vocabulary_for_tensor_parallel() -> None:
    cfg = {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 64, "intermediate_size": 672, "vocab_size": 264}
    assert names.LlamaLayout.from_hf_config(cfg).padded_vocab_size == 264
    assert names.LlamaLayout.from_hf_config(cfg, tensor_parallel=16).padded_vocab_size == 272
    assert names.LlamaLayout.from_hf_config(cfg).heads_per_group == 2


def test_unknown_names_are_refused() -> None:
    with pytest.raises(TrainerError, match="no Hugging Face name"):
        list(names.megatron_to_hf("decoder.layers.0.self_attention.linear_qkv.bias", torch.zeros(3), LAYOUT))
    hf = hf_state()
    del hf["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(TrainerError, match="k_proj"):
        names.hf_to_megatron(hf, LAYOUT)
    with pytest.raises(TrainerError, match="does not name"):
        names.hf_to_megatron({**hf_state(), "model.layers.0.self_attn.q_proj.bias": torch.zeros(12)}, LAYOUT)


QWEN2 = names.LlamaLayout(num_layers=2, hidden_size=12, num_heads=4, num_kv_heads=2, head_dim=3, ffn_hidden_size=8,
                          vocab_size=10, padded_vocab_size=12, qkv_bias=True, tied_embeddings=True)


def test_qwen2_biases_and_tied_embeddings_map_both_ways() -> None:
    hf = hf_state(QWEN2)
    del hf["lm_head.weight"]  # tied: the folder has the embedding only
    g = torch.Generator().manual_seed(1)
    for i in range(QWEN2.num_layers):
        for proj, rows in (("q", 12), ("k", 6), ("v", 6)):
            hf[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = torch.randn(rows, generator=g)
    mg = names.hf_to_megatron(hf, QWEN2)
    bias = mg["decoder.layers.0.self_attention.linear_qkv.bias"]
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv")
    # Grouped like the weight's rows: [q heads 0-1 | k_0 | v_0 | q heads 2-3 | k_1 | v_1].
    assert torch.equal(bias, torch.cat([q[:6], k[:3], v[:3], q[6:], k[3:], v[3:]]))
    assert torch.equal(names.shard("decoder.layers.0.self_attention.linear_qkv.bias", bias, 1, 2), bias[12:])
    # A pipeline's last stage starts its copy of the output layer from the embedding, and publishes none of it.
    assert torch.equal(mg["output_layer.weight"], mg["embedding.word_embeddings.weight"])
    back = {n: t for name, full in mg.items() for n, t in names.megatron_to_hf(name, full, QWEN2)}
    assert set(back) == set(hf) and all(torch.equal(back[n], hf[n]) for n in hf)
    assert names.LlamaLayout.from_hf_config({"model_type": "qwen2", "tie_word_embeddings": True,
                                             "num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 2,
                                             "intermediate_size": 8, "vocab_size": 10}).qkv_bias


def test_each_megatron_tensor_reads_only_the_hf_tensors_it_fuses() -> None:
    """A pipeline stage makes its tensors one at a time: nothing is read before it is asked for, and a fused
    QKV reads its layer's q, k and v alone (the backend's `HfWeights` reads each from the file on access)."""
    read: list[str] = []

    class Reading(dict):
        def __getitem__(self, name: str) -> torch.Tensor:
            read.append(name)
            return super().__getitem__(name)

    make = names.megatron_tensors(Reading(hf_state()), LAYOUT)
    assert read == []
    make["decoder.layers.1.self_attention.linear_qkv.weight"]()
    assert read == [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
