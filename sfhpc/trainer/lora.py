"""LoRA on the torch backend (``model.lora``; Hu et al. 2021), through PEFT.

PEFT injects its LoRA layers into the Hugging Face model in place: a targeted linear layer becomes
``base_layer`` (the frozen weight) beside ``lora_A`` and ``lora_B``, and computes
``W x + (alpha / rank) * B (A dropout(x))``. Only ``A`` and ``B`` require gradients, so Adam's state and the
gradients are the adapter's alone; the frozen weights are kept once, in the compute dtype (bf16 on a GPU:
half of float32 master weights, and nothing to cast per step). A KL term needs no copy of the starting policy:
it is the same model with the adapter switched off (`reference_mode`).

Everything that leaves the trainer is in one of two forms, each made here once:

* the adapter's state, in PEFT's names (``base_model.model.<module>.lora_A.weight``): what a checkpoint
  holds, and what an adapter folder (`write_adapter_folder`) holds for PEFT, vLLM and others to load;
* what each targeted layer gains, ``scale * B A``, by module in the model's own names (`deltas`): what a weight
  update sends (`sfhpc.weights.adapter`; each engine merges it into its frozen weights), and, merged into the
  model's weights (`merged`), what ``sfhpc export`` writes and what an engine sharing the trainer's rank loads,
  from the trainer's live model or from a checkpoint's adapter over the model folder's weights alike.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from sfhpc.config.recipe import LoraSpec
from sfhpc.weights import adapter as weight_adapter

PEFT_PREFIX = "base_model.model."  # the adapter state's names: the model's own module names under this
BASE_LAYER = ".base_layer"  # PEFT's frozen linear inside a LoRA layer


def config(spec: LoraSpec, base_model: str | None = None) -> Any:
    """PEFT's ``LoraConfig`` of `spec` (causal LM, no bias training)."""
    from peft import LoraConfig

    targets = list(spec.target_modules) if isinstance(spec.target_modules, tuple) else spec.target_modules
    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets,
                      bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model)


def attach(model: torch.nn.Module, spec: LoraSpec, frozen_dtype: torch.dtype | None) -> Any:
    """Inject `spec`'s adapter into `model` (in place; the PEFT model around it is returned): the adapter in
    float32, every other weight frozen, in `frozen_dtype` where given (the compute dtype)."""
    from peft import get_peft_model

    peft_model = get_peft_model(model, config(spec))
    if frozen_dtype is not None:
        for param in model.parameters():
            if not param.requires_grad:
                param.data = param.data.to(frozen_dtype)
    return peft_model


def adapter_state(peft_model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors in PEFT's names (detached, on the CPU)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu() for k, v in get_peft_model_state_dict(peft_model).items()}


def load_adapter_state(peft_model: Any, state: Mapping[str, torch.Tensor]) -> None:
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(peft_model, dict(state))
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"its adapter has tensors this model has no place for: {', '.join(unexpected[:3])}")


def reference_mode(peft_model: Any) -> contextlib.AbstractContextManager[object]:
    """The starting policy: the model with its adapter switched off, for as long as the context lasts."""
    return peft_model.disable_adapter()  # type: ignore[no-any-return]


def frozen_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's own weights under their Hugging Face names, without the adapter's."""
    for name, param in model.named_parameters():
        if ".lora_" not in name:
            yield name.replace(BASE_LAYER, ""), param.detach()


def deltas(adapter: Mapping[str, torch.Tensor], scale: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter's state (PEFT's names) as what each targeted layer gains, ``scale * B A``, by module in the
    model's own names (`sfhpc.weights.adapter`: what an adapter weight update sends)."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, a in adapter.items():
        if name.endswith(".lora_A.weight"):
            module = name.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
            out[module] = (a, scale * adapter[name.replace(".lora_A.", ".lora_B.")])
    return out


def merged(weights: Iterator[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
           adapter: Mapping[str, torch.Tensor], scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of `weights` (Hugging Face names) with the adapter merged: ``W + scale * B A`` in float32
    where the adapter targets the layer, the tensor as it is elsewhere."""
    return weight_adapter.merged(weights.items() if isinstance(weights, Mapping) else weights,
                                 deltas(adapter, scale))


def write_adapter_folder(folder: Path, spec: LoraSpec, adapter: Mapping[str, torch.Tensor],
                         base_model: str) -> list[str]:
    """An adapter folder PEFT (``PeftModel.from_pretrained``) and vLLM (``LoRARequest``) load:
    ``adapter_config.json`` and ``adapter_model.safetensors``."""
    from safetensors.torch import save_file

    config(spec, base_model).save_pretrained(str(folder))
    save_file({k: v.contiguous() for k, v in adapter.items()}, str(folder / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    return ["adapter_config.json", "adapter_model.safetensors"]


def spec_of(state: Mapping[str, Any]) -> LoraSpec | None:
    """The `LoraSpec` a checkpoint's trainer state was trained with (None: full fine-tuning)."""
    saved = state.get("lora")
    if saved is None:
        return None
    saved = dict(saved)
    if isinstance(saved.get("target_modules"), list):
        saved["target_modules"] = tuple(saved["target_modules"])
    return LoraSpec(**saved)


def describe(spec: LoraSpec, trainable: int, total: int) -> str:
    targets = spec.target_modules if isinstance(spec.target_modules, str) else json.dumps(spec.target_modules)
    return (f"LoRA rank {spec.rank}, alpha {spec.alpha} on {targets or 'PEFT defaults'}: {trainable:,} of "
            f"{total:,} parameters train ({100 * trainable / max(total, 1):.2f}%)")
