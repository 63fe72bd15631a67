"""Test-only: puts the CPU shim (`tests.trainer.megatron_shim`) into every process started with this folder
on ``PYTHONPATH`` that imports the megatron backend, so that ``sfhpc run`` with ``training.backend: megatron``
runs its trainer ranks on a CPU machine. The launcher passes its environment to the ranks, so a test sets
``PYTHONPATH=<this folder>:<project>`` for the command line and nothing in the package changes.

Only the ranks that import `sfhpc.trainer.megatron_backend` get the shim (the controller and rollout ranks
never do), and they get it as soon as that module has run: before any trainer is built.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

BACKEND = "sfhpc.trainer.megatron_backend"


class _ShimAfterBackendImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if name != BACKEND:
            return None
        sys.meta_path.remove(self)  # once per process
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def run_then_shim(module: ModuleType) -> None:
            run_module(module)
            sys.modules[name] = module  # the shim imports the backend to lift its CUDA requirement
            from tests.trainer.megatron_shim import activate

            activate()

        spec.loader.exec_module = run_then_shim  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _ShimAfterBackendImport())
