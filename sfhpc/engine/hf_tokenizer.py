"""A Hugging Face model's own tokenizer and chat template, behind `ChatTokenizer`.

The prompt of a chat request is exactly ``tokenizer.apply_chat_template(messages, add_generation_prompt=True,
tokenize=True)``: the template's special tokens (BOS, role headers) included, nothing added or dropped, so
the policy reads what it was trained to read.

Where a reply ends. The model's EOS (``eos_token_id`` of the tokenizer, ``config.json`` and
``generation_config.json``) and the template's end-of-turn token. The latter is found by rendering a short
conversation and taking the special token that follows the assistant's text: ``<|im_end|>`` for ChatML,
``<|eot_id|>`` for Llama 3, ``</s>`` for Mistral. Both are stop tokens, and the stop token is kept at the
end of the reply, so a re-rendered history holds the same token there.

Multi-turn. A chat template re-encodes earlier replies from their *text*; a BPE tokenizer may spell that
text with other tokens than the model sampled (or a template may rewrite it, e.g. drop reasoning). The
trajectory manager then records the new prompt as a branch that forks where the two differ
(`sfhpc.data.manager.TrajectoryManager.observe`): the trajectory keeps both, the current branch is what the
policy actually read last, and only the replies on it are trained on.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from sfhpc.engine import chat_template
from sfhpc.engine.tokenizer import ChatFormatError

_PROBE_REPLY = "sfhpc probe reply"  # the assistant text of the conversation that finds the end-of-turn token
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")  # beside tokenizer_config.json's key
NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")  # the template sees them by these names
# Spaces transformers removes on decode for tokenizers that ask (clean_up_tokenization_spaces), BPE excepted.
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _byte_level_table() -> dict[str, int]:
    """GPT-2's printable stand-ins for bytes (what byte-level BPE vocabularies spell tokens with) -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_LEVEL = _byte_level_table()


class HFStreamDecoder:
    """Decodes a reply as its tokens arrive: text is sent once a character is whole (a byte-level token may
    hold half of one), and never taken back.

    Decoding goes by windows: each call decodes the tokens since the text last sent began (`_start`, with the
    new ones) and sends what that window's text adds to the text of its tokens already sent (`_read`). Only a
    whole sequence decodes right in general (a token may complete a character an earlier one began, a
    sentencepiece decoder drops a leading space per call), and a window starts on a token whose text was
    sent whole, so the difference is what the whole decode would add; each token is decoded a bounded number
    of times, so a reply of n tokens costs O(n) (decoding the whole reply at every token cost O(n^2): 8,000
    tokens took seconds).
    """

    def __init__(self, tokenizer: Any, *, skip_special: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._ids: list[int] = []
        self._start = 0  # the window: ids[_start:] is decoded at each call
        self._read = 0  # ids[_start:_read]: the tokens whose text went out already

    def feed(self, ids: Iterable[int]) -> str:
        self._ids.extend(int(t) for t in ids)
        if len(self._ids) == self._read:
            return ""
        sent = self._decode(self._ids[self._start:self._read])
        text = self._decode(self._ids[self._start:])
        if text.endswith("\ufffd") or len(text) <= len(sent):
            return ""  # an incomplete UTF-8 sequence (or nothing yet): wait for the token that completes it
        self._start, self._read = self._read, len(self._ids)
        return text[len(sent):]

    def flush(self) -> str:
        sent = self._decode(self._ids[self._start:self._read])
        text = self._decode(self._ids[self._start:])
        self._start = self._read = len(self._ids)
        return text[len(sent):]

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special=self._skip_special)) if ids else ""


class HFTokenizer:
    """`ChatTokenizer` over a model folder's own tokenizer (``tokenizer.json``, read by ``tokenizers``) and its
    chat template (`sfhpc.engine.chat_template`): what ``transformers``' fast tokenizer of the folder gives,
    without importing ``transformers`` (the tests hold the two equal)."""

    def __init__(self, tokenizer: Any, *, chat_template: str, special_tokens: Mapping[str, str],
                 extra_special: Sequence[str] = (), model_vocab_size: int | None = None,
                 eos_ids: Sequence[int] = (), clean_up_spaces: bool = False) -> None:
        if not chat_template:
            raise ValueError("the tokenizer has no chat template")
        self._tok = tokenizer
        self._template = chat_template
        self._named = dict(special_tokens)  # bos_token, eos_token, pad_token, unk_token -> their text
        self._model_vocab_size = model_vocab_size
        self._extra_eos = tuple(int(t) for t in eos_ids)
        # transformers skips its clean-up of spaces before punctuation for BPE models: it corrupts their text.
        self._clean_up = clean_up_spaces and type(tokenizer.model).__name__ != "BPE"
        # Named specials (BOS, EOS, pad) and every added token marked special (role headers, end-of-turn).
        named = [self._tok.token_to_id(t) for t in (*self._named.values(), *extra_special)]
        added = [i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special]
        self._special = frozenset(int(t) for t in (*named, *added) if t is not None)

    @classmethod
    def from_folder(cls, model_dir: str | Path) -> HFTokenizer:
        """The folder's tokenizer and chat template, with the EOS ids of its configs."""
        folder = Path(model_dir)
        config = _json(folder / "tokenizer_config.json")
        special = {**_json(folder / "special_tokens_map.json"), **config}
        named = {key: text for key in NAMED_SPECIALS if (text := _token_text(special.get(key)))}
        extra = [t for t in map(_token_text, special.get("additional_special_tokens") or []) if t]
        vocab, eos = None, []
        for name in ("config.json", "generation_config.json"):
            model_config = _json(folder / name)
            vocab = vocab or model_config.get("vocab_size")
            eos += _ids(model_config.get("eos_token_id"))
        return cls(_backend(folder), chat_template=read_chat_template(folder, config), special_tokens=named,
                   extra_special=extra, model_vocab_size=vocab, eos_ids=eos,
                   clean_up_spaces=bool(config.get("clean_up_tokenization_spaces", False)))

    @property
    def backend(self) -> Any:
        """The ``tokenizers.Tokenizer`` itself."""
        return self._tok

    # -- ids -----------------------------------------------------------------------------------------
    @cached_property
    def vocab_size(self) -> int:
        # The model's embedding may have more rows than the tokenizer has tokens (padded for speed).
        return max(self._tok.get_vocab_size(with_added_tokens=True), int(self._model_vocab_size or 0))

    def _named_id(self, key: str) -> int | None:
        text = self._named.get(key)
        return None if text is None else self._tok.token_to_id(text)

    @property
    def eos_id(self) -> int:
        eos = self._named_id("eos_token")
        if eos is None:
            eos = self._extra_eos[0] if self._extra_eos else self.chat_stop_ids[0]
        return int(eos)

    @property
    def bos_id(self) -> int | None:
        bos = self._named_id("bos_token")
        return None if bos is None else int(bos)

    @property
    def pad_id(self) -> int:
        pad = self._named_id("pad_token")
        return int(pad) if pad is not None else self.eos_id

    @cached_property
    def chat_stop_ids(self) -> tuple[int, ...]:
        """The template's end-of-turn token first, then every EOS the folder names."""
        stops = [t for t in (self._end_of_turn(), self._named_id("eos_token"), *self._extra_eos) if t is not None]
        return tuple(dict.fromkeys(int(t) for t in stops))

    def _end_of_turn(self) -> int | None:
        """The special token the template writes right after an assistant message's text."""
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE_REPLY}]
        try:
            ids = self.apply_chat_template(messages, add_generation_prompt=False)
        except ChatFormatError:
            return None
        text = self.encode(_PROBE_REPLY)
        for start in range(len(ids) - len(text), -1, -1):  # the last occurrence: the assistant's
            if ids[start:start + len(text)] == text:
                following = ids[start + len(text):]
                return next((t for t in following if t in self._special), None)
        return None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")

    # -- text ----------------------------------------------------------------------------------------
    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        head = [self.bos_id] if bos and self.bos_id is not None else []
        return head + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        text = str(self._tok.decode([int(t) for t in ids], skip_special_tokens=skip_special))
        return _clean_up(text) if self._clean_up else text

    def stream_decoder(self, *, skip_special: bool = True) -> HFStreamDecoder:
        return HFStreamDecoder(self, skip_special=skip_special)

    def token_bytes(self, token_id: int) -> list[int]:
        """The UTF-8 bytes of one token (OpenAI's ``logprobs.content[].bytes``); a byte-level token that holds
        part of a character gives its raw bytes."""
        self.check_id(token_id)
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:  # an embedding row past the tokenizer (padding): no text
            return []
        if token_id not in self._special:
            if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:  # sentencepiece byte
                return [int(piece[3:5], 16)]
            if all(c in _BYTE_LEVEL for c in piece) and self._byte_level:
                return [_BYTE_LEVEL[c] for c in piece]
        return list(self.decode([token_id], skip_special=False).encode("utf-8"))

    def token_text(self, token_id: int) -> str:
        """A display form of one token: its text, or ``bytes:\\xNN...`` when it holds part of a character."""
        raw = bytes(self.token_bytes(token_id))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    @cached_property
    def _byte_level(self) -> bool:
        """Whether the vocabulary spells tokens with GPT-2's byte stand-ins (a ByteLevel decoder)."""
        return "ByteLevel" in self._tok.to_str()

    # -- chat ----------------------------------------------------------------------------------------
    @property
    def chat_template(self) -> str:
        return self._template

    def apply_chat_template(self, messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, object]] | None = None) -> list[int]:
        """The model's own chat template, tokenized: exactly what ``transformers``' ``apply_chat_template``
        gives (the rendered text encoded without adding special tokens: the template writes them), `tools`
        (OpenAI's function tools) included."""
        from jinja2 import TemplateError

        try:
            text = chat_template.render(self._template, messages, add_generation_prompt=add_generation_prompt,
                                        special_tokens=self._named, tools=tools)
        except TemplateError as exc:  # the template's own refusal (e.g. roles that must alternate)
            raise ChatFormatError(f"the model's chat template refused the messages: {exc}") from exc
        return [int(t) for t in self._tok.encode(text, add_special_tokens=False).ids]


def _backend(folder: Path) -> Any:
    """The folder's ``tokenizers.Tokenizer``: its ``tokenizer.json``, or (a folder with only a slow tokenizer's
    files, e.g. sentencepiece's ``tokenizer.model``) the one ``transformers`` converts them to."""
    from tokenizers import Tokenizer

    if (folder / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(folder / "tokenizer.json"))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder).backend_tokenizer


def read_chat_template(folder: Path, config: Mapping[str, Any] | None = None) -> str:
    """The template the folder names ("" for none): ``chat_template.jinja``, ``chat_template.json`` or the key
    in ``tokenizer_config.json`` (`config`, read here when not given; the ``default`` of a list of named
    templates)."""
    if config is None:
        config = _json(folder / "tokenizer_config.json")
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = _json(folder / "chat_template.json").get("chat_template") or config.get("chat_template") or ""
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), "")
    return str(template or "")


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_text(value: object) -> str | None:
    """A special token as the configs write it: its text, or an AddedToken's dict with its ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _clean_up(text: str) -> str:
    for before, after in _CLEAN_UP:
        text = text.replace(before, after)
    return text


def _ids(value: object) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []
