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
    return _architecture_problem(config, backend) or _tokenizer_problem(path)


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
