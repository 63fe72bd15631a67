"""The OpenAI wire format: request bodies -> `TurnRequest`, `TurnResult` / `TokenDelta` -> response bodies.

Supported: ``/v1/chat/completions`` and ``/v1/completions`` with ``max_tokens`` (chat also
``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``, ``stream`` + ``stream_options.include_usage``,
``logprobs`` (the sampled token's logprob; no alternatives), ``user``, ``stop`` (up to 4 strings, OpenAI's
semantics: the text ends before the first one met; the tokens generated up to it are recorded as they
were sampled), ``n`` (not streamed; each choice a trajectory of its own); chat also takes function
``tools``, ``tool_choice`` and ``parallel_tool_calls`` (`sfhpc.endpoint.tools`), and answers with
``tool_calls`` read from the reply in the model's own format (`sfhpc.endpoint.tool_parsers`), and
``response_format`` (``json_object``, ``json_schema``: asked in the prompt and checked on the reply, not
enforced by decoding; `sfhpc.endpoint.response_format` says why). Any ``model``
name is accepted: a run serves one policy, whatever name an agent's author wrote. Parameters that would
change what the model does and that the endpoint cannot honour (penalties, ``logit_bias``, top-k
alternatives, ``echo``, ``best_of``, and vLLM's sampling extensions ``top_k``,
``min_p``, ``repetition_penalty``) are refused with a 400 instead of being ignored silently. A
``temperature`` or ``top_p`` left out stays None here: the endpoint fills in its default
(`Sampling.resolved`).

Extensions: ``stop_token_ids`` in the request (vLLM's name); in the response ``prompt_token_ids`` and
``trajectory_id`` at the top level and ``token_ids`` / ``token_versions`` (the weight version of each
token) in every choice and streamed chunk.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

from sfhpc.endpoint.errors import BadRequest
from sfhpc.endpoint.fields import Fields
from sfhpc.endpoint.response_format import ResponseFormat, read_response_format
from sfhpc.endpoint.service import Sampling, TokenDelta, TurnRequest, TurnResult
from sfhpc.endpoint.tool_parsers import Parsed, ToolCallParser, partial_suffix
from sfhpc.endpoint.tools import ToolRequest, history_message, read_tools
from sfhpc.engine.tokenizer import ChatFormatError, ChatTokenizer

Route = Literal["chat", "completions"]
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_INT64 = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class ApiRequest:
    """A parsed request: the turn to run and how to answer it."""

    route: Route
    model: str
    turn: TurnRequest
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    tools: ToolRequest | None = None  # chat requests that offer function tools
    stop: tuple[str, ...] = ()  # the reply's text ends before the first of these it holds
    n: int = 1  # choices: each a trajectory of its own
    response_format: ResponseFormat | None = None  # a reply in JSON, asked in the prompt and checked


@dataclasses.dataclass(frozen=True)
class Identity:
    """Who is asking, from the HTTP headers (or the in-process client's arguments)."""

    trajectory_id: str | None = None
    task: str = ""
    group: str | None = None
    episode: str | None = None  # the episode of a per-episode URL (``/episodes/<id>/v1``): it owns the trajectory
    agent: str = ""  # the agent of a per-agent URL (``/episodes/<id>/agents/<name>/v1``)


def parse(route: Route, body: Any, *, model_name: str, tokenizer: ChatTokenizer, identity: Identity,
          tool_parser: str | None = None, max_n: int = 1) -> ApiRequest:
    """Validate `body` (already decoded JSON) for `route`; raises `BadRequest`. The answer names `model_name`,
    whatever model the request named. `tool_parser` names the format of tool calls (a key of
    `sfhpc.endpoint.tool_parsers.PARSERS`; by default the one the chat template writes). `max_n` bounds
    ``n``, the choices asked for (each one a trajectory of its own)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    fields = Fields(body)
    fields.string("model", required=True)
    fields.refuse_unless(best_of=(None, 1), echo=(None, False), suffix=(None, ""),
                         presence_penalty=(None, 0, 0.0), frequency_penalty=(None, 0, 0.0), logit_bias=(None, {}),
                         functions=(None, []), function_call=(None, "none"))
    if route != "chat":
        fields.refuse_unless(tools=(None, []), tool_choice=(None, "none"))
    fields.refuse_distribution_changes(top_k=(None, -1, 0), min_p=(None, 0, 0.0), repetition_penalty=(None, 1, 1.0))
    tools = None
    reply_format = read_response_format(body, route=route)
    if route == "chat":
        tools = read_tools(body, template=tokenizer.chat_template, parser_name=tool_parser)
        prompt = _chat_prompt(fields, tokenizer, tools, reply_format)
        max_tokens = fields.integer("max_completion_tokens", low=1)
        if max_tokens is None:
            max_tokens = fields.integer("max_tokens", low=1)
        want_logprobs = fields.boolean("logprobs", default=False)
        if fields.integer("top_logprobs", low=0) not in (None, 0):
            raise BadRequest("top_logprobs > 0 is not supported: the endpoint returns the sampled token's logprob only",
                             param="top_logprobs")
        default_stop = tokenizer.chat_stop_ids
    else:
        prompt = _text_prompt(fields, tokenizer)
        max_tokens = fields.integer("max_tokens", low=1)
        if max_tokens is None:
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
        top = fields.integer("logprobs", low=0)
        if top not in (None, 0):
            raise BadRequest("logprobs > 0 is not supported: pass logprobs=0 for the sampled token's logprob",
                             param="logprobs")
        want_logprobs = top is not None
        default_stop = (tokenizer.eos_id,)
    stop_ids = fields.token_list("stop_token_ids", vocab_size=tokenizer.vocab_size)
    stop = _stop_strings(body.get("stop"))
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=fields.number("temperature", default=None, low=0.0, high=2.0),
        top_p=fields.number("top_p", default=None, low=0.0, high=1.0, low_open=True),
        seed=fields.integer("seed", low=-_INT64, high=_INT64),
        stop_token_ids=default_stop if stop_ids is None else tuple(stop_ids),
    )
    stream = fields.boolean("stream", default=False)
    n = fields.integer("n", low=1) or 1
    if n > max_n:
        raise BadRequest(f"'n' = {n} is above this endpoint's limit of {max_n} choices per call (an RL run's "
                         f"budgets.max_choices)", param="n")
    if n > 1 and stream:
        raise BadRequest("'n' above 1 is not streamed; ask for stream: false", param="n")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", param="stream_options")
    include_usage = bool((options or {}).get("include_usage", False))
    user = fields.string("user")
    trajectory_id = identity.trajectory_id
    if user and trajectory_id and user != trajectory_id:
        raise BadRequest(f"the X-Trajectory-Id header ({trajectory_id!r}) and the user field ({user!r}) name "
                         f"different trajectories; send one of them", param="user")
    turn = TurnRequest(prompt_token_ids=tuple(prompt), sampling=sampling, trajectory_id=trajectory_id or user or None,
                       task=identity.task, group=identity.group,
                       prompt_param="messages" if route == "chat" else "prompt",
                       stop_when=_stop_when(stop, tokenizer) if stop else None)
    return ApiRequest(route=route, model=model_name, turn=turn, stream=stream, include_usage=include_usage,
                      logprobs=want_logprobs, tools=tools, stop=stop, n=n, response_format=reply_format)


def _stop_strings(value: Any) -> tuple[str, ...]:
    """OpenAI's ``stop``: a string or a list of up to 4 (empty ones mean nothing)."""
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or len(values) > 4 or not all(isinstance(v, str) for v in values):
        raise BadRequest("'stop' must be a string or a list of at most 4 strings", param="stop")
    return tuple(dict.fromkeys(v for v in values if v))


def _stop_when(stop: tuple[str, ...], tokenizer: ChatTokenizer) -> Callable[[], Callable[[Sequence[int]], bool]]:
    """A new `StopMatcher` for each turn of the request (a request of ``n`` choices has several)."""
    return lambda: StopMatcher(stop, tokenizer)


class StopMatcher:
    """Whether a reply holds one of the stop strings, fed the reply's new token ids as they arrive.

    Incremental: the new tokens are decoded once (a stream decoder; a stop string may span tokens) and only
    the new text is searched, with the last ``max(len(stop)) - 1`` characters before it, where a stop string
    that the new text completes begins. A reply of n tokens costs O(n), not O(n^2) as decoding the whole
    reply after every chunk did. ``searched`` counts the characters searched (what the tests bound)."""

    def __init__(self, stop: Sequence[str], tokenizer: ChatTokenizer) -> None:
        self.stop = tuple(s for s in stop if s)
        self._keep = max((len(s) for s in self.stop), default=1) - 1
        self._decoder = tokenizer.stream_decoder(skip_special=True)
        self._tail = ""
        self.searched = 0

    def __call__(self, token_ids: Sequence[int]) -> bool:
        new = self._decoder.feed(token_ids)
        if not new:
            return False
        window = self._tail + new
        self.searched += len(window)
        if any(s in window for s in self.stop):
            return True
        self._tail = window[-self._keep:] if self._keep else ""
        return False


def _chat_prompt(fields: Fields, tokenizer: ChatTokenizer, tools: ToolRequest | None,
                 reply_format: ResponseFormat | None) -> list[int]:
    messages = fields.body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", param="messages")
    flat = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{i}] must be an object", param="messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text parts have a meaning for a text model
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported", param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", param="messages")
        flat.append(history_message(i, message, content))
    if reply_format is not None:
        flat = reply_format.instructed(flat)
    try:
        return tokenizer.apply_chat_template(flat, tools=None if tools is None else tools.tools)
    except ChatFormatError as exc:
        raise BadRequest(str(exc), param="messages") from exc


def _text_prompt(fields: Fields, tokenizer: ChatTokenizer) -> list[int]:
    prompt = fields.body.get("prompt")
    # OpenAI allows a batch of prompts; one trajectory turn is one prompt, so a batch must hold one.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, bos=True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, (int, float)) and not isinstance(t, bool)
                                                   for t in prompt):
        # Read from the prompt itself, which is the inner list of a batch of one.
        ids = Fields({"prompt": prompt}).token_list("prompt", vocab_size=tokenizer.vocab_size)
        assert ids is not None
        return ids
    raise BadRequest("prompt must be a string or a non-empty list of token ids (one prompt per request)",
                     param="prompt")


def read_calls(parser: ToolCallParser, reply: str, *, parallel: bool = True) -> tuple[Parsed, list[dict[str, Any]]]:
    """A whole reply's text read for tool calls, and the calls in OpenAI's shape (each with a new id; the
    first one only unless `parallel`)."""
    parsed = parser.parse(reply)
    calls = parsed.calls if parallel else parsed.calls[:1]
    return parsed, [{"id": parser.call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls]


class ResponseBuilder:
    """Builds the response body, or the streamed chunks, of one request.

    Text is decoded incrementally, so a character split across chunks is sent once, whole. A chat request
    that offers tools reads the reply's tool calls (`sfhpc.endpoint.tool_parsers`): the reply is decoded with
    its special tokens (a model may write its call marker as one) but not its end-of-turn token; streamed,
    text that may begin a call is held back until the reply is whole, then parsed once, and the calls follow
    as ``tool_calls`` deltas, each whole (OpenAI's clients join deltas by ``index``, so one is enough).
    """

    def __init__(self, request: ApiRequest, tokenizer: ChatTokenizer, trajectory_id: str) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self.trajectory_id = trajectory_id
        chat = request.route == "chat"
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        tools = request.tools
        self.parser = tools.parser if tools is not None else None
        self.parsed: Parsed | None = None  # the reply read for tool calls, once it is whole
        self.content: str | None = None  # the reply's content (without its tool calls), once it is whole
        self._hidden = frozenset(request.turn.sampling.stop_token_ids) if self.parser else frozenset()
        self._decoder = tokenizer.stream_decoder(skip_special=self.parser is None)
        self._text_length = 0
        self._reply = ""  # the reply so far, and how much of it went out as content
        self._sent = 0
        # Where the first stop string in the reply begins (its length without one), searched incrementally.
        self._stop_index = 2**62
        self._stop_overlap = max((len(s) for s in request.stop), default=1) - 1

    # -- pieces --------------------------------------------------------------------------------
    def _text(self, token_ids: Sequence[int]) -> tuple[str, list[int]]:
        """Text of newly arrived tokens and, per token, its character offset in the whole completion."""
        offsets, parts = [], []
        for token in token_ids:
            offsets.append(self._text_length)
            part = "" if token in self._hidden else self._decoder.feed((token,))
            parts.append(part)
            self._text_length += len(part)
        return "".join(parts), offsets

    def _flush(self) -> str:
        tail = self._decoder.flush()
        self._text_length += len(tail)
        return tail

    def _logprobs(self, token_ids: Sequence[int], logprobs: Sequence[float], offsets: Sequence[int]) -> Any:
        if not self.request.logprobs:
            return None
        tk = self.tokenizer
        if self.request.route == "chat":
            return {"content": [{"token": tk.token_text(t), "logprob": lp, "bytes": tk.token_bytes(t),
                                 "top_logprobs": []} for t, lp in zip(token_ids, logprobs)]}
        return {"tokens": [tk.token_text(t) for t in token_ids], "token_logprobs": list(logprobs),
                "top_logprobs": None, "text_offset": list(offsets)}

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.request.model}

    @staticmethod
    def usage(result: TurnResult) -> dict[str, int]:
        prompt, completion = len(result.prompt_token_ids), len(result.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _stop_at(self, text: str) -> int:
        """Where the first stop string in `text` begins (OpenAI's ``stop``); ``len(text)`` without one."""
        return min((at for at in (text.find(s) for s in self.request.stop) if at >= 0), default=len(text))

    def _cut(self, text: str) -> str:
        """The reply's text without its stop string and what follows it."""
        return text[:self._stop_at(text)]

    def _read_calls(self, reply: str) -> tuple[list[dict[str, Any]], str | None]:
        """The whole reply read for tool calls: the calls in OpenAI's shape and the content."""
        assert self.parser is not None
        tools = self.request.tools
        self.parsed, calls = read_calls(self.parser, reply, parallel=tools is None or tools.parallel)
        return calls, self.parsed.content

    def _finish(self, result: TurnResult) -> str:
        called = self.parsed is not None and self.parsed.calls
        return "tool_calls" if called and result.finish_reason == "stop" else result.finish_reason

    # -- a whole response ----------------------------------------------------------------------
    def full(self, result: TurnResult) -> dict[str, Any]:
        text, offsets = self._text(result.token_ids)
        text = self._cut(text + self._flush())
        choice: dict[str, Any] = {"index": 0}
        if self.request.route != "chat":
            choice["text"] = self.content = text
        elif self.parser is None:
            choice["message"] = {"role": "assistant", "content": text}
            self.content = text
        else:
            calls, content = self._read_calls(text)
            self.content = content
            choice["message"] = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        choice.update(logprobs=self._logprobs(result.token_ids, result.logprobs, offsets),
                      finish_reason=self._finish(result), token_ids=list(result.token_ids),
                      token_versions=list(result.versions))
        return {**self._head(), "choices": [choice], "usage": self.usage(result),
                "prompt_token_ids": list(result.prompt_token_ids), "trajectory_id": self.trajectory_id}

    # -- a stream ------------------------------------------------------------------------------
    def first_chunk(self, prompt_token_ids: Sequence[int]) -> dict[str, Any]:
        """Chat streams open with the assistant role; both kinds carry the prompt ids (those the turn ran
        on) and trajectory id."""
        head = {**self._head(), "object": self._chunk_object(), "prompt_token_ids": list(prompt_token_ids),
                "trajectory_id": self.trajectory_id}
        if self.request.route == "chat":
            choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": None}
        return {**head, "choices": [{**choice, "token_ids": [], "token_versions": []}]}

    def delta_chunk(self, delta: TokenDelta) -> dict[str, Any]:
        text, offsets = self._text(delta.token_ids)
        return self._chunk(self._content(text), self._logprobs(delta.token_ids, delta.logprobs, offsets), None,
                           list(delta.token_ids), list(delta.versions))

    def last_chunks(self, result: TurnResult) -> list[dict[str, Any]]:
        """The chunks after the last token: the rest of the text, the tool calls, the finish reason."""
        reply = self._cut(self._reply + self._flush())
        if self.parser is None:
            self.content = reply
            return [self._chunk(reply[self._sent:], None, result.finish_reason, [], [])]
        calls, self.content = self._read_calls(reply)
        # Held text goes out as content when it was no call; a call's surrounding text was sent already.
        rest = "" if calls else reply[self._sent:]
        chunks = [self._chunk(rest, None, None, [], [])] if rest else []
        chunks += [self._chunk("", None, None, [], [], tool_calls=[{"index": i, **call}])
                   for i, call in enumerate(calls)]
        return chunks + [self._chunk("", None, self._finish(result), [], [])]

    def usage_chunk(self, result: TurnResult) -> dict[str, Any]:
        return {**self._head(), "object": self._chunk_object(), "choices": [], "usage": self.usage(result)}

    def _content(self, text: str) -> str:
        """Of newly decoded text, what can be sent as content now: not what may still become a stop string
        or a tool call (held until the reply is whole), nor a stop string and what follows it."""
        searched = max(0, len(self._reply) - self._stop_overlap)  # a stop string met now begins here or later
        self._reply = reply = self._reply + text
        stops = self.request.stop
        found = [at for at in (reply.find(s, searched) for s in stops) if at >= 0]
        self._stop_index = min([self._stop_index, *found])
        sendable = min([self._stop_index, len(reply), *(len(reply) - partial_suffix(reply, s) for s in stops)])
        if self.parser is not None:
            sendable = min(sendable, self.parser.held_from(reply))
        start, self._sent = self._sent, max(self._sent, sendable)
        return reply[start:self._sent]

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.request.route == "chat" else "text_completion"

    def _chunk(self, text: str, logprobs: Any, finish: str | None, token_ids: list[int], versions: list[int],
               tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if self.request.route == "chat":
            delta: dict[str, Any] = {"content": text} if text else {}
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=logprobs, finish_reason=finish, token_ids=token_ids, token_versions=versions)
        return {**self._head(), "object": self._chunk_object(), "choices": [choice]}


def models_body(model_name: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "sfhpc"}]}
