"""Function tools in a chat request: ``tools``, ``tool_choice``, ``parallel_tool_calls`` and the tool turns of
the history (assistant messages with ``tool_calls``, ``tool`` messages), read and checked in OpenAI's shapes.

The tools and the history are rendered by the model's own chat template, as ``transformers``'
``apply_chat_template(messages, tools=...)`` renders them: the tools as their JSON schemas, and an assistant
message's call arguments as an object (OpenAI sends them as a JSON text; templates write them with
``tojson``, so they are decoded first, as vLLM's server does).

``tool_choice``: ``none`` renders the tools and reads no call from the reply; ``auto`` reads calls;
``required`` and a named function read calls too, and a named function is the only tool rendered. None of
them constrains decoding: a constrained reply would be written in a format other than the template's
(vLLM forces a JSON list), and a policy trained on it would learn a format it is never asked for. A reply
without a call is returned as content, as under ``auto``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

from sfhpc.endpoint.errors import BadRequest
from sfhpc.endpoint.tool_parsers import PARSERS, ToolCallParser, parser_for_template, renders_tools

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for a function's name (and a dot, as vLLM allows)
CHOICES = ("none", "auto", "required")


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """What a chat request asked about tools: the tools the template renders, whether calls are read from
    the reply, and how many."""

    tools: tuple[dict[str, Any], ...]
    choice: str  # none | auto | required | the named function
    parallel: bool
    parser: ToolCallParser | None  # None under ``tool_choice: none``

    @property
    def named(self) -> str | None:
        return None if self.choice in CHOICES else self.choice


def read_tools(body: Mapping[str, Any], *, template: str, parser_name: str | None) -> ToolRequest | None:
    """The request's tools (None when it offers none); raises `BadRequest` naming the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise BadRequest("'tool_choice' needs 'tools': offer the functions the model may call",
                             param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}", param="tools")
    offered = [_tool(i, tool) for i, tool in enumerate(tools)]
    names = [t["function"]["name"] for t in offered]
    if len(set(names)) != len(names):
        raise BadRequest(f"'tools' names a function twice: {sorted(n for n in set(names) if names.count(n) > 1)}",
                         param="tools")
    chosen = _choice(choice, names)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise BadRequest("'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    if not renders_tools(template):
        raise BadRequest("'tools' cannot be offered to this model: its chat template renders no tools; use a "
                         "model whose template does (e.g. Qwen2.5, Llama 3.1, Mistral)", param="tools",
                         code="tools_not_supported")
    name = parser_name or parser_for_template(template)
    if name is None:
        raise BadRequest("'tools' cannot be offered to this model: its chat template writes tool calls in no "
                         f"format this endpoint reads; name one ({', '.join(PARSERS)}) as model.tool_parser",
                         param="tools", code="tools_not_supported")
    if chosen not in CHOICES:
        offered = [t for t in offered if t["function"]["name"] == chosen]
    parser = None if chosen == "none" else PARSERS[name](t["function"]["name"] for t in offered)
    return ToolRequest(tuple(offered), chosen, parallel, parser)


def _tool(index: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise BadRequest(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                         f"\"parameters\": {{...}}}}}}", param="tools")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise BadRequest(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.', found {name!r}",
                         param="tools")
    if not isinstance(function.get("description", ""), str):
        raise BadRequest(f"{where}.function.description must be a string", param="tools")
    parameters = function.get("parameters")
    if parameters is not None and not (isinstance(parameters, dict) and isinstance(parameters.get("type", "object"),
                                                                                   (str, list))):
        raise BadRequest(f"{where}.function.parameters must be a JSON Schema object "
                         f"(e.g. {{\"type\": \"object\", \"properties\": {{...}}}})", param="tools")
    if not isinstance(function.get("strict", False), bool):
        raise BadRequest(f"{where}.function.strict must be true or false", param="tools")
    return {"type": "function", "function": dict(function)}


def _choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise BadRequest(f"'tool_choice' must be one of {list(CHOICES)} or {{\"type\": \"function\", "
                             f"\"function\": {{\"name\": ...}}}}, found {choice!r}", param="tool_choice")
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise BadRequest("'tool_choice' must name a function as {\"type\": \"function\", \"function\": "
                         "{\"name\": ...}}", param="tool_choice")
    if name not in names:
        raise BadRequest(f"'tool_choice' names function {name!r}, which 'tools' does not offer (offered: "
                         f"{names})", param="tool_choice")
    return name


def history_message(index: int, message: Mapping[str, Any], content: str) -> dict[str, Any]:
    """One message of the history as the chat template reads it: role and text, an assistant's calls with
    their arguments decoded, a tool result's ``tool_call_id`` (and ``name``)."""
    role = message.get("role")
    flat: dict[str, Any] = {"role": role, "content": content}
    if isinstance(message.get("name"), str):
        flat["name"] = message["name"]
    calls = message.get("tool_calls")
    if calls not in (None, []):
        if role != "assistant":
            raise BadRequest(f"messages[{index}]: only assistant messages carry tool_calls", param="messages")
        if not isinstance(calls, list):
            raise BadRequest(f"messages[{index}].tool_calls must be a list", param="messages")
        flat["tool_calls"] = [_history_call(index, j, call) for j, call in enumerate(calls)]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise BadRequest(f"messages[{index}]: a tool message needs the 'tool_call_id' of the call it answers",
                             param="messages")
        flat["tool_call_id"] = call_id
    return flat


def _history_call(index: int, j: int, call: Any) -> dict[str, Any]:
    where = f"messages[{index}].tool_calls[{j}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest(f"{where} must be {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": ..., "
                         f"\"arguments\": \"<JSON>\"}}}}", param="messages")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            raise BadRequest(f"{where}.function.arguments is not JSON ({exc.msg}); send back the arguments "
                             f"the model wrote", param="messages") from None
    out: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out
