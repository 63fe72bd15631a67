"""OpenAI's Responses API (``POST /v1/responses``) over the chat completions the endpoint serves.

A Responses request is one chat turn written another way: its ``input`` items (messages, the
``function_call`` items of earlier replies and their ``function_call_output`` results) and ``instructions``
become chat messages, its function tools chat tools; the chat turn runs as any other (same trajectory
bookkeeping, same tool-call formats) and its answer is written back as ``output`` items: a ``message``
with ``output_text`` and a ``function_call`` item per call. This is what the OpenAI Agents SDK's default
model class sends (its ``Runner.run``).

Stateless: the endpoint stores no responses, so ``previous_response_id`` and ``conversation`` are refused
(an agent sends its whole input each turn, as the Agents SDK does by default); so are streamed responses
and built-in tools (web search, file search, computer use), which have no meaning here.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from sfhpc.endpoint.errors import BadRequest

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
    if body.get("stream"):
        raise BadRequest("streamed responses are not supported on /v1/responses; use stream: false, or "
                         "/v1/chat/completions to stream", param="stream")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt not in (None, {"type": "text"}):
        raise BadRequest("'text.format' other than text is not supported", param="text")
    unknown = sorted(set(body) - {"model", "input", "instructions", "tools", "tool_choice", "stream", "text",
                                  *_SAMPLING, *_IGNORED, "previous_response_id", "conversation", "prompt"})
    if unknown:
        raise BadRequest(f"'{unknown[0]}' is not supported on /v1/responses; leave it out", param=unknown[0])
    chat: dict[str, Any] = {"model": body.get("model"), "messages": _messages(body)}
    for key, name in _SAMPLING.items():
        if body.get(key) is not None:
            chat[name] = body[key]
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
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant",
                       "status": "completed",
                       "content": [{"type": "output_text", "text": message["content"], "annotations": []}]})
    for call in message.get("tool_calls") or []:
        output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    cut = choice["finish_reason"] == "length"
    usage = chat["usage"]
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": time.time(), "model": chat["model"],
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
        "instructions": request.get("instructions"), "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "tool_choice": request.get("tool_choice", "auto"), "tools": request.get("tools") or [],
        "temperature": request.get("temperature"), "top_p": request.get("top_p"),
        "max_output_tokens": request.get("max_output_tokens"), "text": {"format": {"type": "text"}},
        "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                  "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
        # sfhpc's extensions, as on the chat routes
        "trajectory_id": chat["trajectory_id"], "token_ids": choice["token_ids"],
        "token_versions": choice["token_versions"],
    }
