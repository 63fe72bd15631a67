"""The tokenizer interface (`ChatTokenizer`), the byte-level tokenizer, and `load_tokenizer`, which picks
the tokenizer of a model folder.

Every component that turns text into token ids (the endpoint, the warm start, the analysis) goes through
`ChatTokenizer`, so the ids an agent's messages become are the ones the model reads. A model folder brings
its own tokenizer and chat template (`sfhpc.engine.hf_tokenizer`), the one sfhpc builds for a recipe without
``model.path`` included (`sfhpc.model.tiny`). The byte-level tokenizer below is what the folders sfhpc built
before that speak (their ``sfhpc_model.json`` says so), and what the stores of their runs are decoded with.

Byte-level tokenizer: ids 0-255 are the bytes of UTF-8 text, a few ids above them are markers. Any text
encodes losslessly; there are no merges.

Chat format. A conversation is the BOS marker, then one block per message, then the generation prompt:

    <|bos|> <|system|> ...bytes... <|end|> <|user|> ...bytes... <|end|> <|assistant|> ...bytes... <|end|>
    <|assistant|>                                   <- generation prompt: the model writes the reply

The model ends its reply with ``<|end|>`` (the chat stop token), so the assistant block that the next
turn's template re-encodes is exactly the tokens the model wrote: a multi-turn conversation only ever
appends to the token sequence, and the trajectory tree does not branch.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

BYTE_VOCAB = 256
PAD = 256
BOS = 257
EOS = 258
END = 259  # end of one chat message
SYSTEM = 260
USER = 261
ASSISTANT = 262
TOOL = 263
VOCAB_SIZE = 264

SPECIAL_NAMES: Mapping[int, str] = {
    PAD: "<|pad|>", BOS: "<|bos|>", EOS: "<|eos|>", END: "<|end|>",
    SYSTEM: "<|system|>", USER: "<|user|>", ASSISTANT: "<|assistant|>", TOOL: "<|tool|>",
}
ROLE_MARKERS: Mapping[str, int] = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}


class ChatFormatError(ValueError):
    """A message list that the chat format cannot encode (the caller turns it into a user-facing error)."""


class TextDecoder(Protocol):
    """Incremental decoding: `feed` new ids, get the text they complete; `flush` what is held back."""

    def feed(self, ids: Iterable[int]) -> str: ...

    def flush(self) -> str: ...


class ChatTokenizer(Protocol):
    """What the endpoint, the warm start and the analysis need of a model's tokenizer.

    ``vocab_size`` bounds the ids the model may read or write (the embedding's rows); ``chat_stop_ids`` end
    an assistant reply (the end-of-turn token of the chat template and the model's EOS); ``eos_id`` ends a
    plain completion; ``pad_id`` fills batches.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def chat_stop_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]: ...

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str: ...

    def stream_decoder(self, *, skip_special: bool = True) -> TextDecoder: ...

    def is_special(self, token_id: int) -> bool: ...

    def token_text(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> list[int]: ...

    @property
    def chat_template(self) -> str:
        """The source of the model's chat template ("" when it is built in): tool-call formats are read from it."""
        ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, object]] | None = None) -> list[int]: ...


BYTE_MARKER_KEY = "tokenizer"  # in sfhpc_model.json: "byte" names this module's tokenizer
MODEL_MARKER = "sfhpc_model.json"  # written next to the weights of the byte-level tiny models
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # what AutoTokenizer builds from


def tokenizer_kind(model_dir: str | Path) -> str | None:
    """``"hf"`` for a folder with Hugging Face tokenizer files, ``"byte"`` for one an earlier sfhpc built with
    the byte vocabulary, None when the folder holds neither (no tokenizer to speak to the model with)."""
    folder = Path(model_dir)
    if any((folder / name).is_file() for name in HF_TOKENIZER_FILES):
        return "hf"
    marker = folder / MODEL_MARKER
    if marker.is_file():
        try:
            info = json.loads(marker.read_text())
        except (OSError, ValueError):
            return None
        # Folders built before the key existed were all byte-level: sfhpc had no other tokenizer then.
        if isinstance(info, dict) and info.get(BYTE_MARKER_KEY, "byte") == "byte":
            return "byte"
    return None


def load_tokenizer(model_dir: str | Path) -> ChatTokenizer:
    """The tokenizer of a model folder: its own (Hugging Face) one, or the byte-level one of a tiny model an
    earlier sfhpc built. A folder with neither is refused before any job starts (`sfhpc.model.folder`); here
    it raises."""
    kind = tokenizer_kind(model_dir)
    if kind == "hf":
        from sfhpc.engine.hf_tokenizer import HFTokenizer

        return HFTokenizer.from_folder(model_dir)
    if kind == "byte":
        return ByteTokenizer()
    raise ValueError(f"{model_dir} holds no tokenizer (no {' or '.join(HF_TOKENIZER_FILES)}, no byte-level "
                     f"{MODEL_MARKER})")


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """Text <-> token ids over bytes plus the markers above. Stateless, so one instance serves everyone."""

    vocab_size: int = VOCAB_SIZE
    bos_id: int = BOS
    eos_id: int = EOS
    pad_id: int = PAD
    end_id: int = END

    @property
    def chat_stop_ids(self) -> tuple[int, ...]:
        """Tokens that end an assistant reply."""
        return (END, EOS)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([BOS] if bos else []) + ids + ([EOS] if eos else [])

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """Text of `ids`; byte runs that are not valid UTF-8 become U+FFFD, markers are dropped or named."""
        decoder = self.stream_decoder(skip_special=skip_special)
        return decoder.feed(ids) + decoder.flush()

    def stream_decoder(self, *, skip_special: bool = True) -> StreamDecoder:
        return StreamDecoder(skip_special=skip_special)

    def is_special(self, token_id: int) -> bool:
        return token_id >= BYTE_VOCAB

    def token_text(self, token_id: int) -> str:
        """A display form of one token (OpenAI's ``logprobs.content[].token``): the character for a byte
        that is one on its own, ``bytes:\\xNN`` for a byte inside a multi-byte character, the marker name."""
        self.check_id(token_id)
        if token_id in SPECIAL_NAMES:
            return SPECIAL_NAMES[token_id]
        return chr(token_id) if token_id < 0x80 else f"bytes:\\x{token_id:02x}"

    def token_bytes(self, token_id: int) -> list[int]:
        """The UTF-8 bytes of one token (OpenAI's ``logprobs.content[].bytes``)."""
        self.check_id(token_id)
        return [token_id] if token_id < BYTE_VOCAB else list(SPECIAL_NAMES[token_id].encode())

    def check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def chat_template(self) -> str:
        return ""  # the format is built in, and it has no tools

    def apply_chat_template(self, messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, object]] | None = None) -> list[int]:
        """Token ids of a conversation in the format of the module docstring.

        Each message needs a ``role`` (system, user, assistant, tool) and a string ``content``. The format
        renders no tools: `tools` must be empty.
        """
        if tools:
            raise ChatFormatError("the byte-level chat format renders no tools")
        ids = [BOS]
        for index, message in enumerate(messages):
            role = message.get("role")
            if not isinstance(role, str) or role not in ROLE_MARKERS:
                raise ChatFormatError(f"messages[{index}].role must be one of {sorted(ROLE_MARKERS)}, "
                                      f"found {role!r}")
            content = message.get("content")
            if not isinstance(content, str):
                raise ChatFormatError(f"messages[{index}].content must be a string")
            ids.append(ROLE_MARKERS[role])
            ids.extend(content.encode("utf-8"))
            ids.append(END)
        if add_generation_prompt:
            ids.append(ASSISTANT)
        return ids


class StreamDecoder:
    """Decodes tokens as they arrive: a character split over two chunks comes out whole, once."""

    def __init__(self, *, skip_special: bool = True) -> None:
        self._bytes = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._skip_special = skip_special

    def feed(self, ids: Iterable[int]) -> str:
        out: list[str] = []
        for token_id in ids:
            if token_id < BYTE_VOCAB:
                out.append(self._bytes.decode(bytes((token_id,))))
            elif not self._skip_special:
                out.append(self._bytes.decode(b"", final=True))
                out.append(SPECIAL_NAMES.get(token_id, f"<|{token_id}|>"))
        return "".join(out)

    def flush(self) -> str:
        return self._bytes.decode(b"", final=True)


def run_tokenizer(run_metadata: Mapping[str, object], run_folder: Path | None) -> ChatTokenizer:
    """The tokenizer a run's trajectories are in: that of the model folder the run's store names (``model``
    in its run metadata), else of the model a run builds in its folder; the byte-level one for runs whose
    model folder is not here (runs from before the store named it were all byte-level)."""
    candidates = [Path(str(run_metadata["model"]))] if run_metadata.get("model") else []
    if run_folder is not None:
        candidates.append(run_folder / "model")
    for folder in candidates:
        if tokenizer_kind(folder) is not None:
            return load_tokenizer(folder)
    return ByteTokenizer()
