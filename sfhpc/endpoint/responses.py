"""OpenAI's Responses API (``POST /v1/responses``) over the chat completions the endpoint serves.

A Responses request is one chat turn written another way: its ``input`` items (messages, the
``function_call`` items of earlier replies and their ``function_call_output`` results) and ``instructions``
become chat messages, its function tools chat tools; the chat turn runs as any other (same trajectory
bookkeeping, same tool-call formats) and its answer is written back as ``output`` items: a ``message``
with ``output_text`` and a ``function_call`` item per call. This is what the OpenAI Agents SDK's default
model class sends (its ``Runner.run``).

With ``stream: true`` the answer is the Responses API's event stream (`ResponseStream`, from the chat turn's
streamed chunks): ``response.created``, ``response.in_progress``, the reply's text as
``response.output_text.delta`` events of a ``message`` item, each call as a ``function_call`` item with its
arguments (``response.function_call_arguments.delta`` / ``.done``), then ``response.completed`` (or
``response.incomplete`` for a reply cut at ``max_output_tokens``) with the whole response: what the Agents
SDK's ``Runner.run_streamed`` reads. ``text.format`` (``json_object``, ``json_schema``) is the chat turn's
``response_format`` (`sfhpc.endpoint.response_format`).

Stateless: the endpoint stores no responses, so ``previous_response_id`` and ``conversation`` are refused
(an agent sends its whole input each turn, as the Agents SDK does by default); so are built-in tools (web
search, file search, computer use), which have no meaning here.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from sfhpc.endpoint.errors import BadRequest
from sfhpc.endpoint.response_format import read_text_format

# Fields of a Responses request with a chat equivalent, and the name it has there.
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "max_output_tokens": "max_tokens",
             "parallel_tool_calls": "parallel_tool_calls", "user": "user", "seed": "seed"}
# Fields that change nothing the endpoint does (bookkeeping on OpenAI's side).
_IGNORED = ("store", "include", "metadata", "truncation", "service_tier", "prompt_cache_key", "safety_identifier",
            "background", "reasoning", "top_logprobs", "stream_options", "max_tool_calls", "context_management")


def to_chat(body: Any) -> dict[str, Any]:
    """The chat completions request of a Responses request; raises `BadRequest` naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for key in ("previous_response_id", "conversation", "prompt"):
        if body.get(key) is not None:
            raise BadRequest(f"'{key}' is not supported: this endpoint stores no responses; send the whole input "
                             f"each turn", param=key)
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise BadRequest("'text' must be an object: {\"format\": {...}}", param="text")
    reply_format = read_text_format((text or {}).get("format"))
    unknown = sorted(set(body) - {"model", "input", "instructions", "tools", "tool_choice", "stream", "text",
                                  *_SAMPLING, *_IGNORED, "previous_response_id", "conversation", "prompt"})
    if unknown:
        raise BadRequest(f"'{unknown[0]}' is not supported on /v1/responses; leave it out", param=unknown[0])
    chat: dict[str, Any] = {"model": body.get("model"), "messages": _messages(body)}
    for key, name in _SAMPLING.items():
        if body.get(key) is not None:
            chat[name] = body[key]
    if reply_format is not None:
        chat["response_format"] = reply_format
    if body.get("stream"):
        chat.update(stream=True, stream_options={"include_usage": True})  # usage ends response.completed
    tools = body.get("tools")
    if tools:
        chat["tools"] = [_tool(i, tool) for i, tool in enumerate(tools if isinstance(tools, list) else [tools])]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        chat["tool_choice"] = choice
    return chat


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("'input' must be a string or a non-empty list of items", param="input")
    joins = False  # whether a function_call item belongs to the assistant turn just before it
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest(f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            messages.append({"role": role, "content": _text(i, item.get("content"))})
            joins = role == "assistant"
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            # A reply's text (a message item) and its calls are one assistant turn, as are several calls.
            if joins:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            joins = True
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _text(i, output)})
            joins = False
        elif kind != "reasoning":  # a reasoning summary: the chat template renders (or drops) reasoning itself
            raise BadRequest(f"input[{i}]: items of type {kind!r} are not supported (messages, function_call, "
                             f"function_call_output are)", param="input")
    return messages


def _text(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text")
                    and isinstance(part.get("text"), str)):
                raise BadRequest(f"input[{index}].content: only text parts are supported", param="input")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"input[{index}].content must be a string or a list of text parts", param="input")


def _tool(index: int, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise BadRequest(f"tools[{index}]: only function tools are supported, found {kind!r}", param="tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def from_chat(chat: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """The Responses body of a chat completion's answer to `request` (the Responses request)."""
    choice = chat["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append(_message_item(f"msg_{uuid.uuid4().hex}", message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        output.append(_call_item(f"fc_{uuid.uuid4().hex}", call, "completed"))
    return _response(f"resp_{uuid.uuid4().hex}", time.time(), request, chat["model"], output,
                     cut=choice["finish_reason"] == "length", usage=chat["usage"],
                     extensions={"trajectory_id": chat["trajectory_id"], "token_ids": choice["token_ids"],
                                 "token_versions": choice["token_versions"]})


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if status == "completed" else "", "status": status}


def _response(response_id: str, created: float, request: dict[str, Any], model: str, output: list[dict[str, Any]],
              *, cut: bool = False, usage: dict[str, Any] | None = None, status: str | None = None,
              extensions: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Responses body; `status` None: completed, or incomplete when `cut`."""
    return {
        "id": response_id, "object": "response", "created_at": created, "model": model,
        "status": status or ("incomplete" if cut else "completed"),
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
        "instructions": request.get("instructions"), "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "tool_choice": request.get("tool_choice", "auto"), "tools": request.get("tools") or [],
        "temperature": request.get("temperature"), "top_p": request.get("top_p"),
        "max_output_tokens": request.get("max_output_tokens"), "text": _text_field(request),
        "usage": None if usage is None else {
            "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}},
        **(extensions or {}),  # sfhpc's, as on the chat routes
    }


def _text_field(request: dict[str, Any]) -> dict[str, Any]:
    """The response's ``text``: the format the request asked for (text by default)."""
    text = request.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    return {"format": fmt if isinstance(fmt, dict) else {"type": "text"}}


class ResponseStream:
    """The Responses API's events for a streamed chat turn of a Responses `request`: feed it the turn's chunks
    (`events`), then take the closing events (`end`). Item ids stay the same from an item's first event to
    ``response.completed``."""

    def __init__(self, request: dict[str, Any], model: str) -> None:
        self.request, self.model = request, model
        self.id, self.created = f"resp_{uuid.uuid4().hex}", time.time()
        self.sequence = 0
        self.output: list[dict[str, Any]] = []      # items done
        self.text: str | None = None                # the open message item's text so far
        self.text_id = ""
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.trajectory_id: str | None = None
        self.token_ids: list[int] = []
        self.token_versions: list[int] = []

    def events(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one streamed chat chunk."""
        events: list[dict[str, Any]] = []
        if self.trajectory_id is None and "trajectory_id" in chunk:  # the first chunk
            self.trajectory_id = chunk["trajectory_id"]
            body = self._body("in_progress")
            events += [self._event("response.created", response=body), self._event("response.in_progress",
                                                                                    response=body)]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            self.token_ids += choice.get("token_ids") or []
            self.token_versions += choice.get("token_versions") or []
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._close_text() + self._call(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
                events += self._close_text()
        return events

    def end(self) -> list[dict[str, Any]]:
        """The closing event: ``response.completed``, or ``response.incomplete`` for a reply cut short."""
        events = self._close_text()
        cut = self.finish == "length"
        final = _response(self.id, self.created, self.request, self.model, list(self.output), cut=cut,
                          usage=self.usage, extensions=self._extensions())
        return events + [self._event("response.incomplete" if cut else "response.completed", response=final)]

    def error(self, body: dict[str, Any]) -> dict[str, Any]:
        """The event of an error once the stream has begun (`body`: the endpoint's error body)."""
        error = body.get("error", {})
        return self._event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self.text is None:
            self.text, self.text_id = "", f"msg_{uuid.uuid4().hex}"
            events += [self._event("response.output_item.added", output_index=len(self.output),
                                   item=_message_item(self.text_id, "", "in_progress")),
                       self._event("response.content_part.added", item_id=self.text_id,
                                   output_index=len(self.output), content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": []})]
        self.text += text
        return events + [self._event("response.output_text.delta", item_id=self.text_id, output_index=len(self.output),
                                     content_index=0, delta=text, logprobs=[])]

    def _close_text(self) -> list[dict[str, Any]]:
        if self.text is None:
            return []
        text, self.text = self.text, None
        item, index = _message_item(self.text_id, text, "completed"), len(self.output)
        self.output.append(item)
        return [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=item["content"][0]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A whole call (the chat stream sends each call in one chunk, once the reply is complete)."""
        item_id, index = f"fc_{uuid.uuid4().hex}", len(self.output)
        item = _call_item(item_id, call, "completed")
        self.output.append(item)
        arguments = item["arguments"]
        return [self._event("response.output_item.added", output_index=index,
                            item=_call_item(item_id, call, "in_progress")),
                self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                            delta=arguments),
                self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                            arguments=arguments, name=item["name"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _body(self, status: str) -> dict[str, Any]:
        return _response(self.id, self.created, self.request, self.model, [], status=status,
                         extensions=self._extensions())

    def _extensions(self) -> dict[str, Any]:
        return {"trajectory_id": self.trajectory_id, "token_ids": list(self.token_ids),
                "token_versions": list(self.token_versions)}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}
