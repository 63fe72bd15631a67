"""`sfhpc export` writes a run's trained policy as a Hugging Face folder: transformers and vLLM load it as any
folder, and their log-probabilities of a reply are the trainer's (in float32 to 1e-4, in bf16 to its rounding);
a missing checkpoint, a taken output folder and a bad step are one line each, nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sfhpc.config.recipe import AlgorithmSpec, LoraSpec, TrainingSpec
from sfhpc.data.store_writer import TrajectoryStore
from sfhpc.model.hf_folder import build_hf_model
from sfhpc.rl.checkpoints import TRAINER_FILE, RunCheckpoints
from sfhpc.rl.export import ExportError, merge_adapter_folder
from sfhpc.trainer.batch import TrainBatch, TrainRow
from sfhpc.trainer.torch_trainer import TorchTrainer
from tests.conftest import ROOT, assert_one_line_error, run_sfhpc


def row(seed: int, vocab: int, length: int = 40) -> TrainRow:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, vocab, (length,), generator=g).tolist()
    generated = [i >= 10 for i in range(length)]
    return TrainRow(tokens=tokens, generated=generated, logprobs=[-5.0 if m else 0.0 for m in generated],
                    versions=[0 if m else -1 for m in generated], reward=float(seed % 2), group=seed // 4)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, TorchTrainer]:
    """A run folder as a run leaves it: the store naming its model folder, and checkpoints of steps 1 and 3
    of a policy trained away from the folder's weights."""
    base = tmp_path_factory.mktemp("export")
    model = build_hf_model(base / "model", "qwen2", layers=2, dtype="float32")
    run = base / "run"
    run.mkdir()
    TrajectoryStore.create(run / "trajectories.h5", run_metadata={"model": str(model)}).close()
    trainer = TorchTrainer(model, AlgorithmSpec(learning_rate=3e-3), training=TrainingSpec())
    vocab = trainer.model.config.vocab_size
    checkpoints = RunCheckpoints(run)
    for step in range(1, 4):
        trainer.train_step(TrainBatch.from_rows([row(s, vocab) for s in range(8)]))
        if step in (1, 3):
            partial = checkpoints.begin(step)
            trainer.save_checkpoint(partial / TRAINER_FILE)
            checkpoints.commit(partial, step=step, version=trainer.policy_version, identity={}, reason="test")
    return run, model, trainer


def exported(run: Path, out: Path, *args: str) -> dict:
    done = run_sfhpc("export", str(run), "--out", str(out), *args, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"to {out}" in done.stdout
    return json.loads((out / "sfhpc_export.json").read_text())


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 0.1)])
def test_transformers_loads_the_export_and_scores_as_the_trainer(trained_run: tuple[Path, Path, TorchTrainer],
                                                                 tmp_path: Path, dtype: str, tolerance: float) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, model, trainer = trained_run
    info = exported(run, tmp_path / "hf", "--dtype", dtype)
    assert (info["step"], info["policy_version"], info["dtype"]) == (3, 3, dtype)
    folder = tmp_path / "hf"
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in folder.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(folder).float().eval()
    assert AutoTokenizer.from_pretrained(folder).chat_template == AutoTokenizer.from_pretrained(model).chat_template
    batch = TrainBatch.from_rows([row(100, trainer.model.config.vocab_size)])
    with torch.no_grad():
        theirs = trainer.logprobs(batch, loaded)[0, 10:]
    ours = trainer.logprobs(batch)[0, 10:]
    original = trainer.logprobs(batch, AutoModelForCausalLM.from_pretrained(model).float().eval())[0, 10:]
    assert float((theirs - ours).abs().max()) < tolerance
    assert float((original - ours).abs().max()) > 10 * min(tolerance, 0.01)  # training moved what is compared


def test_an_earlier_step_is_exported_on_request(trained_run: tuple[Path, Path, TorchTrainer], tmp_path: Path) -> None:
    run, _, _ = trained_run
    assert exported(run, tmp_path / "step1", "--step", "1")["step"] == 1


def test_what_cannot_be_exported_is_one_line_and_writes_nothing(trained_run: tuple[Path, Path, TorchTrainer],
                                                                 tmp_path: Path) -> None:
    run, _, _ = trained_run
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert_one_line_error(run_sfhpc("export", str(run), "--out", str(taken)), "exists and is not empty")
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]
    assert_one_line_error(run_sfhpc("export", str(run), "--out", str(tmp_path / "x"), "--step", "2"),
                          "no checkpoint of step 2", "steps 1, 3")
    assert_one_line_error(run_sfhpc("export", str(tmp_path), "--out", str(tmp_path / "y")), "no complete checkpoint")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, TorchTrainer]:
    """A run folder of a LoRA trainer (rank 4 on every linear layer) with a checkpoint of step 2."""
    base = tmp_path_factory.mktemp("lora-export")
    model = build_hf_model(base / "model", "qwen2", layers=2, dtype="float32")
    run = base / "run"
    run.mkdir()
    TrajectoryStore.create(run / "trajectories.h5", run_metadata={"model": str(model)}).close()
    trainer = TorchTrainer(model, AlgorithmSpec(learning_rate=3e-2), training=TrainingSpec(),
                           lora_spec=LoraSpec(rank=4, alpha=16, target_modules="all-linear"))
    vocab = trainer.model.config.vocab_size
    for _ in range(2):
        trainer.train_step(TrainBatch.from_rows([row(s, vocab) for s in range(8)]))
    checkpoints = RunCheckpoints(run)
    partial = checkpoints.begin(2)
    trainer.save_checkpoint(partial / TRAINER_FILE)
    checkpoints.commit(partial, step=2, version=trainer.policy_version, identity={}, reason="test")
    return run, model, trainer


def test_a_lora_run_exports_merged_or_as_its_adapter(lora_run: tuple[Path, Path, TorchTrainer],
                                                     trained_run: tuple[Path, Path, TorchTrainer],
                                                     tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run, model, trainer = lora_run
    batch = TrainBatch.from_rows([row(100, trainer.model.config.vocab_size)])
    ours = trainer.logprobs(batch)[0, 10:]
    original = AutoModelForCausalLM.from_pretrained(model).float().eval()
    with torch.no_grad():
        assert float((trainer.logprobs(batch, original)[0, 10:] - ours).abs().max()) > 0.01  # the adapter moved it
    exported(run, tmp_path / "merged", "--dtype", "float32")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").float().eval()
    with torch.no_grad():
        assert float((trainer.logprobs(batch, merged)[0, 10:] - ours).abs().max()) < 1e-4
    info = exported(run, tmp_path / "adapter", "--adapter", "--dtype", "float32")
    assert info["files"] == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 16, str(model))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_size < \
        0.2 * (tmp_path / "merged" / "model.safetensors").stat().st_size
    served = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model).float(), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert float((trainer.logprobs(batch, served)[0, 10:] - ours).abs().max()) < 1e-4
    assert_one_line_error(run_sfhpc("export", str(trained_run[0]), "--out", str(tmp_path / "no"), "--adapter"),
                          "no model.lora", "--adapter")
    # model.init_from of the adapter folder: merged into the base model it names, it scores as the trainer.
    merged_again = AutoModelForCausalLM.from_pretrained(merge_adapter_folder(tmp_path / "adapter",
                                                                             tmp_path / "from-adapter")).eval()
    with torch.no_grad():
        assert float((trainer.logprobs(batch, merged_again)[0, 10:] - ours).abs().max()) < 1e-4
    config["base_model_name_or_path"] = "Qwen/Qwen2.5-7B-Instruct"
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="'Qwen/Qwen2.5-7B-Instruct' .* is not a local model folder"):
        merge_adapter_folder(tmp_path / "adapter", tmp_path / "from-hub")


VLLM_SCORE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=128, enforce_eager=True, enable_chunked_prefill=False)
prompt = json.loads(sys.argv[2])
out = llm.generate(TokensPrompt(prompt_token_ids=prompt), SamplingParams(max_tokens=12, temperature=1.0, logprobs=0,
                   seed=0, ignore_eos=True))[0].outputs[0]
print(json.dumps({"tokens": list(out.token_ids),
                  "logprobs": [d[t].logprob for t, d in zip(out.token_ids, out.logprobs)]}))
"""


@pytest.mark.vllm
def test_vllm_serves_the_export_and_its_logprobs_are_the_trainers(trained_run: tuple[Path, Path, TorchTrainer],
                                                                  tmp_path: Path) -> None:
    run, _, trainer = trained_run
    exported(run, tmp_path / "hf", "--dtype", "float32")
    prompt = row(7, trainer.model.config.vocab_size, length=10).tokens
    done = subprocess.run([sys.executable, "-c", VLLM_SCORE, str(tmp_path / "hf"), json.dumps(list(prompt))],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    sampled = json.loads(done.stdout.strip().splitlines()[-1])
    tokens = list(prompt) + sampled["tokens"]
    batch = TrainBatch.from_rows([TrainRow(tokens=tokens, generated=[i >= len(prompt) for i in range(len(tokens))],
                                           logprobs=[0.0] * len(tokens), versions=[0] * len(tokens), reward=0.0)])
    ours = trainer.logprobs(batch)[0, len(prompt):]
    assert len(sampled["logprobs"]) == 12
    torch.testing.assert_close(ours, torch.tensor(sampled["logprobs"]), rtol=0, atol=1e-3)


@pytest.mark.mpi
def test_a_run_starts_from_another_runs_checkpoint_and_exports_as_it_goes(trained_run: tuple[Path, Path, TorchTrainer],
                                                   tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from tests.conftest import run_recipe

    run, _, trainer = trained_run
    checkpoint = run / "checkpoints" / "step-000003"
    run_dir, rows = run_recipe(tmp_path, f"name: from-run\nseed: 1\nengine: {{name: test}}\n"
                                         f"model: {{init_from: {checkpoint}, max_seq_len: 128}}\n"
                                         "algorithm: {group_size: 2}\nbudgets: {steps: 3, prompts_per_step: 2}\n"
                                         "training: {export_every: 2}\ntask: {name: next-letter}\n"
                                         "roles:\n  controller: {place_with: trainer}\n  trainer: {tags: [train]}\n"
                                         "  rollout: {colocate_with: trainer}\n", timeout=600)
    assert [r["version"] for r in rows] == [1, 2, 3]
    started = load_file(run_dir / "model" / "model.safetensors")  # the weights the new run began with
    assert json.loads((run_dir / "model" / "sfhpc_export.json").read_text())["step"] == 3
    for name, value in trainer.named_weights():
        if name in started:
            assert torch.equal(started[name], value), name  # float32: the trained master weights exactly

    # training.export_every: 2 wrote the policy of step 2, and of the last step at the end.
    exports = run_dir / "exports"
    assert sorted(p.name for p in exports.iterdir()) == ["step-000002", "step-000003"]
    infos = [json.loads((exports / name / "sfhpc_export.json").read_text()) for name in ("step-000002", "step-000003")]
    assert [(i["step"], i["policy_version"], i["dtype"]) for i in infos] == [(2, 2, "bfloat16"), (3, 3, "bfloat16")]
    exported_weights = load_file(exports / "step-000003" / "model.safetensors")
    assert set(exported_weights) == set(started) and {t.dtype for t in exported_weights.values()} == {torch.bfloat16}
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "exported"] == [2, 3]
    assert (run_dir / "checkpoints" / "step-000002").is_dir()  # an export step is checkpointed

