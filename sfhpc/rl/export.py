"""The trained policy out of a run: a Hugging Face folder that transformers, vLLM or any serving stack loads.

    sfhpc export RUN [--step N] --out DIR [--dtype bfloat16|float32]

A run's checkpoints hold the trainer's state in sfhpc's own layout (`sfhpc.rl.checkpoints`): the torch backend's
model under its Hugging Face names, whole (gathered from the ranks that shard it); the megatron backend's in
megatron's names, one file per tensor x pipeline parallel rank. The export takes a checkpoint (the newest sound
one, or that of step N), merges the megatron parts (`sfhpc.trainer.megatron_names`: shards joined, stages'
layers numbered globally, fused q/k/v and gate/up split) or, for a LoRA run (``model.lora``), merges its
adapter into the model folder's weights (`sfhpc.trainer.lora`), and writes:

* the weights as safetensors in `dtype` (bf16 by default, as the engines serve them), in files of at most
  5 GB with an index where there are several, a tied output layer once (as the embedding);
* ``config.json`` (the run's model's, its dtype set), the tokenizer, the chat template and
  ``generation_config.json``, copied from the model folder the run trained (the one its store names);
* ``sfhpc_export.json``: the run, the step and the policy version it holds.

With ``--adapter`` (LoRA runs) it writes the adapter alone as a PEFT adapter folder instead
(``adapter_config.json``, ``adapter_model.safetensors`` in `dtype`, the tokenizer and chat template beside
them), which PEFT's ``PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load over the model it names.

The folder is written beside `--out` under a temporary name and renamed into place: a cut export leaves no
half folder, and an existing folder is never overwritten.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from sfhpc.errors import SfhpcError
from sfhpc.rl.checkpoints import CheckpointCorrupt, CheckpointInfo, RunCheckpoints, verify
from sfhpc.rundir import RunPaths

SHARD_BYTES = 5 * 10**9  # per safetensors file, as transformers writes them
# What a model folder holds besides its weights and config: copied as they are.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack")
DTYPES = ("bfloat16", "float32", "float16")


class ExportError(SfhpcError):
    """The export cannot be made (no checkpoint, a missing model folder, an existing output)."""


def split_checkpoint_path(path: Path) -> tuple[Path, int | None]:
    """A run folder, or one of its checkpoint folders (``RUN/checkpoints/step-N``), as (run folder, step)."""
    name = path.name.split(".")[0]
    if path.parent.name == "checkpoints" and name.startswith("step-") and name[5:].isdigit():
        return path.parent.parent, int(name[5:])
    return path, None


def find_checkpoint(run_dir: Path, step: int | None = None) -> CheckpointInfo:
    """The newest sound checkpoint of `run_dir`, or the one of `step`."""
    checkpoints = RunCheckpoints(run_dir)
    if step is None:
        info = checkpoints.latest()
        if info is None:
            raise ExportError(f"{run_dir}: no complete checkpoint in {RunPaths(run_dir).checkpoints} (a run writes "
                              "one at its end, at a stop, and every training.checkpoint_every steps)")
        return info
    found = [p for p in checkpoints.folders() if p.name.split(".")[0] == f"step-{step:06d}"]
    if not found:
        steps = sorted({int(p.name.split("-")[1].split(".")[0]) for p in checkpoints.folders()})
        raise ExportError(f"{run_dir}: no checkpoint of step {step} (checkpoints: steps "
                          f"{', '.join(map(str, steps)) or 'none'})")
    try:
        return verify(found[-1])
    except CheckpointCorrupt as exc:
        raise ExportError(str(exc)) from None


def trained_model_dir(run_dir: Path) -> Path:
    """The model folder the run trained: the one its store names, else the one it built in its folder."""
    paths = RunPaths(run_dir)
    if paths.store.is_file():
        from sfhpc.data.store_reader import open_store

        with open_store(paths.store) as reader:
            named = reader.run_metadata.get("model")
        if named and (Path(named) / "config.json").is_file():
            return Path(named)
    if (paths.model / "config.json").is_file():
        return paths.model
    raise ExportError(f"{run_dir}: the model folder this run trained is gone (its tokenizer and config are "
                      "copied into the export)")


def hf_weights(info: CheckpointInfo, config: dict[str, Any], source: Path, state: dict[str, Any]) -> dict[str, Any]:
    """The whole model of the checkpoint `info` (its trainer `state`) under Hugging Face names (float32, as
    trained); a LoRA checkpoint's adapter merged into `source`'s weights."""
    from sfhpc.trainer import lora

    if state.get("backend") == "megatron":
        return _merged_megatron(info.trainer_file, state, config)
    spec = lora.spec_of(state)
    if spec is not None:
        from sfhpc.weights.hf_weights import HfWeights

        weights = dict(lora.merged(HfWeights(source), state["model"], spec.scale))
    else:
        weights = dict(state["model"])
    return untied(weights, config)


def untied(weights: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """`weights` without the output layer where the config ties it to the embedding (saved once)."""
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    return weights


def _merged_megatron(path: Path, first: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Every tensor x pipeline part of a megatron checkpoint joined and renamed."""
    from sfhpc.trainer import checkpoint as ckpt
    from sfhpc.trainer import megatron_names as names

    sizes = first["parallel"]
    tp, pp = int(sizes["tensor"]), int(sizes["pipeline"])
    layout = names.LlamaLayout.from_hf_config(config)
    per_stage = int(config["num_hidden_layers"]) // pp
    out: dict[str, Any] = {}
    for stage in range(pp):
        parts = []
        for rank in range(tp):
            part = path if (rank, stage) == (0, 0) else path.with_name(f"{path.name}.tp{rank}-pp{stage}")
            if not part.is_file():
                raise ExportError(f"{path}: the part of tensor rank {rank}, pipeline stage {stage} is missing "
                                  f"({part.name})")
            parts.append(first["model"] if (rank, stage) == (0, 0) else ckpt.load(part)["model"])
        for name in parts[0]:
            full = names.unshard(name, [p[name] for p in parts])
            for hf_name, tensor in names.megatron_to_hf(names.with_layer_offset(name, stage * per_stage), full,
                                                        layout):
                out[hf_name] = tensor
    return out


def write_weights(weights: dict[str, Any], folder: Path, dtype: str) -> list[str]:
    """`weights` as safetensors in `dtype`, in files of at most `SHARD_BYTES` (an index where several)."""
    import torch
    from safetensors.torch import save_file

    cast = getattr(torch, dtype)
    files: list[dict[str, Any]] = [{}]
    size = 0
    for name in sorted(weights):
        tensor = weights[name].detach().to(cast).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if files[-1] and size + nbytes > SHARD_BYTES:
            files.append({})
            size = 0
        files[-1][name] = tensor
        size += nbytes
    if len(files) == 1:
        save_file(files[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    written, index = [], {}
    for i, part in enumerate(files):
        file = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(part, str(folder / file), metadata={"format": "pt"})
        written.append(file)
        index.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for part in files for t in part.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=2) + "\n")
    return written


def export(run_dir: str | Path, out: str | Path, *, step: int | None = None, dtype: str = "bfloat16",
           adapter: bool = False) -> Path:
    """Write the policy of `run_dir`'s checkpoint (newest, or of `step`) as a Hugging Face folder at `out` (with
    `adapter`, a LoRA run's adapter as a PEFT adapter folder)."""
    run_dir, out = Path(run_dir), Path(out)
    _check_output(out, dtype)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run folder")
    info = find_checkpoint(run_dir, step)
    source = trained_model_dir(run_dir)
    config = json.loads((source / "config.json").read_text())
    import torch

    from sfhpc.trainer import checkpoint as ckpt
    from sfhpc.trainer import lora

    state = ckpt.load(info.trainer_file)
    spec = lora.spec_of(state)
    if adapter and spec is None:
        raise ExportError(f"{info.path}: this run trained every weight (no model.lora): --adapter exports a LoRA "
                          "run's adapter; leave it out for the whole model")
    weights = {} if adapter else hf_weights(info, config, source, state)

    def write(staging: Path) -> list[str]:
        if adapter:
            assert spec is not None
            cast = {k: v.to(getattr(torch, dtype)) for k, v in state["model"].items()}
            return lora.write_adapter_folder(staging, spec, cast, base_model=str(source))
        return _write_model(staging, config, weights, dtype)

    return _write_folder(out, source, write, {"run": str(run_dir.resolve()), "checkpoint": info.path.name,
                                              "step": info.step, "policy_version": info.version, "dtype": dtype})


def is_adapter_folder(path: Path) -> bool:
    return (path / "adapter_config.json").is_file()


def read_adapter(adapter_dir: Path) -> tuple[Path, float]:
    """The local model folder a PEFT adapter folder names as its base (``base_model_name_or_path``) and its
    scale, ``lora_alpha / r``."""
    try:
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"{adapter_dir}/adapter_config.json: cannot be read: {exc}") from None
    base = Path(str(config.get("base_model_name_or_path") or ""))
    if not (base / "config.json").is_file():
        raise ExportError(f"{adapter_dir}: its base model {str(base)!r} (base_model_name_or_path in "
                          "adapter_config.json) is not a local model folder; set it to the folder the adapter was "
                          "trained on")
    for key, plain in (("use_rslora", False), ("use_dora", False)):
        if config.get(key, plain) != plain:
            raise ExportError(f"{adapter_dir}: {key} adapters are not supported (plain LoRA: alpha / r scaling, "
                              "no magnitude vector)")
    return base, float(config["lora_alpha"]) / float(config["r"])


def merge_adapter_folder(adapter_dir: str | Path, out: str | Path, *, dtype: str = "float32") -> Path:
    """A PEFT LoRA adapter folder merged into its base model (`read_adapter`) as a Hugging Face folder at `out`:
    ``W + (lora_alpha / r) * B A`` for every layer the adapter targets (`sfhpc.trainer.lora.merged`)."""
    from safetensors.torch import load_file

    from sfhpc.trainer import lora
    from sfhpc.weights.hf_weights import HfWeights

    adapter_dir, out = Path(adapter_dir), Path(out)
    _check_output(out, dtype)
    base, scale = read_adapter(adapter_dir)
    tensors = adapter_dir / "adapter_model.safetensors"
    if not tensors.is_file():
        raise ExportError(f"{adapter_dir}: no adapter_model.safetensors")
    model_config = json.loads((base / "config.json").read_text())
    weights = untied(dict(lora.merged(HfWeights(base), load_file(str(tensors)), scale)), model_config)
    return _write_folder(out, base, lambda staging: _write_model(staging, model_config, weights, dtype),
                         {"adapter": str(adapter_dir.resolve()), "dtype": dtype})


def _check_output(out: Path, dtype: str) -> None:
    if dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(DTYPES)}, found {dtype!r}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not empty: export into a new folder (nothing is overwritten)")


def _write_model(staging: Path, config: dict[str, Any], weights: dict[str, Any], dtype: str) -> list[str]:
    config = dict(config, torch_dtype=dtype, dtype=dtype)
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return write_weights(weights, staging, dtype)


def _write_folder(out: Path, source: Path, write: Any, about: dict[str, Any]) -> Path:
    """`source`'s tokenizer, chat template and other small files, what `write(staging)` writes (it returns the
    file names) and ``sfhpc_export.json``, under a temporary name beside `out`, renamed into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for file in source.iterdir():
            if file.is_file() and file.name != "config.json" and not file.name.endswith(WEIGHT_SUFFIXES) \
                    and file.name != "model.safetensors.index.json":
                shutil.copy2(file, staging / file.name)
        files = write(staging)
        (staging / "sfhpc_export.json").write_text(json.dumps(
            {**about, "files": files, "source_model": str(source)}, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty, checked above
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
