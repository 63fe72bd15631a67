"""``response_format`` (chat completions) and ``text.format`` (Responses): a reply in JSON, or in JSON that
follows a schema, as the OpenAI Agents SDK's ``output_type`` and LangChain's ``with_structured_output`` ask.

The format is asked of the model in its prompt and checked on its reply; decoding is not constrained.
A grammar-constrained reply (vLLM's structured outputs) is sampled with every token the grammar forbids
masked out, and the trainers score tokens over the whole vocabulary: they cannot reproduce that mask, so
the reply's recorded logprobs would not be the ones it is trained against (why ``top_p`` below 1 is
refused in a run), and a policy trained on masked replies is rewarded for JSON it never learnt to write.
A weight update also cuts a reply and continues it from its tokens, where a grammar starts again from the
reply's first token. So, as with ``tool_choice: required`` (`sfhpc.endpoint.tools`), the request is
honoured in the prompt: the format is stated at the end of the first system message (one is added when
the conversation has none), which the model's own template renders, and the reply is returned as the
model wrote it. A reply that is not one JSON object, or does not follow the schema, is counted
(``response_format_misses``) and logged; the agent's framework raises on it (the Agents SDK's
``ModelBehaviorError``, pydantic's ``ValidationError``), and the agent program reports its reward, so the
policy learns the format from the reward. Every call of a conversation should carry the same format: the
instruction is part of the rendered history, and a call without it renders another prefix (a branch,
counted as a history mismatch).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import jsonschema

from sfhpc.endpoint.errors import BadRequest

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a format's name
KINDS = ("text", "json_object", "json_schema")


@dataclasses.dataclass(frozen=True)
class ResponseFormat:
    """A reply format other than text: one JSON object, following `schema` when there is one."""

    name: str = ""  # json_schema's name ("" for json_object)
    schema: dict[str, Any] | None = None  # None: any JSON object (``json_object``)

    def instruction(self) -> str:
        """What the system message asks for (compact schema JSON, keys in the request's order)."""
        if self.schema is None:
            return "Reply with one JSON object and nothing else."
        schema = json.dumps(self.schema, separators=(",", ":"), ensure_ascii=False)
        return f"Reply with one JSON object and nothing else, following this JSON Schema ({self.name}):\n{schema}"

    def instructed(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`messages` (flat: text contents) with the instruction at the end of the first system message."""
        if messages and messages[0].get("role") in ("system", "developer"):
            first = messages[0]
            content = first.get("content") or ""
            return [{**first, "content": f"{content}\n\n{self.instruction()}" if content else self.instruction()},
                    *messages[1:]]
        return [{"role": "system", "content": self.instruction()}, *messages]

    def miss(self, content: str | None) -> str | None:
        """Why `content` (a reply's text) is not in this format; None when it is."""
        try:
            value = json.loads(content or "")
        except ValueError as exc:
            return f"not JSON ({exc})"
        if not isinstance(value, dict):
            return f"JSON but not an object ({type(value).__name__})"
        if self.schema is not None:
            error = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(self.schema)(self.schema)
                                                     .iter_errors(value))
            if error is not None:
                return f"does not follow the schema: {error.message}"
        return None


def read_response_format(body: dict[str, Any], *, route: str) -> ResponseFormat | None:
    """The request's ``response_format`` (OpenAI's shapes), checked; None for text. Raises `BadRequest`."""
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in KINDS:
        raise BadRequest(f"response_format must be an object whose type is one of {', '.join(KINDS)}",
                         param="response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if route != "chat":
        raise BadRequest("response_format is a chat completions parameter; use /v1/chat/completions",
                         param="response_format")
    if kind == "json_object":
        return ResponseFormat()
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise BadRequest("response_format json_schema needs a 'json_schema' object: {name, schema, strict}",
                         param="response_format")
    return _schema_format(spec, param="response_format")


def read_text_format(fmt: Any) -> dict[str, Any] | None:
    """A Responses request's ``text.format`` as the chat ``response_format`` it stands for (None: text)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in KINDS:
        raise BadRequest(f"text.format must be an object whose type is one of {', '.join(KINDS)}", param="text")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    spec = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
    _schema_format(spec, param="text")  # checked here, so the error names the Responses field
    return {"type": "json_schema", "json_schema": spec}


def _schema_format(spec: dict[str, Any], *, param: str) -> ResponseFormat:
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise BadRequest(f"the json_schema format needs a 'name' of letters, digits, '_' or '-' (at most 64); got "
                         f"{name!r}", param=param)
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise BadRequest(f"the schema of format '{name}' must be a JSON Schema object", param=param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        raise BadRequest(f"the schema of format '{name}' is not a valid JSON Schema: {exc.message}",
                         param=param) from None
    return ResponseFormat(name=name, schema=schema)
