"""A recipe's model.path that cannot be a policy is refused before any job starts, in one line: a folder
that is not a Hugging Face model folder, one without a tokenizer or chat template, and an architecture that
transformers, vLLM or the training backend cannot take."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

from sfhpc.errors import SfhpcError
from tests.conftest import RECIPES, assert_one_line_error, run_sfhpc


def _recipe(tmp_path: Path, model_path: Path, extra: str = "") -> Path:
    recipe = tmp_path / "demo.yaml"
    # The demo's model section shapes the model sfhpc builds: a folder of one's own takes its place.
    text = re.sub(r"\nmodel:\n(  .*\n)+", f"\nmodel:\n  path: {model_path}\n", (RECIPES / "demo.yaml").read_text())
    recipe.write_text(text + extra + f"output_dir: {tmp_path / 'runs'}\n")
    return recipe


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sfhpc.model.hf_folder import build_hf_model

    return build_hf_model(tmp_path_factory.mktemp("qwen2") / "model", "qwen2")


def _spoiled(qwen2: Path, tmp_path: Path, *, remove: tuple[str, ...] = (), config: dict | None = None) -> Path:
    folder = Path(shutil.copytree(qwen2, tmp_path / "model"))
    for name in remove:
        (folder / name).unlink()
    if config is not None:
        (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                        **config}))
    return folder


@pytest.mark.parametrize(("remove", "config", "extra", "what"), [
    (("tokenizer.json", "tokenizer_config.json"), None, "", "has no tokenizer (tokenizer.json"),
    (("chat_template.jinja",), None, "", "has a tokenizer without a chat template"),
    ((), {"model_type": "no-such-model", "architectures": ["NoSuchForCausalLM"]}, "",
     "holds a NoSuchForCausalLM model (model_type 'no-such-model'), which transformers cannot load"),
    pytest.param((), {"model_type": "xlnet", "architectures": ["XLNetLMHeadModel"]}, "",
                 "holds a XLNetLMHeadModel model, which vLLM cannot serve",
                 # Asked of vLLM's registry: where no vLLM is installed (the fast tier's venv), nothing to ask.
                 marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")),
    ((), {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "training: {backend: megatron}\n",
     "holds a MistralForCausalLM model; the megatron backend trains llama and qwen2 models only"),
], ids=["no-tokenizer", "no-chat-template", "unknown-to-transformers", "unknown-to-vllm", "megatron-mistral"])
def test_run_refuses_a_folder_without_tokenizer_or_of_an_unsupported_architecture(  # type: ignore[no-untyped-def]
        qwen2: Path, tmp_path: Path, remove, config, extra: str, what: str) -> None:
    # The check `sfhpc run` and `sfhpc launch` make first (the command-line tests below show they refuse in one
    # line before a run folder exists), called here in the test's process: transformers, which it asks for the
    # architectures it loads, is imported once for all cases instead of ~10 s in a new process for each.
    from sfhpc.config import load_recipe
    from sfhpc.rl.program import check_runnable

    model = _spoiled(qwen2, tmp_path, remove=remove, config=config)
    with pytest.raises(SfhpcError) as refused:
        check_runnable(load_recipe(_recipe(tmp_path, model, extra)))
    assert f"model.path: {model} {what}" in str(refused.value) and "\n" not in str(refused.value)


def _folder(tmp_path: Path, *files: str) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    for name in files:
        (folder / name).write_text("{}")
    return folder


@pytest.mark.parametrize(("make", "what"), [
    (lambda tmp: tmp / "nowhere", "does not exist"),
    (lambda tmp: _folder(tmp, "config.json") / "config.json", "is not a folder"),
    (lambda tmp: _folder(tmp), "has no config.json"),
    (lambda tmp: _folder(tmp, "config.json", "tokenizer.json"), "has no weights (*.safetensors or pytorch_model"),
], ids=["missing", "a-file", "empty-folder", "no-weights"])
def test_run_refuses_a_model_path_it_cannot_load(tmp_path: Path, make, what: str) -> None:  # type: ignore[no-untyped-def]
    model = make(tmp_path)
    done = run_sfhpc("run", str(_recipe(tmp_path, model)), timeout=60)
    assert_one_line_error(done, f"model.path: {model} {what}")
    assert not (tmp_path / "runs").exists()  # refused before a run folder (or a job) exists


def test_launch_refuses_it_too_before_touching_slurm(tmp_path: Path) -> None:
    model = _folder(tmp_path)
    done = run_sfhpc("launch", str(_recipe(tmp_path, model)), timeout=60)
    assert_one_line_error(done, f"model.path: {model} has no config.json")
    assert not (tmp_path / "runs").exists()


def test_a_hugging_face_folder_passes(qwen2: Path, tmp_path: Path) -> None:
    from sfhpc.config import load_recipe
    from sfhpc.rl.program import check_runnable

    check_runnable(load_recipe(_recipe(tmp_path, qwen2)))
    check_runnable(load_recipe(_recipe(tmp_path, qwen2, "training: {backend: megatron}\n")))
    mistral = _spoiled(qwen2, tmp_path, config={"model_type": "mistral", "architectures": ["MistralForCausalLM"]})
    check_runnable(load_recipe(_recipe(tmp_path, mistral)))  # the torch backend trains any causal LM
