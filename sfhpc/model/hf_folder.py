"""Build small Hugging Face model folders on the spot: a BPE tokenizer trained here, a chat template, and a
randomly initialised causal LM of a real architecture (Qwen2 or Llama), saved with ``save_pretrained``.

No hub download: the tokenizer is trained with the ``tokenizers`` library on text generated from a seed,
wrapped as a ``PreTrainedTokenizerFast`` with its special tokens and a Jinja chat template, and saved in the
same folder as the model, so ``AutoTokenizer``, ``AutoModelForCausalLM`` and vLLM all load the folder as
they would one from the hub. Tests use these folders to run sfhpc on the same path a user's model takes.

Two chat formats, as the architectures' instruct models use them:

* ``qwen2``: ChatML (``<|im_start|>role\\n...<|im_end|>\\n``), no BOS, EOS = ``<|im_end|>``, tied
  embeddings and q/k/v biases as in Qwen2.5's small models;
* ``llama``: Llama 3's headers (``<|begin_of_text|><|start_header_id|>role<|end_header_id|>\\n\\n...
  <|eot_id|>``), a BOS, EOS = ``<|end_of_text|>`` (a turn ends with ``<|eot_id|>``), grouped-query
  attention, untied embeddings.

Two formats render function tools, for testing tool calls in the formats of the models that make them:

* ``qwen2_tools``: ChatML with Qwen2.5's tool format: the tools' JSON schemas in the system message inside
  ``<tools></tools>``, a call as ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` (arguments
  given as a JSON text are written as they are, an object with ``tojson``), results as a user turn of
  ``<tool_response>`` blocks;
* ``llama_tools``: Llama 3.1's JSON tool calling: ``Environment: ipython`` and the tools in the system
  message, a call as the whole reply ``{"name": ..., "parameters": ...}``, results in an ``ipython`` turn.

A third format, ``brief``, is the shortest a chat can be: one special token per role, ``<|end|>`` after each
message (``<|bos|><|user|>...<|end|><|assistant|>``). sfhpc's own default model uses it (`sfhpc.model.tiny`):
the fewer constant tokens between a question and its answer, the sooner a tiny model's reply depends on the
question. ``brief_tools`` is ``brief`` with function tools as short: one line per tool in the system message
(``add(a, b)``), a call as Hermes' ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
(two tokens of their own, read by the ``hermes`` parser), a result as a ``<|tool|>`` message. Qwen2.5's
format writes about 140 tokens of instructions and schemas into every prompt; this one about 6, which is
what lets a CPU run of a tool-using task train several times as many steps.

``head_dim`` is 64: vLLM's CPU attention does not support smaller heads.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

HEAD_DIM = 64
Architecture = Literal["qwen2", "llama"]

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}"
)

QWEN2_TOOLS_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) -%}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant' -}}{%- if message.content -%}{{- '\n' + message.content -}}{%- endif -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- set function = call.function if call.function is defined else call -%}"
    "{{- '\n<tool_call>\n{\"name\": \"' + function.name + '\", \"arguments\": ' -}}"
    "{%- if function.arguments is string -%}{{- function.arguments -}}"
    "{%- else -%}{{- function.arguments | tojson -}}{%- endif -%}"
    "{{- '}\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
LLAMA_TOOLS_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages[0].role == 'system' -%}{%- set system = messages[0].content -%}{%- set rest = messages[1:] -%}"
    "{%- else -%}{%- set system = '' -%}{%- set rest = messages -%}{%- endif -%}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' -}}"
    "{%- if tools -%}{{- 'Environment: ipython\n' -}}{%- endif -%}"
    "{{- system -}}"
    "{%- if tools -%}"
    "{{- '\n\nYou have access to the following functions. To call a function, respond with JSON for a "
    "function call of the form {\"name\": function name, \"parameters\": dictionary of argument name and "
    "its value}. Do not use variables.\n\n' -}}"
    "{%- for tool in tools -%}{{- (tool | tojson) + '\n\n' -}}{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- for message in rest -%}"
    "{%- if message.role == 'assistant' and message.tool_calls -%}"
    "{%- if message.tool_calls | length != 1 -%}{{- raise_exception('one function call per reply') -}}{%- endif -%}"
    "{%- set function = message.tool_calls[0].function -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"' + function.name + "
    "'\", \"parameters\": ' -}}"
    "{%- if function.arguments is string -%}{{- function.arguments -}}"
    "{%- else -%}{{- function.arguments | tojson -}}{%- endif -%}"
    "{{- '}<|eot_id|>' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' -}}"
    "{%- else -%}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content + '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"
)

BRIEF_TOOLS_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "{{- '<|system|>' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\n' -}}{%- endif -%}"
    "{%- for tool in tools -%}"
    "{{- tool.function.name + '(' + ((tool.function.parameters.properties or {}) | list | join(', ')) + ')\n' -}}"
    "{%- endfor -%}"
    "{{- '<|end|>' -}}"
    "{%- elif messages[0].role == 'system' -%}{{- '<|system|>' + messages[0].content + '<|end|>' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{{- '<|assistant|>' + (message.content or '') -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set function = call.function if call.function is defined else call -%}"
    "{{- '<tool_call>{\"name\": \"' + function.name + '\", \"arguments\": ' -}}"
    "{%- if function.arguments is string -%}{{- function.arguments -}}"
    "{%- else -%}{{- function.arguments | tojson -}}{%- endif -%}"
    "{{- '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|end|>' -}}"
    "{%- elif message.role != 'system' -%}"
    "{{- '<|' + message.role + '|>' + message.content + '<|end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)

BRIEF_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """A tokenizer's special tokens and chat template."""

    special_tokens: tuple[str, ...]
    template: str
    eos: str
    pad: str
    bos: str | None = None
    stop: tuple[str, ...] = ()  # generation_config's eos_token_id: every token that ends a reply
    added: tuple[str, ...] = ()  # one token each but not special (kept in decoded text): Qwen2.5's tool tags

    @property
    def renders_tools(self) -> bool:
        """Whether the template writes the offered function tools and the calls of a reply."""
        return "tools" in self.template


FORMATS: dict[str, ChatFormat] = {
    "qwen2": ChatFormat(("<|endoftext|>", "<|im_start|>", "<|im_end|>"), CHATML_TEMPLATE,
                        eos="<|im_end|>", pad="<|endoftext|>", stop=("<|im_end|>", "<|endoftext|>")),
    "llama": ChatFormat(("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                         "<|eot_id|>"), LLAMA3_TEMPLATE, eos="<|end_of_text|>", pad="<|end_of_text|>",
                        bos="<|begin_of_text|>", stop=("<|end_of_text|>", "<|eot_id|>")),
    "qwen2_tools": ChatFormat(("<|endoftext|>", "<|im_start|>", "<|im_end|>"), QWEN2_TOOLS_TEMPLATE,
                              eos="<|im_end|>", pad="<|endoftext|>", stop=("<|im_end|>", "<|endoftext|>"),
                              added=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")),
    "llama_tools": ChatFormat(("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                               "<|eot_id|>", "<|python_tag|>"), LLAMA_TOOLS_TEMPLATE, eos="<|end_of_text|>",
                              pad="<|end_of_text|>", bos="<|begin_of_text|>", stop=("<|end_of_text|>", "<|eot_id|>")),
    "brief": ChatFormat(("<|pad|>", "<|bos|>", "<|eos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>",
                         "<|tool|>"), BRIEF_TEMPLATE, eos="<|eos|>", pad="<|pad|>", bos="<|bos|>",
                        stop=("<|end|>", "<|eos|>")),
}
FORMATS["brief_tools"] = dataclasses.replace(FORMATS["brief"], template=BRIEF_TOOLS_TEMPLATE,
                                             added=("<tool_call>", "</tool_call>"))

_WORDS_TEXT = ("the a an is are was what which who how many letter number word follows after before guess "
               "higher lower yes no answer question think say reply next previous first last one two three four "
               "five six seven eight nine ten zero plus minus times equals total sum left right up down and or "
               "not it this that you me we they system user assistant tool hello please thanks")
_WORDS = tuple(_WORDS_TEXT.split(" "))


# How text is cut into words before merges, as Llama 3's and Qwen2's tokenizers cut it: a run of newlines is one
# piece wherever it stands (GPT-2's pattern splits "\n\n" in two before a word and not at the end of a text,
# so a generation prompt ending in "\n\n" would not be a prefix of the same turn with its reply).
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's cuts every digit apart. transformers opens a folder whose config says qwen2 with its Qwen2Tokenizer,
# which sets this pattern whatever tokenizer.json says: with Llama 3's, "42" was one token to sfhpc and two
# to transformers.
QWEN2_SPLIT_PATTERN = SPLIT_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")


def corpus(seed: int, lines: int = 4000, texts: Iterable[str] = ()) -> Iterator[str]:
    """Text to train the tokenizer on: sentences of common words, single letters and numbers, so the
    merges cover what sfhpc's tasks and chat turns say, then `texts` (what the model will read: a task's
    messages) as they are. Any other text still encodes: the BPE is byte-level."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    for _ in range(lines):
        parts: list[str] = []
        for _ in range(rng.randint(3, 12)):
            pick = rng.random()
            if pick < 0.6:
                parts.append(rng.choice(_WORDS))
            elif pick < 0.8:
                parts.append(rng.choice(letters + letters.upper()))
            else:
                parts.append(str(rng.randint(0, 999)))
        sentence = " ".join(parts)
        yield sentence[:1].upper() + sentence[1:] + rng.choice(".?!:")
    yield from texts


_SAMPLE_TOOL = {"type": "function", "function": {"name": "f", "description": "", "parameters": {}}}


def rendered_pieces(chat: ChatFormat, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = False) -> list[str]:
    """The text `chat`'s template writes for a conversation (offering `tools`, when it renders them), cut
    at its special and added tokens: what a tokenizer of that format is trained on."""
    from sfhpc.engine.chat_template import render

    rendered = render(chat.template, messages, add_generation_prompt=add_generation_prompt,
                      special_tokens={"bos_token": chat.bos or ""}, tools=tools if chat.renders_tools else None)
    return [p for p in re.split("|".join(re.escape(t) for t in (*chat.special_tokens, *chat.added)), rendered) if p]


def template_texts(chat: ChatFormat, repeats: int = 200) -> Iterator[str]:
    """The text the chat template writes around messages (role names, separators, a tool call and the
    instructions that come with tools), between its special tokens, `repeats` times: so a role header is one
    or two tokens, not a spelling of bytes."""
    messages: list[dict[str, Any]] = [{"role": role, "content": ""} for role in ("system", "user", "assistant")]
    if chat.renders_tools:
        call = {"type": "function", "function": {"name": "f", "arguments": {}}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "content": "", "tool_call_id": "c"}]
    else:
        messages.append({"role": "tool", "content": ""})
    pieces = rendered_pieces(chat, messages, tools=[_SAMPLE_TOOL], add_generation_prompt=True)
    for _ in range(repeats):
        yield from pieces


def train_tokenizer(chat: ChatFormat, *, vocab_size: int = 512, seed: int = 0, texts: Iterable[str] = (),
                    split_pattern: str = SPLIT_PATTERN) -> Any:
    """A byte-level BPE trained on `corpus` (with `texts`) and the template's own text, wrapped as a
    ``PreTrainedTokenizerFast`` with `chat`'s special tokens and template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split_pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(chat.special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(itertools.chain(corpus(seed, texts=texts), template_texts(chat)), trainer=trainer)
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in chat.added])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=chat.eos, pad_token=chat.pad,
                                   bos_token=chat.bos, chat_template=chat.template, model_max_length=4096)


def model_config(architecture: Architecture, *, vocab_size: int, layers: int, hidden_size: int, heads: int,
                 kv_heads: int, max_seq_len: int, token_ids: dict[str, Any], dtype: str) -> Any:
    """The ``transformers`` config of a small model of `architecture`."""
    from transformers import LlamaConfig, Qwen2Config

    if hidden_size != heads * HEAD_DIM:
        raise ValueError(f"hidden_size must be heads x {HEAD_DIM} = {heads * HEAD_DIM} (vLLM's CPU attention "
                         f"needs head_dim {HEAD_DIM}), found {hidden_size}")
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 8 // 3 // 16 * 16,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_seq_len, rms_norm_eps=1e-6, hidden_act="silu", dtype=dtype, **token_ids)
    if architecture == "qwen2":
        # Qwen2's attention has q/k/v biases (always on in its modelling code); small Qwen2.5 models tie
        # the output layer to the embeddings.
        return Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False)
    if architecture == "llama":
        return LlamaConfig(**common, head_dim=HEAD_DIM, tie_word_embeddings=False, attention_bias=False)
    raise ValueError(f"architecture must be 'qwen2' or 'llama', found {architecture!r}")


def build_hf_model(out_dir: str | Path, architecture: Architecture = "qwen2", *, layers: int = 2,
                   hidden_size: int = 128, heads: int = 2, kv_heads: int | None = None, tokenizer_vocab: int = 512,
                   max_seq_len: int = 512, dtype: str = "bfloat16", seed: int = 0, texts: Iterable[str] = (),
                   chat_format: str | None = None) -> Path:
    """Train the tokenizer (on `corpus`, `texts` included), initialise the model from `seed` and save both
    into `out_dir` (safetensors). `chat_format` is a key of `FORMATS`; by default the architecture's own."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if architecture not in ("qwen2", "llama"):
        raise ValueError(f"architecture must be 'qwen2' or 'llama', found {architecture!r}")
    chat = FORMATS[chat_format or architecture]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(chat, vocab_size=tokenizer_vocab, seed=seed, texts=texts,
                                split_pattern=QWEN2_SPLIT_PATTERN if architecture == "qwen2" else SPLIT_PATTERN)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           (("eos_token_id", chat.eos), ("pad_token_id", chat.pad), ("bos_token_id", chat.bos)) if token}
    vocab = -(-len(tokenizer) // 64) * 64  # embedding rows padded to a multiple of 64, as real models do
    config = model_config(architecture, vocab_size=vocab, layers=layers, hidden_size=hidden_size, heads=heads,
                          kv_heads=kv_heads or heads, max_seq_len=max_seq_len, token_ids=ids, dtype=dtype)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=ids.get("bos_token_id"), pad_token_id=ids["pad_token_id"],
        eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in chat.stop])
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "sfhpc_build.json").write_text(json.dumps(
        {"architecture": architecture, "seed": seed, "layers": layers, "hidden_size": hidden_size,
         "heads": heads, "kv_heads": kv_heads or heads, "tokenizer_vocab": tokenizer_vocab}, indent=2) + "\n")
    return out
