"""The endpoint's tokenizer of a Hugging Face folder (``tokenizers`` and the project's own rendering of the chat
template, without ``transformers``) equals ``transformers``' fast tokenizer of the same folder: prompt ids,
text, special tokens, and the template conventions real models' templates use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from sfhpc.engine.hf_tokenizer import HFTokenizer
from sfhpc.engine.tokenizer import ChatFormatError
from sfhpc.model.hf_folder import build_hf_model

CONVERSATIONS = [
    [{"role": "user", "content": "after b?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ünïcode ✓, after b?"},
     {"role": "assistant", "content": "c"}, {"role": "user", "content": "and after c?  "}],
]

# Features of real templates (Qwen's and Llama 3's use each of these): loop controls, the tojson filter,
# raise_exception, a {% generation %} block, whitespace control, the special tokens as variables.
FEATURED = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}"
    "{% endif %}{% if loop.index > 3 %}{% break %}{% endif %}\n"
    "  {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | tojson }}{% endgeneration %}"
    "{{ eos_token }}{% else %}{{ m['role'] }}: {{ m['content'] | trim }}\n{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hf_model(tmp_path_factory.mktemp(request.param), request.param, layers=1, hidden_size=64,
                          heads=1, tokenizer_vocab=300)


def test_equals_transformers_on_the_folders_own_template(folder: Path) -> None:
    ours, hf = HFTokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    for messages in CONVERSATIONS:
        for generation_prompt in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt) == \
                hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                       return_dict=False)
    text = "héllo ✓ wörld, 12 + 3 = 15?"
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    ids = ours.apply_chat_template(CONVERSATIONS[1])
    for skip in (True, False):
        assert ours.decode(ids, skip_special=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert (ours.eos_id, ours.bos_id, ours.pad_id) == \
        (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id)
    assert ours.vocab_size >= len(hf)
    specials = set(hf.all_special_ids) | {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert {i for i in range(len(hf)) if ours.is_special(i)} == specials
    pieces = ours.encode(text)
    assert b"".join(bytes(ours.token_bytes(t)) for t in pieces) == text.encode("utf-8")
    assert [ours.token_text(t) for t in pieces if not ours.token_text(t).startswith("bytes:")] == \
        [t for t in (hf.decode([p]) for p in pieces) if "\ufffd" not in t]


def test_template_conventions_equal_transformers(folder: Path) -> None:
    config_path = folder / "tokenizer_config.json"
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads(config_path.read_text())
    # A list of named templates, as some folders have: the default one applies.
    config["chat_template"] = [{"name": "default", "template": FEATURED}, {"name": "tool_use", "template": "x"}]
    config_path.write_text(json.dumps(config))
    ours, hf = HFTokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    messages = [*CONVERSATIONS[1], {"role": "assistant", "content": 'say "hi" <b>'}]
    for generation_prompt in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt) == \
            hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                   return_dict=False)
    with pytest.raises(ChatFormatError, match="no tools here"):
        ours.apply_chat_template([{"role": "tool", "content": "42"}])
