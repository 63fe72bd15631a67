"""Tool calls in a model's own format: the generated text of a reply -> OpenAI's ``tool_calls``.

A model writes a tool call in the format its chat template renders one, and the template is what the model
was trained on, so that format is the only one a reply may use if its tokens are to be trained on as they
were generated. Three families cover most open models:

* ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call, after
  optional text (Qwen2.5, Qwen3, Hermes 2 Pro, and many fine-tunes of them);
* ``llama3_json``: the whole reply is ``{"name": ..., "parameters": {...}}`` (Llama 3.1-3.3's JSON tool
  calling), optionally after ``<|python_tag|>``, several calls separated by ``;``;
* ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (Mistral v3 templates), or
  ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11 templates).

The parser of a model is chosen from its chat template (`parser_for_template`), or named by the recipe.

Why not vLLM's parsers (``vllm.tool_parsers``), which read the same formats: importing them takes 12 s on
this project's 2-core machines and imports torch and transformers (4,740 modules), on every rank that
serves an endpoint, test-engine ranks and standalone endpoints included, which otherwise need neither; its
Llama parser refuses a tokenizer without ``<|python_tag|>`` and its Mistral parser needs mistral_common's
tokenizer. The formats themselves are a few lines each; what a reply holds is parsed once, when it is
whole, so no partial-JSON streaming state is needed (see `sfhpc.endpoint.protocol.ResponseBuilder`).

Text that starts a call but does not parse (cut by ``max_tokens``, JSON the model got wrong) is no call:
the reply is returned as content and `Parsed.failed` says so, for the endpoint to count. Nor is a call to a
function the request did not offer: a plain JSON answer such as ``{"name": "Alice", "age": 31}`` reads as a
call to ``Alice`` under the Llama 3.1 format, and a model may name a tool it saw in training; the reply is
content then, and `Parsed.unoffered` names what it called.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Iterable
from typing import Any, ClassVar

_DECODER = json.JSONDecoder()


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as a JSON text (OpenAI's ``function.arguments``)."""

    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class Parsed:
    """A whole reply read for tool calls: the text around them (None when there is none) and the calls.
    `failed`: the reply began a call that does not parse; `unoffered`: the functions it called that the
    request did not offer. Either way it is all content."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()
    failed: bool = False
    unoffered: tuple[str, ...] = ()


def canonical_arguments(arguments: Any) -> str:
    """Arguments as a JSON text, spelled as chat templates render them back (``tojson``: ``json.dumps``
    with its default separators, non-ASCII kept)."""
    return json.dumps(arguments, ensure_ascii=False)


def _call(obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a decoded ``{"name": ..., <argument key>: {...}}``; None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments: Any = next((obj[key] for key in argument_keys if key in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON text already
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], canonical_arguments(arguments))


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (text that may yet become the marker)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolCallParser:
    """Reads one model family's tool calls to the `offered` functions. Subclasses say where calls may begin
    (`held_from`, for streaming) and how a whole reply reads (`_read`)."""

    name: ClassVar[str]

    def __init__(self, offered: Iterable[str]) -> None:
        self.offered = frozenset(offered)

    def parse(self, text: str) -> Parsed:
        """A whole reply's calls; content only when any of them names a function that was not offered."""
        parsed = self._read(text)
        unoffered = tuple(dict.fromkeys(c.name for c in parsed.calls if c.name not in self.offered))
        return Parsed(text, unoffered=unoffered) if unoffered else parsed

    def call_id(self) -> str:
        """A new call's id (OpenAI's ``call_`` and 24 characters)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def held_from(self, text: str) -> int:
        """Where, in the reply so far, text that may belong to a tool call begins (``len(text)`` when none
        may): what is before it can be streamed as content now, the rest waits for the whole reply."""
        raise NotImplementedError

    def _read(self, text: str) -> Parsed:
        raise NotImplementedError


class MarkerParser(ToolCallParser):
    """Formats where every call follows a marker (``<tool_call>``, ``[TOOL_CALLS]``): text before the
    first marker is content."""

    marker: ClassVar[str]

    def held_from(self, text: str) -> int:
        at = text.find(self.marker)
        return at if at >= 0 else len(text) - partial_suffix(text, self.marker)

    def _read(self, text: str) -> Parsed:
        at = text.find(self.marker)
        if at < 0:
            return Parsed(text)
        calls = self._calls(text[at:])
        if not calls:
            return Parsed(text, failed=True)
        before = text[:at].strip()
        return Parsed(before or None, calls)

    def _calls(self, text: str) -> tuple[ToolCall, ...]:
        """The calls in `text` (which starts with the marker); () when any of it does not parse."""
        raise NotImplementedError


class HermesParser(MarkerParser):
    name = "hermes"
    marker = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def _calls(self, text: str) -> tuple[ToolCall, ...]:
        blocks = self._BLOCK.findall(text)
        # Everything after the first marker must be call blocks (and white space): a block left open, or
        # text between blocks, is a reply the model did not finish as a call.
        if not blocks or self._BLOCK.sub("", text).strip():
            return ()
        calls = []
        for block in blocks:
            try:
                call = _call(json.loads(block), ("arguments",))
            except json.JSONDecodeError:
                return ()
            if call is None:
                return ()
            calls.append(call)
        return tuple(calls)


class MistralParser(MarkerParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    _ARGS = "[ARGS]"

    def call_id(self) -> str:
        return uuid.uuid4().hex[:9]  # Mistral's templates refuse any id but 9 letters and digits

    def _calls(self, text: str) -> tuple[ToolCall, ...]:
        body = text[len(self.marker):].strip()
        if body.startswith("["):  # v3: one JSON list of calls
            try:
                items, end = _DECODER.raw_decode(body)
            except json.JSONDecodeError:
                return ()
            if not isinstance(items, list) or body[end:].strip():
                return ()
            read = [_call(item, ("arguments",)) for item in items]
            listed = tuple(c for c in read if c is not None)
            return listed if listed and len(listed) == len(read) else ()
        calls: list[ToolCall] = []  # v11: name[ARGS]{...}, each call after its own marker
        for part in text.split(self.marker)[1:]:
            name, sep, arguments = part.partition(self._ARGS)
            try:
                obj, end = _DECODER.raw_decode(arguments.strip())
            except json.JSONDecodeError:
                return ()
            call = _call({"name": name.strip(), "arguments": obj}, ("arguments",))
            if not sep or call is None or arguments.strip()[end:].strip():
                return ()
            calls.append(call)
        return tuple(calls)


class Llama3JsonParser(ToolCallParser):
    """The whole reply is the call(s); a reply that starts otherwise is content."""

    name = "llama3_json"
    _TAG = "<|python_tag|>"

    def held_from(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith(("{", self._TAG)) or self._TAG.startswith(stripped):
            return 0
        return len(text)

    def _read(self, text: str) -> Parsed:
        body = text.strip()
        tagged = body.startswith(self._TAG)
        body = body.removeprefix(self._TAG).strip()
        if not body.startswith("{"):
            return Parsed(text, failed=tagged)
        calls, rest = [], body
        while rest:
            try:
                obj, end = _DECODER.raw_decode(rest)
            except json.JSONDecodeError:
                return Parsed(text, failed=True)
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return Parsed(text, failed=True)
            calls.append(call)
            rest = rest[end:].strip()
            if rest.startswith(";"):
                rest = rest[1:].strip()
            elif rest:
                return Parsed(text, failed=True)
        return Parsed(None, tuple(calls))


PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def parser_for_template(template: str) -> str | None:
    """The tool-call format a chat template renders calls in (a key of `PARSERS`); None when the template
    renders no tool calls (or none of a known format)."""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "tool_calls" in template and any(mark in template for mark in ('"parameters"', "python_tag", "ipython")):
        return "llama3_json"
    return None


def renders_tools(template: str) -> bool:
    """Whether a chat template reads the offered tools (the ``tools`` variable) at all."""
    return re.search(r"\btools\b", template) is not None
