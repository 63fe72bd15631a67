"""Parameters, gradients and optimizer state sharded over the trainer ranks (torch FSDP2, ``fully_shard``).

Unsharded, every trainer rank holds the whole model in float32, its gradients and Adam's two moments: 16
bytes a parameter, 112 GiB for a 7B. ``fully_shard`` splits each of them by rows over the ranks (a rank
holds 16/N bytes a parameter) and gathers one decoder layer's weights at a time, in the compute dtype, for
its forward and again for its backward; gradients are reduce-scattered back to their shards in float32.
The same code runs on GPUs (NCCL) and on CPUs (gloo), so the CPU tests run what a GPU cluster runs.

Each rank loads only its shard: the model is built with its parameters on the meta device (no memory),
sharded, given empty storage on the rank's device, and every parameter's rows are read from the folder's
safetensors by slice (``safe_open(...).get_slice``), so no rank ever holds the whole model, not even on the
host. Buffers (the rotary embedding's frequencies) are computed on the host at construction, as the model
would, since they are small and not in the weights files.

Mixed precision: the master weights (and Adam's state) stay float32; the gathered copy a layer computes with
is bf16 (`MixedPrecisionPolicy`), and gradients are reduced in float32. RL's updates are small (a learning
rate of 1e-6 moves a weight of 0.02 by about 1e-6, below bf16's resolution of 1e-4 there): kept in bf16
they would round away; in float32 they add up.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from sfhpc.trainer.errors import TrainerError


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no storage) and their buffers as usual."""
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":  # one already there (a tied weight) stays itself
            held = module._parameters[name]
            assert held is not None
            module._parameters[name] = torch.nn.Parameter(held.to("meta"), requires_grad=held.requires_grad)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def empty_model(model_dir: Path) -> Any:
    """The folder's causal LM (float32, no cache) with its parameters on the meta device and its buffers built."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers before 5.x kept it here
        from transformers.modeling_utils import no_init_weights  # type: ignore[no-redef,attr-defined]

    config = AutoConfig.from_pretrained(model_dir)
    config.use_cache = False
    with no_init_weights(), parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # a tie made on the meta device does not hold: made again, the head is the embedding
    return model


def materialize(root: torch.nn.Module, lm: torch.nn.Module, device: torch.device) -> None:
    """Give `root`'s (sharded) parameters empty storage on `device`, keeping the buffers `lm` computed."""
    buffers = {name: b.clone() for name, b in lm.named_buffers()}
    root.to_empty(device=device)
    with torch.no_grad():
        for name, b in lm.named_buffers():
            b.copy_(buffers[name])


def layer_modules(lm: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks (decoder layers), as transformers names them in ``_no_split_modules``:
    each becomes one unit of gathering."""
    names = set(getattr(lm, "_no_split_modules", None) or ())
    layers = [m for m in lm.modules() if type(m).__name__ in names]
    if not layers:
        raise TrainerError(f"{type(lm).__name__}: no decoder layers found to shard (the model names none in "
                           "_no_split_modules); train it with training.sharding: none")
    return layers


def shard(root: torch.nn.Module, lm: torch.nn.Module, mesh: Any, compute_dtype: torch.dtype | None) -> None:
    """`fully_shard` every decoder layer of `lm`, then `root` (the rest: embeddings, final norm, output layer)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in layer_modules(lm):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(root, mesh=mesh, mp_policy=policy)


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Parameter name -> the safetensors file holding it (one file, or several listed by the index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        mapping = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in mapping.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise TrainerError(f"{model_dir}: no model.safetensors (or index): sharded loading reads safetensors")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 - safe_open is not a mapping


def load_shards(lm: torch.nn.Module, model_dir: Path) -> None:
    """Fill each parameter of `lm` (sharded by rows, or whole) with its rows from the folder's safetensors."""
    from safetensors import safe_open

    files = weight_files(model_dir)
    opened: dict[Path, Any] = {}
    try:
        for name, param in lm.named_parameters():
            source = files.get(name)
            if source is None:
                raise TrainerError(f"{model_dir}: the weights files hold no '{name}'")
            if source not in opened:
                opened[source] = safe_open(str(source), framework="pt")  # noqa: SIM115 - closed below
            piece = opened[source].get_slice(name)
            local, start = local_rows(param)
            full_shape = tuple(piece.get_shape())
            if full_shape != tuple(param.shape):
                raise TrainerError(f"{source}: '{name}' has shape {full_shape}, the model's config says "
                                   f"{tuple(param.shape)}")
            if local.numel():
                with torch.no_grad():
                    local.copy_(piece[start:start + local.shape[0]])
    finally:
        for handle in opened.values():
            close = getattr(handle, "__exit__", None)
            if close is not None:
                close(None, None, None)


def local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's part of `param` and the first row it holds: a DTensor sharded on dim 0 holds rows
    ``[start, start + n)`` with ``torch.chunk``'s split; a plain tensor holds all of them."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.data, 0
    local = param.to_local()
    mesh = param.device_mesh
    rows = param.shape[0]
    per_rank = -(-rows // mesh.size())
    return local, min(per_rank * mesh.get_local_rank(), rows)


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole of `param` (collective on every rank of its mesh for a DTensor; itself otherwise)."""
    from torch.distributed.tensor import DTensor

    return param.full_tensor() if isinstance(param, DTensor) else param
