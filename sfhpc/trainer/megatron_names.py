"""One table between megatron-core's parameter names and the Hugging Face / vLLM names of a Llama or Qwen2 model.

megatron-core fuses what Llama keeps apart, and splits across tensor-parallel ranks what Llama keeps whole:

    megatron (per layer ``decoder.layers.N.``)       Hugging Face (per layer ``model.layers.N.``)
    input_layernorm.weight                           input_layernorm.weight
    self_attention.linear_qkv.weight                 self_attn.{q,k,v}_proj.weight   (fused, see below)
    self_attention.linear_proj.weight                self_attn.o_proj.weight
    pre_mlp_layernorm.weight                         post_attention_layernorm.weight
    mlp.linear_fc1.weight                            mlp.{gate,up}_proj.weight       ([gate; up])
    mlp.linear_fc2.weight                            mlp.down_proj.weight
    embedding.word_embeddings.weight                 model.embed_tokens.weight       (vocab padded)
    decoder.final_layernorm.weight                   model.norm.weight
    output_layer.weight                              lm_head.weight                  (vocab padded)
    self_attention.linear_qkv.bias                   self_attn.{q,k,v}_proj.bias     (Qwen2; fused like the weight)

Qwen2 is Llama with q/k/v biases; a model with tied embeddings (small Qwen2.5 and Llama 3.2 models) has no
``lm_head.weight``: megatron shares the embedding with the output layer, and a pipeline's last stage,
which keeps its own copy of it, starts from the embedding and publishes nothing of it.

With Transformer Engine's fused layer-norm linears (the usual GPU layer spec) the two norms live inside
the next linear: ``self_attention.linear_qkv.layer_norm_weight`` and ``mlp.linear_fc1.layer_norm_weight``.
Both spellings read; `hf_to_megatron` writes the one its ``fused_norms`` flag asks for.

Fused QKV. megatron groups the rows per key/value head ("query group"): for each group ``g`` the rows are
``[q heads of g | k_g | v_g]``, each head ``head_dim`` rows, so a column-parallel split along rows keeps
whole groups on one tensor-parallel rank. Hugging Face's query head ``h`` uses key/value head
``h // (heads / kv_heads)``, the same grouping.

Tensor parallelism. `shard` and `unshard` convert between a full tensor and rank ``r``'s part of it:
column-parallel weights (QKV, fc1, embeddings, output layer) split along rows, row-parallel ones
(``linear_proj``, ``linear_fc2``) along columns, norms are replicated. ``linear_fc1`` is the exception:
each rank holds ``[gate_r; up_r]``, so its full tensor is not the concatenation of the shards.

Everything here works on tensors in memory and with *global* layer numbers; a pipeline stage adds its
first layer's number to its local ones before asking.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from sfhpc.trainer.errors import TrainerError

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# megatron suffix inside a layer -> HF suffix inside a layer, for the tensors that map one to one.
_LAYER_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_QKV = "self_attention.linear_qkv.weight"
_QKV_BIAS = "self_attention.linear_qkv.bias"
_HF_QKV_BIAS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
_OUTPUT = "output_layer.weight"
_FC1 = "mlp.linear_fc1.weight"
_HF_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_HF_FC1 = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_GLOBAL = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_COLUMN_PARALLEL = (_QKV, _FC1, _QKV_BIAS)


@dataclasses.dataclass(frozen=True)
class LlamaLayout:
    """The sizes the mapping needs, read from a Hugging Face Llama or Qwen2 ``config.json``."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    qkv_bias: bool = False  # Qwen2's attention
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise TrainerError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads "
                               f"{self.num_kv_heads}")
        if self.padded_vocab_size < self.vocab_size:
            raise TrainerError(f"padded vocabulary {self.padded_vocab_size} is smaller than {self.vocab_size}")

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], *, tensor_parallel: int = 1) -> LlamaLayout:
        """From ``config.json`` fields; the vocabulary is padded to a multiple of `tensor_parallel` only."""
        heads = int(config["num_attention_heads"])
        vocab = int(config["vocab_size"])
        return cls(num_layers=int(config["num_hidden_layers"]), hidden_size=int(config["hidden_size"]),
                   num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
                   head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
                   ffn_hidden_size=int(config["intermediate_size"]), vocab_size=vocab,
                   padded_vocab_size=-(-vocab // tensor_parallel) * tensor_parallel,
                   qkv_bias=config.get("model_type") == "qwen2",
                   tied_embeddings=bool(config.get("tie_word_embeddings", False)))

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


# -- fused tensors ------------------------------------------------------------------------------------
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: LlamaLayout) -> torch.Tensor:
    """HF ``q_proj``, ``k_proj``, ``v_proj`` -> megatron's grouped ``linear_qkv`` (rows per query group)."""
    g, d, cols = layout.num_kv_heads, layout.head_dim, q.shape[-1]
    grouped = torch.cat([q.reshape(g, layout.heads_per_group * d, cols), k.reshape(g, d, cols),
                         v.reshape(g, d, cols)], dim=1)
    return grouped.reshape(-1, cols)


def split_qkv(qkv: torch.Tensor, layout: LlamaLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's ``linear_qkv`` -> HF ``(q_proj, k_proj, v_proj)``; the inverse of `fuse_qkv`."""
    g, d, cols = layout.num_kv_heads, layout.head_dim, qkv.shape[-1]
    q_rows = layout.heads_per_group * d
    if qkv.shape[0] != g * (q_rows + 2 * d):
        raise TrainerError(f"linear_qkv has {qkv.shape[0]} rows; {g} query groups of {layout.heads_per_group} "
                           f"heads x {d} need {g * (q_rows + 2 * d)}")
    q, k, v = qkv.reshape(g, q_rows + 2 * d, cols).split([q_rows, d, d], dim=1)
    return q.reshape(-1, cols), k.reshape(-1, cols), v.reshape(-1, cols)


def fuse_qkv_bias(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: LlamaLayout) -> torch.Tensor:
    """HF q/k/v biases -> megatron's ``linear_qkv.bias``: the rows of `fuse_qkv`, one column."""
    return fuse_qkv(q.unsqueeze(-1), k.unsqueeze(-1), v.unsqueeze(-1), layout).squeeze(-1)


def split_qkv_bias(qkv: torch.Tensor, layout: LlamaLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = split_qkv(qkv.unsqueeze(-1), layout)
    return q.squeeze(-1), k.squeeze(-1), v.squeeze(-1)


def _pad_vocab(t: torch.Tensor, layout: LlamaLayout) -> torch.Tensor:
    extra = layout.padded_vocab_size - t.shape[0]
    # Zero rows: the padded ids are never produced (their logits are masked) nor looked up.
    return torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra else t


# -- whole state dicts -------------------------------------------------------------------------------
def megatron_tensors(hf: Mapping[str, torch.Tensor], layout: LlamaLayout, *,
                     fused_norms: bool = False) -> dict[str, Callable[[], torch.Tensor]]:
    """How to make each full (unsharded) megatron tensor, global layer numbers, from an HF Llama or Qwen2 state
    dict: one function per megatron name, which reads only the HF tensors it fuses. A pipeline stage makes its
    own tensors one at a time from a mapping that reads each HF tensor when asked (the backend's
    `read_hf_weights`), so no rank ever holds the whole model. A name the layout does not know is refused at
    once (from the names alone)."""
    extra = set(hf) - set(_hf_names(layout))
    if extra:
        raise TrainerError(f"the model has tensors a {'Qwen2' if layout.qkv_bias else 'Llama'} layout does not "
                           f"name: {sorted(extra)[:3]}")

    def one(name: str, pad: bool = False) -> Callable[[], torch.Tensor]:
        return lambda: _pad_vocab(_take(hf, name), layout) if pad else _take(hf, name)

    def qkv(prefix: str, parts: tuple[str, ...], fuse: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
        return lambda: fuse(*(_take(hf, prefix + n) for n in parts), layout)

    def fc1(prefix: str) -> Callable[[], torch.Tensor]:
        return lambda: torch.cat([_take(hf, prefix + n) for n in _HF_FC1])

    out: dict[str, Callable[[], torch.Tensor]] = {}
    for mg, name in _GLOBAL.items():
        tied = mg == _OUTPUT and layout.tied_embeddings
        out[mg] = one("model.embed_tokens.weight" if tied else name, pad=mg in _VOCAB)
    norm_names = ({"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                   "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"} if fused_norms else
                  {"input_layernorm.weight": "input_layernorm.weight",
                   "post_attention_layernorm.weight": "pre_mlp_layernorm.weight"})
    for i in range(layout.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_suffix, mg_suffix in norm_names.items():
            out[mp + mg_suffix] = one(hp + hf_suffix)
        out[mp + "self_attention.linear_proj.weight"] = one(hp + "self_attn.o_proj.weight")
        out[mp + "mlp.linear_fc2.weight"] = one(hp + "mlp.down_proj.weight")
        out[mp + _QKV] = qkv(hp, _HF_QKV, fuse_qkv)
        out[mp + _FC1] = fc1(hp)
        if layout.qkv_bias:
            out[mp + _QKV_BIAS] = qkv(hp, _HF_QKV_BIAS, fuse_qkv_bias)
    return out


def hf_to_megatron(hf: Mapping[str, torch.Tensor], layout: LlamaLayout, *,
                   fused_norms: bool = False) -> dict[str, torch.Tensor]:
    """Every full (unsharded) megatron tensor at once (`megatron_tensors`, all made)."""
    return {name: make() for name, make in megatron_tensors(hf, layout, fused_norms=fused_norms).items()}


def megatron_to_hf(name: str, tensor: torch.Tensor, layout: LlamaLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF ``(name, tensor)`` pairs of one full megatron tensor (global layer number in `name`)."""
    if name in _GLOBAL:
        if name == _OUTPUT and layout.tied_embeddings:
            return  # the last stage's copy of the embedding: the engine has it as the embedding
        yield _GLOBAL[name], (tensor[:layout.vocab_size] if name in _VOCAB else tensor)
        return
    m = _LAYER.match(name)
    if m is None:
        raise TrainerError(f"no Hugging Face name for megatron parameter {name!r}")
    prefix, suffix = f"model.layers.{m.group(1)}.", m.group(2)
    if suffix in _LAYER_DIRECT:
        yield prefix + _LAYER_DIRECT[suffix], tensor
    elif suffix == _QKV:
        yield from ((prefix + n, t) for n, t in zip(_HF_QKV, split_qkv(tensor, layout)))
    elif suffix == _FC1:
        yield from ((prefix + n, t) for n, t in zip(_HF_FC1, tensor.chunk(2, dim=0)))
    elif suffix == _QKV_BIAS and layout.qkv_bias:
        yield from ((prefix + n, t) for n, t in zip(_HF_QKV_BIAS, split_qkv_bias(tensor, layout)))
    else:
        raise TrainerError(f"no Hugging Face name for megatron parameter {name!r}")


def _take(hf: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in hf:
        raise TrainerError(f"the Hugging Face weights lack {name!r}: not a Llama model of the expected layout")
    return hf[name]


def _hf_names(layout: LlamaLayout) -> list[str]:
    names = [n for mg, n in _GLOBAL.items() if not (mg == _OUTPUT and layout.tied_embeddings)]
    for i in range(layout.num_layers):
        names += [f"model.layers.{i}.{s}" for s in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                                      "self_attn.o_proj.weight", "mlp.down_proj.weight",
                                                      *_HF_QKV, *_HF_FC1, *(_HF_QKV_BIAS if layout.qkv_bias else ()))]
    return names


# -- layer numbers of a pipeline stage ---------------------------------------------------------------
def with_layer_offset(name: str, offset: int) -> str:
    """A stage-local megatron name (``decoder.layers.<local>.``) with its global layer number."""
    m = _LAYER.match(name)
    return f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m and offset else name


# -- tensor parallelism --------------------------------------------------------------------------------
def shard_dim(name: str) -> int | None:
    """The dimension megatron splits `name` along across tensor-parallel ranks (None: replicated)."""
    m = _LAYER.match(name)
    suffix = m.group(2) if m else name
    if suffix in _ROW_PARALLEL:
        return 1
    if suffix in _COLUMN_PARALLEL or name in _VOCAB:
        return 0
    return None


def shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Tensor-parallel rank `rank`'s part of the full megatron tensor `name`."""
    dim = shard_dim(name)
    if dim is None or size == 1:
        return full
    if name.endswith(_FC1):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    return full.chunk(size, dim=dim)[rank]


def unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full megatron tensor `name` from every tensor-parallel rank's part, in rank order."""
    dim = shard_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith(_FC1):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=dim)
