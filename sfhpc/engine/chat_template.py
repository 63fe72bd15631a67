"""A model's Jinja chat template, rendered the way Hugging Face models' templates are written to be rendered.

The conventions a template may rely on (they are those of ``transformers``' ``apply_chat_template``, which
the tests compare against): a sandbox that cannot change what it is given, ``trim_blocks`` and
``lstrip_blocks``, ``{% break %}``/``{% continue %}``, a ``tojson`` filter that does not HTML-escape, the
globals ``raise_exception(message)`` and ``strftime_now(format)``, ``{% generation %}`` blocks (their body
is rendered as it is), and the tokenizer's special tokens as variables (``bos_token``, ``eos_token``, ...).

Rendering it here, rather than through ``transformers``, spares every rank that only tokenizes (test
engines, timing models, the controller) importing ``transformers``: about 5 s of CPU and 400 MB each.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (templates that mark the assistant's tokens for training
    masks): the body is rendered unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (kept: a rank renders the same template for every request)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render(source: str, messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool,
           special_tokens: Mapping[str, str], tools: Sequence[Mapping[str, object]] | None = None) -> str:
    """The prompt text of `messages` (and of `tools`, OpenAI's function tools, which ``transformers`` passes
    to a template as they are given). A template's own refusal (``raise_exception``) and a template that
    does not compile both raise ``jinja2.TemplateError``."""
    return compile_template(source).render(messages=list(messages), tools=list(tools) if tools else None,
                                           documents=None,
                                           add_generation_prompt=add_generation_prompt, **special_tokens)
