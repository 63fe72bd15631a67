"""The OpenAI wire format: request bodies -> `TurnRequest`, `TurnResult` / `TokenDelta` -> response bodies.

Supported: ``/v1/chat/completions`` and ``/v1/completions`` with ``max_tokens`` (chat also
``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``, ``stream`` + ``stream_options.include_usage``,
``logprobs`` (the sampled token's logprob; no alternatives), ``user``. Parameters that would change what
the model does and that the endpoint cannot honour (``n > 1``, ``stop`` strings, ``tools``, penalties,
``logit_bias``, top-k alternatives, ``echo``, and vLLM's sampling extensions ``top_k``, ``min_p``,
``repetition_penalty``) are refused with a 400 instead of being ignored silently. A ``temperature`` or
``top_p`` left out stays None here: the endpoint fills in its default (`Sampling.resolved`).

Extensions: ``stop_token_ids`` in the request (vLLM's name); in the response ``prompt_token_ids`` and
``trajectory_id`` at the top level and ``token_ids`` / ``token_versions`` (the weight version of each
token) in every choice and streamed chunk.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from sfhpc.endpoint.errors import BadRequest, ModelNotFound
from sfhpc.endpoint.fields import Fields
from sfhpc.endpoint.service import Sampling, TokenDelta, TurnRequest, TurnResult
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


@dataclasses.dataclass(frozen=True)
class Identity:
    """Who is asking, from the HTTP headers (or the in-process client's arguments)."""

    trajectory_id: str | None = None
    task: str = ""
    group: str | None = None
    episode: str | None = None  # the episode of a per-episode URL (``/episodes/<id>/v1``): it owns the trajectory


def parse(route: Route, body: Any, *, model_name: str, tokenizer: ChatTokenizer, identity: Identity) -> ApiRequest:
    """Validate `body` (already decoded JSON) for `route`; raises `BadRequest` / `ModelNotFound`."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    fields = Fields(body)
    model = fields.string("model", required=True)
    if model != model_name:
        raise ModelNotFound(f"model {model!r} is not served here; this endpoint serves {model_name!r}",
                            param="model")
    fields.refuse_unless(n=(None, 1), best_of=(None, 1), echo=(None, False), suffix=(None, ""),
                         presence_penalty=(None, 0, 0.0), frequency_penalty=(None, 0, 0.0), logit_bias=(None, {}),
                         tools=(None, []), tool_choice=(None, "none"), functions=(None, []),
                         response_format=(None, {"type": "text"}), stop=(None, [], ""))
    fields.refuse_distribution_changes(top_k=(None, -1, 0), min_p=(None, 0, 0.0), repetition_penalty=(None, 1, 1.0))
    if route == "chat":
        prompt = _chat_prompt(fields, tokenizer)
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
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=fields.number("temperature", default=None, low=0.0, high=2.0),
        top_p=fields.number("top_p", default=None, low=0.0, high=1.0, low_open=True),
        seed=fields.integer("seed", low=-_INT64, high=_INT64),
        stop_token_ids=default_stop if stop_ids is None else tuple(stop_ids),
    )
    stream = fields.boolean("stream", default=False)
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
                       prompt_param="messages" if route == "chat" else "prompt")
    return ApiRequest(route=route, model=model, turn=turn, stream=stream, include_usage=include_usage,
                      logprobs=want_logprobs)


def _chat_prompt(fields: Fields, tokenizer: ChatTokenizer) -> list[int]:
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
        flat.append({"role": message.get("role"), "content": content})
    try:
        return tokenizer.apply_chat_template(flat)
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


class ResponseBuilder:
    """Builds the response body, or the streamed chunks, of one request.

    Text is decoded incrementally, so a character split across chunks is sent once, whole.
    """

    def __init__(self, request: ApiRequest, tokenizer: ChatTokenizer, trajectory_id: str) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self.trajectory_id = trajectory_id
        chat = request.route == "chat"
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        self._decoder = tokenizer.stream_decoder()
        self._text_length = 0

    # -- pieces --------------------------------------------------------------------------------
    def _text(self, token_ids: Sequence[int]) -> tuple[str, list[int]]:
        """Text of newly arrived tokens and, per token, its character offset in the whole completion."""
        offsets, parts = [], []
        for token in token_ids:
            offsets.append(self._text_length)
            part = self._decoder.feed((token,))
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

    # -- a whole response ----------------------------------------------------------------------
    def full(self, result: TurnResult) -> dict[str, Any]:
        text, offsets = self._text(result.token_ids)
        text += self._flush()
        choice: dict[str, Any] = {"index": 0}
        if self.request.route == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=self._logprobs(result.token_ids, result.logprobs, offsets),
                      finish_reason=result.finish_reason, token_ids=list(result.token_ids),
                      token_versions=list(result.versions))
        return {**self._head(), "choices": [choice], "usage": self.usage(result),
                "prompt_token_ids": list(result.prompt_token_ids), "trajectory_id": self.trajectory_id}

    # -- a stream ------------------------------------------------------------------------------
    def first_chunk(self) -> dict[str, Any]:
        """Chat streams open with the assistant role; both kinds carry the prompt ids and trajectory id."""
        head = {**self._head(), "object": self._chunk_object(), "prompt_token_ids":
                list(self.request.turn.prompt_token_ids), "trajectory_id": self.trajectory_id}
        if self.request.route == "chat":
            choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": None}
        return {**head, "choices": [{**choice, "token_ids": [], "token_versions": []}]}

    def delta_chunk(self, delta: TokenDelta) -> dict[str, Any]:
        text, offsets = self._text(delta.token_ids)
        return self._chunk(text, self._logprobs(delta.token_ids, delta.logprobs, offsets), None,
                           list(delta.token_ids), list(delta.versions))

    def last_chunk(self, result: TurnResult) -> dict[str, Any]:
        return self._chunk(self._flush(), None, result.finish_reason, [], [])

    def usage_chunk(self, result: TurnResult) -> dict[str, Any]:
        return {**self._head(), "object": self._chunk_object(), "choices": [], "usage": self.usage(result)}

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.request.route == "chat" else "text_completion"

    def _chunk(self, text: str, logprobs: Any, finish: str | None, token_ids: list[int],
               versions: list[int]) -> dict[str, Any]:
        if self.request.route == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text} if text else {}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=logprobs, finish_reason=finish, token_ids=token_ids, token_versions=versions)
        return {**self._head(), "object": self._chunk_object(), "choices": [choice]}


def models_body(model_name: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "sfhpc"}]}
