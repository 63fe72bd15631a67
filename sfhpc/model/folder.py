"""What a policy folder (a recipe's ``model.path``) must hold for the engines and the trainer to load it:
a Hugging Face model folder, with ``config.json`` and the weights. Checked before any job starts, since
a folder that lacks them would otherwise be found out by each rank on its own, deep in vLLM or torch."""

from __future__ import annotations

from pathlib import Path

WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")  # what transformers and vLLM load weights from


def model_folder_problem(path: Path) -> str | None:
    """What is wrong with `path` as a model folder, as the end of a sentence about it; None when it has
    what a model folder needs."""
    if not path.exists():
        return "does not exist"
    if not path.is_dir():
        return "is not a folder (model.path names the folder that holds config.json and the weights)"
    if not (path / "config.json").is_file():
        return "has no config.json (is it a Hugging Face model folder?)"
    if not any(next(path.glob(pattern), None) is not None for pattern in WEIGHT_FILES):
        return f"has no weights ({' or '.join(WEIGHT_FILES)})"
    return None
