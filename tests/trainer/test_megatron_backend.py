"""The megatron-core backend in one process, on CPU through the test-only shim (tests/trainer/megatron_shim).

These tests prove wiring and weight-name mapping, not speed: the Llama architecture (and Qwen2's, with q/k/v
biases and tied embeddings) built in megatron-core from a recipe gives the Hugging Face model's logits, a
training step uses the same loss as the torch backend (and lands on the same weights), and the weight stream
it publishes is exactly the engine's (Hugging Face) naming. The model has 4 query heads sharing 2 key/value
heads, so the grouped QKV layout is exercised.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sfhpc.config.recipe import AlgorithmSpec, BuildSpec, DistillSpec, ModelSpec, TrainingSpec, load_recipe
from sfhpc.trainer.errors import CheckpointError, TrainerError
from sfhpc.trainer.losses import token_logprobs
from sfhpc.trainer.torch_trainer import TorchTrainer
from tests.conftest import RECIPES
from tests.trainer.conftest import toy_batch

pytest.importorskip("megatron.core")

from sfhpc.trainer import megatron_backend as mb  # noqa: E402  (after the skip: needs megatron-core)
from tests.trainer.megatron_shim import cpu_shim  # noqa: E402
from tests.trainer.megatron_shim.models import GQA, build_gqa_model  # noqa: E402

CONFIG = AlgorithmSpec(learning_rate=1e-3)


@pytest.fixture(scope="module", autouse=True)
def megatron_on_cpu() -> Iterator[None]:
    with cpu_shim():
        yield


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gqa_model(tmp_path_factory.mktemp("gqa-model"))


def hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_recipe_model_trains_one_step_and_publishes_engine_names(gqa_dir: Path) -> None:
    recipe = load_recipe(RECIPES / "demo.yaml")
    recipe = dataclasses.replace(recipe, model=GQA, training=TrainingSpec(backend="megatron"),
                                 algorithm=dataclasses.replace(recipe.algorithm, learning_rate=1e-3, kl_coef=0.0))
    trainer = mb.MegatronTrainer.from_recipe(recipe, gqa_dir)
    assert (trainer.sizes.tensor, trainer.sizes.pipeline, trainer.sizes.data) == (1, 1, 1)
    batch = toy_batch()
    reference = hf_model(gqa_dir)

    # (a) Initialised from the HF folder, megatron's GPT gives the HF Llama's logits (and log-probs).
    with torch.no_grad():
        want = reference(input_ids=batch.tokens).logits
        got = trainer.logits(batch.tokens)
        assert got.shape == want.shape  # 264 ids: no padding needed at tensor parallel 1
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(trainer.logprobs(batch), token_logprobs(want, batch.tokens), rtol=1e-4, atol=1e-4)

    # (b) One step changes the weights and reports finite metrics.
    before = {n: t.clone() for n, t in trainer.named_weights()}
    m = trainer.train_step(batch)
    assert (m.step, m.policy_version, trainer.policy_version) == (1, 1, 1)
    assert m.tokens == batch.num_generated and m.sequences == batch.size
    assert all(torch.isfinite(torch.tensor(v)) for v in m.as_dict().values())
    assert m.grad_norm > 0
    after = {n: t.clone() for n, t in trainer.named_weights()}
    assert all(not torch.equal(before[n], after[n]) for n in before)  # every tensor trained

    # (c) The published weights are exactly the HF model's keys and shapes, load strictly into a fresh HF
    # Llama, and that model reproduces megatron's logits.
    want_shapes = {n: tuple(t.shape) for n, t in reference.state_dict().items()}
    assert {n: tuple(t.shape) for n, t in after.items()} == want_shapes
    fresh = hf_model(gqa_dir)
    fresh.load_state_dict(after, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=batch.tokens).logits, trainer.logits(batch.tokens),
                                   rtol=1e-4, atol=1e-4)
    assert {t.dtype for _, t in trainer.named_weights(torch.bfloat16)} == {torch.bfloat16}


@pytest.mark.parametrize("config", [CONFIG, dataclasses.replace(CONFIG, normalize_std=False, loss_norm_tokens=16,
                                                                 loss_aggregation="token-sum-norm"),
                                    dataclasses.replace(CONFIG, distill=DistillSpec("teacher", weight=0.5))],
                         ids=["grpo", "dr-grpo", "distill"])
def test_one_step_matches_the_torch_backend(gqa_dir: Path, config: AlgorithmSpec) -> None:
    batch = toy_batch(version=3)
    if config.distill is not None:  # the teacher's scores of the batch (the teacher role's, in a run)
        batch = dataclasses.replace(batch, teacher_logprobs=torch.where(batch.generated, -1.0, 0.0))
    megatron = mb.MegatronTrainer(gqa_dir, config, initial_version=5)
    torch_trainer = TorchTrainer(gqa_dir, config, initial_version=5)
    got, want = megatron.train_step(batch), torch_trainer.train_step(batch)
    for key in ("loss", "mean_ratio", "clip_fraction", "truncated_fraction", "grad_norm", "reward_mean"):
        assert getattr(got, key) == pytest.approx(getattr(want, key), rel=1e-4, abs=1e-6), key
    assert (got.mean_staleness, got.max_staleness, got.policy_version) == (2.0, 2, 6)
    torch_weights = dict(torch_trainer.named_weights())
    for name, t in megatron.named_weights():
        # Adam's first step moves every weight by ~lr = 1e-3 whatever its gradient's size, so gradients
        # near zero that differ in the last bits can differ by a few 1e-5 after it: allow a tenth of a step.
        torch.testing.assert_close(t, torch_weights[name], rtol=0.0, atol=1e-4, msg=name)


def test_micro_batches_train_as_one_pass(gqa_dir: Path) -> None:
    """Eight rows in four micro-batches of two (a budget of two rows' padded tokens), gradients accumulated:
    the step of one pass over all eight."""
    batch = toy_batch(seed=4)
    width = int(batch.tokens.shape[1])
    one = mb.MegatronTrainer(gqa_dir, CONFIG, training=TrainingSpec(backend="megatron", micro_batch_tokens=None))
    got_one = one.train_step(batch)
    weights_one = {n: t.clone() for n, t in one.named_weights()}
    four = mb.MegatronTrainer(gqa_dir, CONFIG, training=TrainingSpec(backend="megatron", micro_batch_tokens=2 * width))
    got_four = four.train_step(batch)
    assert (got_one.micro_batches, got_four.micro_batches) == (1, 4)
    for key in ("loss", "mean_ratio", "grad_norm", "reward_mean"):
        assert getattr(got_four, key) == pytest.approx(getattr(got_one, key), rel=1e-4, abs=1e-6), key
    for name, t in four.named_weights():
        torch.testing.assert_close(t, weights_one[name], rtol=0.0, atol=1e-4, msg=name)


def test_recompute_is_the_same_step_and_bf16_keeps_float32_masters(gqa_dir: Path) -> None:
    """Full recompute changes what is kept, not what is computed: the same step bit for bit. bf16 computes in
    bf16 (its step within bf16's precision of float32's) beside float32 master weights seeded with the folder's
    own values, not their bf16 rounding."""
    batch = toy_batch(seed=5)
    plain = mb.MegatronTrainer(gqa_dir, CONFIG)
    want = plain.train_step(batch)
    recomputed = mb.MegatronTrainer(gqa_dir, CONFIG, training=TrainingSpec(backend="megatron",
                                                                          activation_checkpointing=True))
    assert recomputed.model_config.recompute_granularity == "full"
    got = recomputed.train_step(batch)
    assert (got.loss, got.grad_norm) == (want.loss, want.grad_norm)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(plain.named_weights(), recomputed.named_weights()))

    bf16 = mb.MegatronTrainer(gqa_dir, CONFIG, training=TrainingSpec(backend="megatron", precision="bf16"))
    folder = mb.read_hf_weights(gqa_dir)["model.layers.0.mlp.down_proj.weight"]
    param = bf16.module.decoder.layers[0].mlp.linear_fc2.weight
    assert param.dtype == torch.bfloat16 and param.main_param.dtype == torch.float32
    assert torch.equal(param.main_param, folder) and not torch.equal(param.float(), folder)
    got = bf16.train_step(batch)
    assert got.loss == pytest.approx(want.loss, rel=2e-2) and got.grad_norm == pytest.approx(want.grad_norm, rel=2e-2)
    assert {t.dtype for _, t in bf16.named_weights()} == {torch.bfloat16}


def test_checkpoint_resumes_exactly(gqa_dir: Path, tmp_path: Path) -> None:
    batches = [toy_batch(seed=s) for s in range(3)]
    a = mb.MegatronTrainer(gqa_dir, CONFIG)
    a.train_step(batches[0])
    path = a.save_checkpoint(tmp_path / "megatron.pt")
    assert path == tmp_path / "megatron.pt" and [p.name for p in tmp_path.iterdir()] == ["megatron.pt"]
    a.train_step(batches[1])
    b = mb.MegatronTrainer(gqa_dir, CONFIG)
    b.load_checkpoint(path)
    assert (b.step, b.policy_version) == (1, 1)
    b.train_step(batches[1])  # Adam moments restored: the same step as a's second one
    wa, wb = dict(a.named_weights()), dict(b.named_weights())
    assert all(torch.equal(wa[n], wb[n]) for n in wa)

    bf16 = mb.MegatronTrainer(gqa_dir, CONFIG, training=TrainingSpec(backend="megatron", precision="bf16"))
    with pytest.raises(CheckpointError, match="written in float32 .* this run trains in bf16"):
        bf16.load_checkpoint(path)

    TorchTrainer(gqa_dir, CONFIG).save_checkpoint(tmp_path / "torch.pt")
    with pytest.raises(CheckpointError, match="torch backend"):
        b.load_checkpoint(tmp_path / "torch.pt")


def test_refuses_to_start_without_cuda(gqa_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mb, "REQUIRE_CUDA", True)
    with pytest.raises(TrainerError, match="needs CUDA GPUs; use backend 'torch'"):
        mb.MegatronTrainer(gqa_dir, CONFIG)


def test_parallel_sizes_from_the_recipe() -> None:
    spec = TrainingSpec(backend="megatron", tensor_parallel=2, pipeline_parallel=2)
    assert mb.ParallelSizes.from_training(spec, 8) == mb.ParallelSizes(tensor=2, pipeline=2, data=2)
    with pytest.raises(TrainerError, match="6 trainer ranks cannot be split"):
        mb.ParallelSizes.from_training(spec, 6)


def test_model_folder_problems_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(TrainerError, match="no config.json"):
        mb.read_hf_config(tmp_path)
    from sfhpc.model.tiny import llama_config

    cfg = {**llama_config(ModelSpec(build=BuildSpec(layers=1, hidden_size=64, heads=1))), "attention_bias": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TrainerError, match="Llama linear biases"):
        mb.read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "attention_bias": False, "model_type": "mistral"}))
    with pytest.raises(TrainerError, match="builds Llama and Qwen2 models only"):
        mb.read_hf_config(tmp_path)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face Qwen2 folder: q/k/v biases, tied embeddings, 2 query heads sharing 1 key/value head."""
    from sfhpc.model.hf_folder import build_hf_model

    return build_hf_model(tmp_path_factory.mktemp("qwen2") / "model", "qwen2", kv_heads=1, dtype="float32")


def test_qwen2_with_qkv_bias_and_tied_embeddings(qwen2_dir: Path) -> None:
    """megatron builds the Qwen2 folder (biases in the fused QKV, the output layer shared with the embedding),
    gives the HF model's logits, trains the biases as the torch backend does, and publishes exactly the
    torch backend's names (the ones vLLM loads, tests/engine/test_hf_models.py)."""
    from transformers import AutoModelForCausalLM

    batch = toy_batch()
    megatron = mb.MegatronTrainer(qwen2_dir, CONFIG)
    assert megatron.layout.qkv_bias and megatron.layout.tied_embeddings
    reference = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(megatron.logits(batch.tokens)[..., :megatron.layout.vocab_size],
                                   reference(input_ids=batch.tokens).logits, rtol=1e-4, atol=1e-4)
    torch_trainer = TorchTrainer(qwen2_dir, CONFIG)
    published = {n: t.clone() for n, t in megatron.named_weights()}  # views of live weights otherwise
    engine_names = dict(torch_trainer.named_weights())
    assert published.keys() == engine_names.keys()
    assert "model.layers.0.self_attn.k_proj.bias" in published and "lm_head.weight" not in published
    assert all(torch.equal(published[n], engine_names[n]) for n in published)  # step 0: the folder's weights

    got, want = megatron.train_step(batch), torch_trainer.train_step(batch)
    assert got.loss == pytest.approx(want.loss, rel=1e-4) and got.grad_norm == pytest.approx(want.grad_norm, rel=1e-4)
    after, torch_after = dict(megatron.named_weights()), dict(torch_trainer.named_weights())
    bias = "model.layers.1.self_attn.q_proj.bias"
    assert not torch.equal(after[bias], published[bias])  # the biases trained
    for name, t in after.items():
        torch.testing.assert_close(t, torch_after[name], rtol=0.0, atol=1e-4, msg=name)
