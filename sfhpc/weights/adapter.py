"""A LoRA adapter as a weight update: only the adapter travels, and each receiver merges it into the model
folder's frozen weights of the layers it targets.

An adapter version is a stream of ``<module>.lora_down`` (LoRA's ``A``, rank x in) and ``<module>.lora_up``
(``(alpha / rank) * B``, out x rank) tensors, ``<module>`` in the model's Hugging Face names
(``model.layers.0.self_attn.q_proj``); the scale is folded into ``up`` so a receiver needs nothing but the
stream and the model folder its engine started from. A rank-8 adapter on every linear layer of a 7B is 20M
parameters, 0.3% of the bytes of the model, where a merged update sends all of them.

Each receiver merges rather than serving the adapter beside the base model (vLLM's ``LoRARequest``): every
version then lands in the engine as a plain in-place reload, so the engine switches versions at one token
boundary exactly as with full updates (a ``LoRARequest`` is bound to a request when it starts, and a reply
that spans an update would go on with its first version's adapter), and generation pays no per-token
adapter cost (vLLM's LoRA kernels add work to every decode step; a merge costs one ``up @ down`` per layer
per version). The price is host memory: `AdapterMerge` keeps the targeted layers' frozen weights, in the
engine's dtype, to merge each version into.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from sfhpc.weights.errors import WeightStreamError
from sfhpc.weights.hf_weights import HfWeights
from sfhpc.weights.manifest import module_group

DOWN, UP = ".lora_down", ".lora_up"

Deltas = Mapping[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (down, up): the layer's weight gains up @ down


def is_adapter(names: Iterable[str]) -> bool:
    """True when a version's tensor names are an adapter's (`DOWN` and `UP` tensors, nothing else)."""
    names = list(names)
    return bool(names) and all(n.endswith((DOWN, UP)) for n in names)


def wire(deltas: Deltas) -> Iterator[tuple[str, torch.Tensor]]:
    """`deltas` as the tensors of an adapter version."""
    for module, (down, up) in deltas.items():
        yield f"{module}{DOWN}", down
        yield f"{module}{UP}", up


def deltas_of(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """An adapter version's tensors (`wire`) back as deltas by module (the tensors are taken as they are: copy
    views of a receive buffer first)."""
    downs: dict[str, torch.Tensor] = {}
    ups: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        if name.endswith(DOWN):
            downs[name.removesuffix(DOWN)] = tensor
        elif name.endswith(UP):
            ups[name.removesuffix(UP)] = tensor
        else:
            raise WeightStreamError(f"an adapter version holds {name!r}, which is no adapter tensor")
    if downs.keys() != ups.keys():
        odd = sorted(downs.keys() ^ ups.keys())
        raise WeightStreamError(f"an adapter version holds one half of the layer {odd[0]!r}'s adapter")
    return {module: (downs[module], ups[module]) for module in downs}


def merge(weight: torch.Tensor, down: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``weight + up @ down``, computed in float32 on the weight's device."""
    delta = up.to(device=weight.device, dtype=torch.float32) @ down.to(device=weight.device, dtype=torch.float32)
    return weight.float() + delta


def merged(weights: Iterable[tuple[str, torch.Tensor]], deltas: Deltas) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of `weights` with `deltas` merged where they target the layer (float32 there), the
    tensor as it is elsewhere."""
    for name, tensor in weights:
        delta = deltas.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
        yield name, tensor if delta is None else merge(tensor, *delta)


class AdapterMerge:
    """An engine's side of adapter updates: the frozen weights of the layers an adapter targets, read once from
    `model_dir` (the folder the engine started from) and kept in host memory in `dtype`, and each version merged
    into them on `device` (where the engine's weights are: a GPU worker merges there, one layer group at a time)."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype, device: torch.device | None = None) -> None:
        self.model_dir, self.dtype, self.device = Path(model_dir), dtype, device or torch.device("cpu")
        self._folder: HfWeights | None = None
        self._frozen: dict[str, torch.Tensor] = {}

    def weights(self, deltas: Deltas) -> Iterator[tuple[str, torch.Tensor]]:
        """The merged weight of every layer `deltas` targets, in the engine's dtype, one layer at a time."""
        for module, (down, up) in deltas.items():
            name = f"{module}.weight"
            yield name, merge(self._frozen_weight(name).to(self.device), down, up).to(self.dtype)

    def loads(self, deltas: Deltas, max_bytes: int = 32 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """`weights` in loads of about `max_bytes` that never split a module group (an engine fuses the
        projections of one attention or MLP block), so that an engine holds one load's merged copies at a time."""
        load: list[tuple[str, torch.Tensor]] = []
        size, last = 0, None
        for name, tensor in self.weights(deltas):
            key = module_group(name)
            if load and key != last and size >= max_bytes:
                yield load
                load, size = [], 0
            load.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            last = key
        if load:
            yield load

    def _frozen_weight(self, name: str) -> torch.Tensor:
        if name not in self._frozen:
            if self._folder is None:
                self._folder = HfWeights(self.model_dir)
            if name not in self._folder:
                raise WeightStreamError(f"the adapter targets {name!r}, which {self.model_dir} does not hold")
            self._frozen[name] = self._folder.stored(name).to(self.dtype)
        return self._frozen[name]
