"""Hugging Face folders built here (no downloads) and the tokenizer sfhpc speaks them with: the folders load
in transformers as the architecture they claim, the chat template's tokens are what transformers gives, the
stop ids are the template's end-of-turn token and the EOS, the warm start's targets are the model's reply and
its stop token only, and a multi-turn history re-encoded differently from what the model sampled forks the
trajectory (the trained branch is the one the model read last)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sfhpc.config.recipe import BuildSpec, ModelSpec
from sfhpc.data.manager import TrajectoryManager
from sfhpc.engine.hf_tokenizer import HFTokenizer
from sfhpc.engine.tokenizer import ByteTokenizer, load_tokenizer, run_tokenizer, tokenizer_kind
from sfhpc.model.hf_folder import build_hf_model
from sfhpc.model.warm_start import encode_with_targets
from sfhpc.trainer.batch import TrainBatch

CONVERSATION = [{"role": "user", "content": "after b"}, {"role": "assistant", "content": "c"},
                {"role": "user", "content": "and after c?"}, {"role": "assistant", "content": "d, I think"}]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    arch = request.param
    return arch, build_hf_model(tmp_path_factory.mktemp(arch) / "model", arch, kv_heads=1 if arch == "llama" else None)


def test_the_folder_loads_in_transformers_as_its_architecture(built: tuple[str, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch, folder = built
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == arch and config["architectures"] == [{"qwen2": "Qwen2ForCausalLM",
                                                                          "llama": "LlamaForCausalLM"}[arch]]
    model = AutoModelForCausalLM.from_pretrained(folder)
    names = {n for n, _ in model.named_parameters()}
    if arch == "qwen2":  # QKV bias, tied output layer
        assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.v_proj.bias"} <= names
        assert "lm_head.weight" not in names
    else:  # grouped-query attention (one key/value head), untied output layer, no biases
        assert model.model.layers[0].self_attn.k_proj.weight.shape == (64, 128)
        assert "lm_head.weight" in names and not any(n.endswith(".bias") for n in names)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.config.vocab_size >= len(tokenizer) and model.config.vocab_size % 64 == 0
    assert tokenizer.chat_template


def test_transformers_cuts_text_as_the_folders_tokenizer_does(built: tuple[str, Path]) -> None:
    """transformers opens a qwen2 folder with its own Qwen2Tokenizer, which sets Qwen2's split pattern (every
    digit apart) whatever tokenizer.json says: the built folder uses that pattern, so numbers are the same
    tokens to sfhpc (engine, endpoint, trainer) and to transformers."""
    from transformers import AutoTokenizer

    _, folder = built
    text = "Hal had 42, then found 555.\n\n  x  y's 7"
    ours = HFTokenizer.from_folder(folder)
    assert AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)["input_ids"] == ours.encode(text)


def test_chat_tokens_and_stop_ids_are_the_templates(built: tuple[str, Path]) -> None:
    arch, folder = built
    assert tokenizer_kind(folder) == "hf"
    tokenizer = load_tokenizer(folder)
    assert isinstance(tokenizer, HFTokenizer)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)  # the reference: transformers' own tokenizer of the folder
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ünïcode, after b?"}]
    ids = tokenizer.apply_chat_template(messages)
    assert ids == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    # The generation prompt is where the reply starts in the same conversation re-rendered with it (a
    # newline run is one piece wherever it stands), so what the warm start trains is what RL samples after.
    answered = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": "c"}],
                                             add_generation_prompt=False)
    assert answered[: len(ids)] == ids
    assert answered[len(ids):len(ids) + 2] == [*tokenizer.encode("c"), tokenizer.chat_stop_ids[0]]
    head = {"qwen2": "<|im_start|>", "llama": "<|begin_of_text|>"}[arch]
    assert hf.convert_ids_to_tokens(ids[0]) == head  # the template's special tokens are in the prompt
    end_of_turn = {"qwen2": "<|im_end|>", "llama": "<|eot_id|>"}[arch]
    eos = {"qwen2": "<|im_end|>", "llama": "<|end_of_text|>"}[arch]
    assert hf.convert_ids_to_tokens(list(tokenizer.chat_stop_ids))[0] == end_of_turn
    assert hf.convert_ids_to_tokens(tokenizer.eos_id) == eos and tokenizer.eos_id in tokenizer.chat_stop_ids
    assert tokenizer.bos_id == (hf.convert_tokens_to_ids("<|begin_of_text|>") if arch == "llama" else None)

    text = "héllo ✓ wörld"
    pieces = tokenizer.encode(text)
    decoder = tokenizer.stream_decoder()
    streamed = [decoder.feed([t]) for t in pieces]
    assert "".join(streamed) + decoder.flush() == text == tokenizer.decode(pieces)
    assert "\ufffd" not in "".join(streamed)  # a character split over tokens is sent once, whole
    assert b"".join(bytes(tokenizer.token_bytes(t)) for t in pieces) == text.encode()


def test_warm_start_targets_are_the_reply_and_its_stop_token(built: tuple[str, Path]) -> None:
    _, folder = built
    tokenizer = load_tokenizer(folder)
    ids, targets = encode_with_targets(CONVERSATION, tokenizer)
    replies = [[t for t, target in zip(ids, targets) if target]]
    # Split the target tokens into their runs: one per assistant message.
    runs, current = [], []
    for token, target in zip(ids, targets):
        if target:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    stop = tokenizer.chat_stop_ids[0]
    assert [tokenizer.decode(r) for r in runs] == ["c", "d, I think"] and all(r[-1] == stop for r in runs)
    assert sum(len(r) for r in runs) == len(replies[0])


def test_a_history_spelled_otherwise_forks_and_the_last_branch_is_trained(tmp_path: Path) -> None:
    """A reply sampled as single characters (" ", "t", "h", "e") comes back in the next turn's history as the
    BPE's own spelling (" the", one token): the manager forks where they differ, keeps both branches, and the
    trained row is the branch the model read last (its earlier reply as a prompt, not as generated tokens)."""
    folder = build_hf_model(tmp_path / "model", "qwen2")
    tokenizer = load_tokenizer(folder)
    first = [{"role": "user", "content": "say hello"}]
    prompt = tokenizer.apply_chat_template(first)
    # A word the BPE spells as one token (with its leading space), sampled one character at a time.
    word = next(w for w in (" the", " what", " after", " letter") if len(tokenizer.encode(w)) == 1)
    sampled = [t for c in word for t in tokenizer.encode(c)] + [tokenizer.chat_stop_ids[0]]
    assert tokenizer.decode(sampled) == word and tokenizer.encode(word)[0] != sampled[0]
    manager = TrajectoryManager()
    tid = manager.start(prompt, group="g")
    manager.add_generated(tid, sampled, [-1.0] * len(sampled), 0, finish_reason="stop")
    history = [*first, {"role": "assistant", "content": tokenizer.decode(sampled)},
               {"role": "user", "content": "again"}]
    second = tokenizer.apply_chat_template(history)
    manager.observe(tid, second)
    assert manager.context(tid) == second  # the current branch is what the model reads now
    reply = tokenizer.encode(word) + [tokenizer.chat_stop_ids[0]]
    manager.add_generated(tid, reply, [-0.5] * len(reply), 1, finish_reason="stop")
    manager.finish(tid, 1.0)
    trajectory = manager.trajectory(tid)
    fork = trajectory.segments[2]
    assert len(trajectory.segments) == 4 and (fork.parent, fork.fork_at) in ((0, len(prompt)), (1, 0))  # forked
    assert trajectory.segments[1].tokens.tolist() == sampled  # the sampled reply is kept, on its own branch
    batch = TrainBatch.from_trajectories([trajectory])
    assert batch.tokens[0, : batch.lengths[0]].tolist() == second + reply
    assert int(batch.generated[0].sum()) == len(reply)  # only the last reply is trained on


def test_the_default_model_is_a_hugging_face_folder_with_its_tasks_text_in_the_tokenizer(tmp_path: Path) -> None:
    """The model a recipe without ``model.path`` builds is an ordinary Hugging Face folder, spoken to through
    `HFTokenizer`; its tokenizer is trained on the task's text too, so the task's words are single tokens."""
    from sfhpc.config.recipe import TaskSpec
    from sfhpc.model.folder import model_folder_problem
    from sfhpc.model.tiny import build_tiny_model
    from sfhpc.tasks import get_task

    spec = ModelSpec(build=BuildSpec(layers=1, hidden_size=64, heads=1))
    folder = build_tiny_model(spec, tmp_path / "tiny", task=get_task(TaskSpec("guess-number")))
    assert model_folder_problem(folder) is None and tokenizer_kind(folder) == "hf"
    tokenizer = load_tokenizer(folder)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.vocab_size == 512
    generic = load_tokenizer(build_tiny_model(spec, tmp_path / "generic"))
    assert len(tokenizer.encode("guess 0-9")) < len(generic.encode("guess 0-9"))
    assert [len(tokenizer.encode(w)) for w in ("guess", " higher", " lower", "7")] == [1, 1, 1, 1]
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"  # ModelSpec.architecture
    # The brief chat template: one token per role, the end-of-turn token ends a reply.
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "guess 0-9"}])
    assert tokenizer.decode(prompt, skip_special=False) == "<|bos|><|user|>guess 0-9<|end|><|assistant|>"
    assert tokenizer.decode(tokenizer.chat_stop_ids, skip_special=False) == "<|end|><|eos|>"


def test_folders_without_a_tokenizer_and_runs_from_before_models_had_one(tmp_path: Path) -> None:
    assert tokenizer_kind(tmp_path) is None
    with pytest.raises(ValueError, match="holds no tokenizer"):
        load_tokenizer(tmp_path)
    assert isinstance(run_tokenizer({}, None), ByteTokenizer)  # a store from before runs named their model
