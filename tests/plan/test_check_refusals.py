"""`sfhpc check` refuses in one line each what would fail once the GPUs are allocated: a tensor-parallel size
that does not divide the model's heads, a KL term with pipeline parallelism, a model too large for its GPU (the
plan's numbers in the line), an empty weights file, weights of another shape than the config's."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from sfhpc.model.shapes import shape
from tests.conftest import assert_one_line_error, run_sfhpc

# `sfhpc check --cluster` also makes launch's own checks, which look for the Slurm client (sbatch): the tier
# that installs it.
pytestmark = pytest.mark.slurm

SITE = """cluster: site
pools:
  - {name: gpu, partition: gpu, nodes: 4, tags: [train, rollout], cpus_per_node: 16, memory_mb: 256000,
     gpus_per_node: 4, gpu_type: a10, gpu_memory_gib: 24}
"""


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Qwen2 folder: 4 attention heads, 2 key/value heads, 2 layers, its tokenizer and template."""
    from sfhpc.model.hf_folder import build_hf_model

    return build_hf_model(tmp_path_factory.mktemp("qwen2") / "model", "qwen2", heads=4, kv_heads=2,
                          hidden_size=256, tokenizer_vocab=300)


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "model"))


def check(tmp_path: Path, folder: Path, extra: str = "", trainer: str = "nodes: 1, tasks_per_node: 1") -> str:
    (tmp_path / "site.yaml").write_text(SITE)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: gpus\nmodel: {{path: {folder}, max_seq_len: 512}}\ntask: {{name: next-letter}}\n"
                      "budgets: {max_new_tokens: 32, prompts_per_step: 8}\n"
                      f"{extra}roles:\n  controller: {{place_with: trainer}}\n"
                      f"  trainer: {{tags: [train], {trainer}, gpus_per_task: 1}}\n"
                      "  rollout: {tags: [rollout], nodes: 1, tasks_per_node: 1, gpus_per_task: 1}\n")
    done = run_sfhpc("check", str(recipe), "--cluster", str(tmp_path / "site.yaml"), timeout=120)
    return assert_one_line_error(done)


def test_the_recipe_passes_as_it_is(small_folder: Path, tmp_path: Path) -> None:
    (tmp_path / "site.yaml").write_text(SITE)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: gpus\nmodel: {{path: {small_folder}, max_seq_len: 512}}\ntask: {{name: next-letter}}\n"
                      "roles:\n  controller: {place_with: trainer}\n"
                      "  trainer: {tags: [train], nodes: 1, tasks_per_node: 1, gpus_per_task: 1}\n"
                      "  rollout: {tags: [rollout], nodes: 1, tasks_per_node: 1, gpus_per_task: 1}\n")
    done = run_sfhpc("check", str(recipe), "--cluster", str(tmp_path / "site.yaml"), timeout=120)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


def test_a_tensor_parallel_size_that_does_not_divide_the_key_value_heads(small_folder: Path, tmp_path: Path) -> None:
    line = check(tmp_path, small_folder, "training: {backend: megatron, tensor_parallel: 4}\n",
                 trainer="nodes: 1, tasks_per_node: 4")
    assert "training.tensor_parallel: 4 does not divide the model's 2 key/value heads" in line


def test_a_kl_term_with_pipeline_parallelism(small_folder: Path, tmp_path: Path) -> None:
    line = check(tmp_path, small_folder, "algorithm: {kl_coef: 0.01}\n"
                 "training: {backend: megatron, pipeline_parallel: 2}\n", trainer="nodes: 1, tasks_per_node: 2")
    assert "algorithm.kl_coef" in line and "needs training.pipeline_parallel 1" in line


def test_a_7b_on_one_24_gib_gpu_is_refused_with_the_plans_numbers(small_folder: Path, tmp_path: Path) -> None:
    # A folder of Qwen2.5-7B's shape: its config.json and a weights file whose header names every tensor at its
    # shape, the data left sparse (nothing is read but the header); the small model's tokenizer and template.
    folder = tmp_path / "qwen2.5-7b"
    folder.mkdir()
    shape("qwen2.5-7b").config().to_json_file(folder / "config.json")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["Qwen2ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    from sfhpc.model.folder import expected_shapes

    header, offset = {}, 0
    for name, dims in expected_shapes(config).items():
        size = 2
        for n in dims:
            size *= n
        header[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    with (folder / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)  # sparse: 15 GB that take no disk
    for file in small_folder.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(file, folder / file.name)
    line = check(tmp_path, folder)
    assert "roles.trainer: a trainer rank on pool 'gpu' needs " in line
    assert "> its GPU's 22.80 GiB" in line  # 95% of 24
    assert "weights 28.4, gradients 28.4, optimizer 56.7" in line  # float32 weights and gradients, Adam's moments
    assert "shard the model over more trainer ranks" in line


def test_an_empty_weights_file(small_folder: Path, tmp_path: Path) -> None:
    folder = copy_of(small_folder, tmp_path)
    (folder / "model.safetensors").write_bytes(b"")
    line = check(tmp_path, folder)
    assert f"model.path: {folder} has a weights file model.safetensors that is empty (0 bytes)" in line


def test_weights_of_another_shape_than_the_config(small_folder: Path, tmp_path: Path) -> None:
    folder = copy_of(small_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["num_key_value_heads"] = 4
    (folder / "config.json").write_text(json.dumps(config))
    line = check(tmp_path, folder)
    assert "'model.layers.0.self_attn.k_proj.weight' of shape [128, 256]" in line
    assert "config.json's model has [256, 256]" in line
