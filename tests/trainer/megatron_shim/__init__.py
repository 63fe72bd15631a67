"""Test-only: run megatron-core's CUDA-only code paths on a CPU-only torch build.

megatron-core is sfhpc's GPU training backend. It builds its model on the CPU
(``use_cpu_initialization=True``), but forward, DDP, the optimizer and gradient clipping name the CUDA
device in some thirty places (``device="cuda"``, ``.cuda()``, ``torch.cuda.current_device()``). This shim
sends all of them to the CPU so the tests can check the backend's *wiring* — model built from a recipe,
weights loaded from the Hugging Face folder, the training step, the weight-name mapping, data
parallelism — on machines without a GPU. It proves nothing about speed, and it lives under ``tests/``
only: the package never imports it.

What it does, while active (`cpu_shim` for a block, `activate` for the life of a process):
- a `TorchFunctionMode` rewrites every CUDA device argument of a torch call to ``cpu`` (and turns
  ``Tensor.cuda()`` / ``Tensor.to(<cuda>)`` into no-ops);
- ``Tensor.type()`` names the CUDA tensor type (gradient clipping asserts it);
- ``torch.cuda.current_device()`` answers 0 and ``torch.cuda.synchronize()`` does nothing;
- megatron's RNG tracker is the inference one (no CUDA generators), and the CUDA generator state that
  activation recompute saves and restores around each recomputed layer is an empty tensor;
- the backend's CUDA requirement (`REQUIRE_CUDA`) is lifted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA ordinal in torch's device arguments.
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch calls to the CPU."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda,):
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Gradient clipping asserts its gradients are 'torch.cuda.FloatTensor'; answer as a GPU would.
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if func is torch.Tensor.to:
            args = tuple(_CPU if _is_cuda(a) else a for a in args)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_shim() -> Iterator[None]:
    """The shim for the duration of a ``with`` block (a test module), undone afterwards."""
    from megatron.core.tensor_parallel import random as mp_random

    from sfhpc.trainer import megatron_backend

    saved = torch.cuda.current_device, torch.cuda.synchronize, megatron_backend.REQUIRE_CUDA
    saved_rng = mp_random._get_cuda_rng_state, mp_random._set_cuda_rng_state
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]  # CPU ops are synchronous
    megatron_backend.REQUIRE_CUDA = False
    # Recompute replays a layer under the RNG state of its first pass; the CPU generator is saved by megatron
    # itself, and there is no CUDA one (dropout is 0 in these models anyway).
    mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    # The autograd engine runs a recomputed layer's backward outside the ``with`` block's function mode.
    saved_backward = mp_random.CheckpointFunction.backward

    def backward_on_cpu(ctx: Any, *grads: Any) -> Any:
        with CudaToCpu():
            return saved_backward(ctx, *grads)

    mp_random.CheckpointFunction.backward = staticmethod(backward_on_cpu)  # type: ignore[method-assign]
    # The inference tracker forks no CUDA generator; the backend's later model_parallel_cuda_manual_seed
    # finds a tracker already set up and only resets it. Dropout is 0, so no draw depends on it.
    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    try:
        with CudaToCpu():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize, megatron_backend.REQUIRE_CUDA = saved
        mp_random._get_cuda_rng_state, mp_random._set_cuda_rng_state = saved_rng
        mp_random.CheckpointFunction.backward = saved_backward  # type: ignore[method-assign]


_process_shim: contextlib.AbstractContextManager[None] | None = None


def activate() -> None:
    """Install the shim for the rest of the process (rank programs under mpiexec)."""
    global _process_shim
    if _process_shim is None:
        # Held in a global: a collected generator would run its `finally` and undo the shim.
        _process_shim = cpu_shim()
        _process_shim.__enter__()
