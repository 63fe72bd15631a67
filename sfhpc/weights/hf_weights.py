"""A model folder's weights by name, read from its safetensors files one tensor at a time.

Used where a whole model must not be held at once: a megatron rank takes its stage's tensors only, a LoRA
export merges the adapter into the folder's weights as it writes them, and a rollout rank merges each adapter
version into the layers it targets (`sfhpc.weights.adapter`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from sfhpc.weights.errors import ModelFolderError


class HfWeights(Mapping[str, torch.Tensor]):
    """The tensors of a folder's safetensors files by name, each read (as float32) when asked for: a rank
    takes only its pipeline stage's, one fused tensor at a time (`load_hf_weights`), so its host memory never
    holds the whole model (a 7B's 30 GB in float32)."""

    def __init__(self, model_dir: str | Path) -> None:
        from safetensors import safe_open

        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise ModelFolderError(f"{model_dir}: no .safetensors weights to start from")
        self._file: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                self._file.update(dict.fromkeys(handle.keys(), f))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.stored(name).to(torch.float32)

    def stored(self, name: str) -> torch.Tensor:
        """The tensor `name` in the dtype the folder stores it in."""
        from safetensors import safe_open

        with safe_open(str(self._file[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)
