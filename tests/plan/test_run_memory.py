"""The memory plan of a run: what each trainer and engine rank holds, refused in one line before any job
when it does not fit, and the memory share an engine starting beside a trainer takes. Pure rules: the GPUs
they are about cannot be had here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sfhpc.cli import main
from sfhpc.config import load_cluster_map, load_recipe
from sfhpc.errors import ResolveError
from sfhpc.plan.memory import GIB, ModelShape, lora_layers
from sfhpc.plan.resolve import resolve
from sfhpc.plan.run_memory import engine_memory_share, planned_ranks
from tests.conftest import RECIPES

# config.json of Qwen2.5-7B and Qwen2.5-1.5B (the hub's files, the keys the rule reads).
QWEN_7B = {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
           "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False}
QWEN_1_5B = {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
             "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": True}


def test_a_model_shape_is_read_from_its_config() -> None:
    seven = ModelShape.from_config({**QWEN_7B, "model_type": "qwen2"})
    assert abs(seven.params - 7.61e9) / 7.61e9 < 0.001  # the model card's 7.61B
    assert (seven.layers, seven.kv_heads, seven.head_dim) == (28, 4, 128)
    assert seven.kv_bytes_per_token(2) == 2 * 28 * 4 * 128 * 2
    assert abs(ModelShape.from_config({**QWEN_1_5B, "model_type": "qwen2"}).params - 1.54e9) / 1.54e9 < 0.005
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape.from_config({"num_hidden_layers": 2})


def recipe_on_folder(tmp_path: Path, config: dict[str, object], mode: str = "sync") -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    roles = ("  trainer:    {tags: [train, rollout], nodes: 1, tasks_per_node: 1, gpus_per_task: 1}\n"
             "  rollout:    {colocate_with: trainer}\n") if mode == "sync" else \
            ("  trainer:    {tags: [train, rollout], nodes: 1, tasks_per_node: 2, gpus_per_task: 1}\n"
             "  rollout:    {tags: [rollout], nodes: 1, tasks_per_node: 4, gpus_per_task: 1}\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: shared\nmodel: {{path: {folder}}}\npipeline: {{mode: {mode}}}\n"
                      f"budgets: {{max_new_tokens: 64}}\ntask: {{name: next-letter}}\n"
                      f"roles:\n  controller: {{place_with: trainer}}\n{roles}")
    return recipe


@pytest.mark.parametrize("mode", ["sync", "seamless"])
def test_a_trainer_and_an_engine_that_cannot_share_a_gpu_are_refused_in_one_line(tmp_path: Path, mode: str) -> None:
    cluster = load_cluster_map(RECIPES / "cluster-h100-l40s.yaml")  # H100s of 80 GiB, L40S of 48
    recipe = load_recipe(recipe_on_folder(tmp_path, QWEN_7B, mode))
    with pytest.raises(ResolveError) as refused:
        resolve(recipe, cluster)
    line = str(refused.value)
    assert "\n" not in line and line.startswith("roles.trainer: a trainer + engine rank on pool 'h100' needs ")
    assert "> its GPU's 76.00 GiB" in line  # 95% of 80 GiB
    # Each trainer rank of two (seamless) holds half of 16 bytes a parameter; one rank (sync), all of it.
    params = ModelShape.from_config(QWEN_7B).params
    assert f"(weights {params * 4 / GIB / (2 if mode == 'seamless' else 1):.1f}, gradients" in line
    assert "engine weights 14.2" in line and "shard the model over more trainer ranks" in line


def test_a_model_that_fits_beside_its_trainer_is_placed(tmp_path: Path) -> None:
    cluster = load_cluster_map(RECIPES / "cluster-h100-l40s.yaml")
    recipe = load_recipe(recipe_on_folder(tmp_path, QWEN_1_5B))
    plan = resolve(recipe, cluster)
    assert plan.world_size == 2  # controller + one colocated trainer
    [rank] = planned_ranks(recipe, plan, cluster)
    memory = rank.memory
    assert rank.role == "trainer + engine" and memory.fits and memory.total > 20 * GIB
    # float32 weights, gradients and Adam (16 bytes a parameter) against the engine's bf16 copy (2)
    state = memory.item("weights") + memory.item("gradients") + memory.item("optimizer")
    assert state == pytest.approx(8 * memory.item("engine weights"), rel=1e-6)


def test_an_engine_beside_a_trainer_takes_what_the_trainer_left() -> None:
    total = 80 * GIB
    assert engine_memory_share(0.9, 79 * GIB, total) == 0.9  # a GPU of its own: the recipe's share
    assert engine_memory_share(0.9, 30 * GIB, total) == round(29 / 80, 3)  # the free 30 GiB less the reserve
    with pytest.raises(ValueError, match="no room for an engine"):
        engine_memory_share(0.9, GIB // 2, total)


def test_the_megatron_backend_cuts_equal_micro_batches_within_the_budget() -> None:
    from sfhpc.plan.memory import equal_micro_batches

    assert equal_micro_batches(8, 100, None, 1) == 1  # no budget: one pass
    assert equal_micro_batches(8, 100, 250, 1) == 4  # two rows fit: four micro-batches of two
    assert equal_micro_batches(6, 100, 400, 1) == 2  # four rows would fit, but 4 does not divide 6: three each
    assert equal_micro_batches(6, 100, None, 4) == 3  # a pipeline of 4 stages: the largest count <= 4 dividing 6
    assert equal_micro_batches(7, 100, 250, 1) == 7  # 7 is prime: one row each
    assert equal_micro_batches(8, 100, 50, 2) == 8  # a row over the budget still gets a micro-batch of its own


def test_the_megatron_plan_follows_precision_the_distributed_optimizer_and_recompute() -> None:
    """A 7B over tensor parallel 2 and 4 data-parallel ranks: bf16 weights beside float32 master weights, the
    distributed optimizer dividing Adam and the masters by 4, recompute keeping a layer's input per layer."""
    from sfhpc.config.recipe import TrainingSpec
    from sfhpc.plan.memory import MegatronSettings, megatron_memory

    shape = ModelShape.from_config(QWEN_7B)
    p = shape.params // 2

    def plan(**training: object) -> dict[str, int]:
        spec = TrainingSpec(backend="megatron", tensor_parallel=2, **training)  # type: ignore[arg-type]
        settings = MegatronSettings.from_training(spec, tensor=2, data=4, on_gpu=True)
        memory = megatron_memory(shape, settings, tensor_parallel=2, pipeline_parallel=1, data_parallel=4,
                                 tokens=4096, reference=False, capacity=80 * GIB)
        return {k: memory.item(k) for k in ("weights", "master weights", "gradients", "optimizer", "activations")}

    whole = plan(precision="float32", sharding="none")
    assert (whole["weights"], whole["master weights"], whole["optimizer"]) == (4 * p, 0, 8 * p)
    auto = plan()  # on GPUs: bf16, the distributed optimizer, sequence parallelism (tensor parallel 2)
    assert (auto["weights"], auto["master weights"], auto["gradients"], auto["optimizer"]) == (2 * p, p, 4 * p, 2 * p)
    assert auto["activations"] == pytest.approx(whole["activations"] / 2, rel=1e-6)  # bf16 activations
    # Without sequence parallelism the norms' and residuals' share is not split over the tensor-parallel ranks.
    assert plan(sequence_parallel=False)["activations"] == pytest.approx(auto["activations"] * (1 + 10 / 34), rel=1e-6)
    recomputed = plan(activation_checkpointing=True)
    assert recomputed["activations"] < auto["activations"] / 4
    assert MegatronSettings.from_training(TrainingSpec(backend="megatron"), tensor=1, data=1, on_gpu=False) == \
        MegatronSettings()  # on CPUs, one replica: float32, nothing sharded


def test_a_lora_trainer_fits_where_full_fine_tuning_did_not(tmp_path: Path) -> None:
    """The 7B that a trainer + engine GPU refuses above trains there as a LoRA adapter: its frozen weights once in
    bf16, the adapter's state beside them."""
    cluster = load_cluster_map(RECIPES / "cluster-h100-l40s.yaml")
    recipe = load_recipe(recipe_on_folder(tmp_path, QWEN_7B),
                         {"model.lora": {"rank": 16, "target_modules": "all-linear"},
                          "training.activation_checkpointing": True})
    plan = resolve(recipe, cluster)
    [rank] = planned_ranks(recipe, plan, cluster)
    memory, shape = rank.memory, ModelShape.from_config(QWEN_7B)
    adapter = 16 * shape.layers * sum(sum(io) for io in lora_layers(shape).values())
    assert memory.fits and memory.item("frozen weights") == 2 * shape.params
    assert (memory.item("adapter"), memory.item("optimizer")) == (4 * adapter, 8 * adapter)


QWEN_32B = {"hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
            "intermediate_size": 27648, "vocab_size": 152064, "tie_word_embeddings": False}


@pytest.mark.parametrize(("teacher", "fits"), [(QWEN_7B, True), (QWEN_32B, False)])
def test_a_distillation_teacher_is_planned_on_its_own_gpu(tmp_path: Path, teacher: dict[str, object],
                                                          fits: bool) -> None:
    """The teacher's rank holds its bf16 weights, one micro-batch's forward and one logits chunk: a 7B teacher fits an
    L40S of 48 GiB beside nothing else; a 32B one is refused there in one line that names the teacher's role."""
    cluster = load_cluster_map(RECIPES / "cluster-h100-l40s.yaml")
    folder = tmp_path / "teacher"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(teacher))
    recipe_path = recipe_on_folder(tmp_path, QWEN_1_5B)
    recipe_path.write_text(recipe_path.read_text() + "  teacher:    {tags: [rollout], nodes: 1, gpus_per_task: 1}\n"
                           f"algorithm: {{distill: {{teacher: {folder}}}}}\n")
    recipe = load_recipe(recipe_path)
    shape = ModelShape.from_config(teacher)
    if not fits:
        with pytest.raises(ResolveError) as refused:
            resolve(recipe, cluster)
        line = str(refused.value)
        assert line.startswith("roles.teacher: a teacher rank on pool 'l40s' needs ") and "\n" not in line
        assert f"teacher weights {2 * shape.params / GIB:.1f}" in line and "> its GPU's 45.60 GiB" in line
        assert "give the teacher role a pool with larger GPUs" in line
        return
    plan = resolve(recipe, cluster)
    ranks = {rank.role: rank for rank in planned_ranks(recipe, plan, cluster)}
    assert sorted(ranks) == ["teacher", "trainer + engine"]
    memory = ranks["teacher"].memory
    assert ranks["teacher"].pool == "l40s" and memory.fits and memory.item("teacher weights") == 2 * shape.params
    assert memory.item("logits chunk") == 1024 * shape.vocab * 8  # the default chunk, float32 and its log-softmax


@pytest.mark.parametrize(("engine", "refused"), [("{weight_delta: true}", "weight_delta"),
                                                 ("{staged_updates: true}", "staged_updates"),
                                                 ("{max_restarts: 2}", "max_restarts"),
                                                 ("{weight_delta: true, gpu_memory_utilization: 0.85}", None),
                                                 ("{staged_updates: true, gpu_memory_utilization: 0.85}", None),
                                                 ("{weight_delta: true, weight_transport: mpi}", None),
                                                 ("{staged_updates: true, weight_transport: mpi}", None)])
def test_a_weight_copy_without_room_beside_vllm_is_refused(tmp_path: Path, engine: str, refused: str | None,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """With engine.weight_delta or max_restarts each rollout rank keeps a copy of the weights, with staged_updates
    its engine does (bf16: 2.9 GiB for a 1.5B): on its GPU under the torch transport, where beside vLLM's 0.9 of an
    L40S (48 GiB, 0.95 usable) there are 2.4 GiB left."""
    cluster = load_cluster_map(RECIPES / "cluster-h100-l40s.yaml")
    path = recipe_on_folder(tmp_path, QWEN_1_5B, "seamless")
    path.write_text(path.read_text() + f"engine: {engine}\n")
    recipe = load_recipe(path)
    copy = 2 * ModelShape.from_config(QWEN_1_5B).params / GIB
    if refused is None:  # `sfhpc plan` says where the copy lies, and the room beside vLLM's share
        resolve(recipe, cluster)
        assert main(["plan", str(path), "--cluster", str(RECIPES / "cluster-h100-l40s.yaml")]) == 0
        printed = capsys.readouterr().out
        where = "in host memory" if "mpi" in engine else "in its GPU's memory beside vLLM's share (4.80 GiB there)"
        assert f"each rollout rank on pool 'l40s' keeps a copy of the weights ({copy:.2f} GiB) {where}\n" in printed
        return
    with pytest.raises(ResolveError) as refusal:
        resolve(recipe, cluster)
    line = str(refusal.value)
    assert line.startswith(f"engine.{refused}: each rollout rank on pool 'l40s' keeps a copy of the weights "
                           f"({copy:.2f} GiB)") and "\n" not in line, line
    assert "lower engine.gpu_memory_utilization to at most 0.89" in line and "weight_transport: mpi" in line
