"""What a policy folder (a recipe's ``model.path``) must hold for the engines, the endpoint and the trainer
to load it: a Hugging Face causal-LM folder with ``config.json``, the weights, a tokenizer and a chat
template, of an architecture that vLLM, transformers and the training backend all support.

Checked before any job starts, since a folder that lacks any of it would otherwise be found out by each
rank on its own, deep in vLLM or torch, after the allocation was granted.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

from sfhpc.engine.hf_tokenizer import CHAT_TEMPLATE_FILES, read_chat_template
from sfhpc.engine.tokenizer import HF_TOKENIZER_FILES, tokenizer_kind

WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")  # what transformers and vLLM load weights from
# Architectures whose weights the megatron backend maps (sfhpc.trainer.megatron_names).
MEGATRON_MODEL_TYPES = ("llama", "qwen2")


def model_folder_problem(path: Path, *, backend: str = "torch") -> str | None:
    """What is wrong with `path` as a model folder, as the end of a sentence about it; None when it has
    what a model folder needs. `backend` is the recipe's training backend (``torch`` or ``megatron``)."""
    if not path.exists():
        return "does not exist"
    if not path.is_dir():
        return "is not a folder (model.path names the folder that holds config.json and the weights)"
    if not (path / "config.json").is_file():
        return "has no config.json (is it a Hugging Face model folder?)"
    if not any(next(path.glob(pattern), None) is not None for pattern in WEIGHT_FILES):
        return f"has no weights ({' or '.join(WEIGHT_FILES)})"
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"has a config.json that is not JSON ({exc})"
    if not isinstance(config, dict):
        return "has a config.json that is not a JSON object"
    return _architecture_problem(config, backend) or _weights_problem(path, config) or _tokenizer_problem(path)


def safetensors_header(file: Path) -> dict[str, Any]:
    """The header of a safetensors file (name -> dtype, shape, offsets), read without loading a tensor; ValueError
    naming what is wrong with a file that is not one (empty, cut short, not JSON)."""
    size = file.stat().st_size
    if size == 0:
        raise ValueError("is empty (0 bytes)")
    with file.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= size - 8:
            raise ValueError(f"is not a safetensors file (its {size} bytes hold no header)")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise ValueError("is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError("is not a safetensors file (its header is not a JSON object)")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    if 8 + length + end > size:
        raise ValueError(f"is cut short: its header describes {8 + length + end} bytes, the file has {size}")
    return tensors


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape of each weight a Llama-family decoder (Llama, Qwen2, Mistral, ...) of `config` holds, under
    its Hugging Face name; empty when the config says too little to tell."""
    from sfhpc.plan.memory import ModelShape

    try:
        shape = ModelShape.from_config(config)
    except ValueError:
        return {}
    h, q, kv, i = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    want: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab, h), "model.norm.weight": (h,)}
    if not shape.tied:
        want["lm_head.weight"] = (shape.vocab, h)
    for layer in range(shape.layers):
        at = f"model.layers.{layer}."
        want |= {at + "self_attn.q_proj.weight": (q, h), at + "self_attn.k_proj.weight": (kv, h),
                 at + "self_attn.v_proj.weight": (kv, h), at + "self_attn.o_proj.weight": (h, q),
                 at + "mlp.gate_proj.weight": (i, h), at + "mlp.up_proj.weight": (i, h),
                 at + "mlp.down_proj.weight": (h, i), at + "input_layernorm.weight": (h,),
                 at + "post_attention_layernorm.weight": (h,)}
    return want


def _weights_problem(path: Path, config: dict[str, Any]) -> str | None:
    """An empty or cut-short weights file, or safetensors whose names and shapes do not fit config.json."""
    for file in sorted(path.glob("pytorch_model*.bin")):
        if file.stat().st_size == 0:
            return f"has an empty weights file {file.name} (0 bytes)"
    files = sorted(path.glob("*.safetensors"))
    held: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in files:
        try:
            header = safetensors_header(file)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"has a weights file {file.name} that {exc}"
        held |= {name: (file.name, tuple(int(n) for n in entry["shape"])) for name, entry in header.items()}
    if not files or config.get("model_type") not in ("llama", "qwen2", "qwen3", "mistral"):
        return None  # other families name their weights otherwise: vLLM's and transformers' loaders judge them
    want = expected_shapes(config)
    for name, shape in want.items():
        if name not in held:
            return f"holds no '{name}' in its safetensors, which config.json's model needs"
        holder, found = held[name]
        if found != shape:
            return (f"has '{name}' of shape {list(found)} in {holder}, where config.json's model has {list(shape)}: "
                    "the weights and the config are of different models")
    return None


def _architecture_problem(config: dict[str, Any], backend: str) -> str | None:
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    if not architectures or not isinstance(architectures, list) or not model_type:
        return "has a config.json without 'architectures' and 'model_type' (is it a Hugging Face causal LM?)"
    architecture = str(architectures[0])
    if str(model_type) not in transformers_causal_lm_types():
        return (f"holds a {architecture} model (model_type {model_type!r}), which transformers cannot load as "
                "a causal LM (AutoModelForCausalLM)")
    served = vllm_architectures()
    if served is not None and architecture not in served:
        return f"holds a {architecture} model, which vLLM cannot serve (not among its text-generation models)"
    if backend == "megatron" and model_type not in MEGATRON_MODEL_TYPES:
        return (f"holds a {architecture} model; the megatron backend trains {' and '.join(MEGATRON_MODEL_TYPES)} "
                "models only (use training.backend: torch)")
    return None


def _tokenizer_problem(path: Path) -> str | None:
    empty = [name for name in HF_TOKENIZER_FILES if (path / name).is_file() and (path / name).stat().st_size == 0]
    if empty:
        return f"has an empty tokenizer file {empty[0]} (0 bytes); save the model's tokenizer again"
    kind = tokenizer_kind(path)
    if kind is None:
        return (f"has no tokenizer ({' or '.join(HF_TOKENIZER_FILES)}); save the model's tokenizer into the "
                "folder (tokenizer.save_pretrained)")
    if kind == "hf" and not has_chat_template(path):
        return ("has a tokenizer without a chat template (no chat_template in tokenizer_config.json, no "
                f"{' or '.join(CHAT_TEMPLATE_FILES)}); agents' chat messages need the model's own template")
    return None


def has_chat_template(path: Path) -> bool:
    try:
        return bool(read_chat_template(path))
    except (OSError, ValueError, AttributeError):
        return False


@functools.cache
def transformers_causal_lm_types() -> frozenset[str]:
    """The ``model_type`` values ``AutoModelForCausalLM`` builds."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@functools.cache
def vllm_architectures() -> frozenset[str] | None:
    """The architectures vLLM serves natively as text generators, read from its model registry's source
    (importing vLLM takes seconds and starts its platform detection); None where vLLM is not installed here
    (a login node that only submits) or its registry cannot be read."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    registry = Path(next(iter(spec.submodule_search_locations))) / "model_executor" / "models" / "registry.py"
    try:
        tree = ast.parse(registry.read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_TEXT_GENERATION_MODELS"
                                                for t in node.targets) and isinstance(node.value, ast.Dict):
            return frozenset(k.value for k in node.value.keys
                             if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return None
