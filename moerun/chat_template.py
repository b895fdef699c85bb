"""Chat templates: turn a list of messages into the prompt text a model was trained on.

A GGUF file carries its model's Jinja template as `tokenizer.chat_template`. `render` runs it the way
transformers' `apply_chat_template` does (same Jinja settings: `trim_blocks`, `lstrip_blocks`, the
`loopcontrols` extension; same helpers: `raise_exception`, `strftime_now`, a `tojson` that does not
escape HTML, a restricted `dict` and `namespace`; same message clean-up: keys whose value is None
are dropped, `reasoning_content` / `thinking` / `reasoning` alias each other), so both give the same
string for the same messages.

Templates are untrusted code: they run in jinja2's `ImmutableSandboxedEnvironment`, which offers no
file system, no imports and no Python internals. Where plain jinja2's sandbox quietly renders an
unsafe attribute (`''.__class__`) as an empty string, moerun raises `TemplateError`; any error inside
a template (including `raise_exception(...)`) is a `TemplateError` too.

`template_for(f)` returns the file's template or, when it has none, a fallback chosen by
`general.architecture` (`FALLBACK_TEMPLATES`: Gemma's turn format for gemma/gemma2/gemma3 files,
whose GGUF conversions often omit the template), else ChatML (`<|im_start|>role\\n...<|im_end|>\\n`),
the most widely used format.

Note: many templates write `bos_token` themselves; tokenize the rendered prompt with
`add_special=False` (and `parse_special=True`) so the BOS is not doubled.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils

from moerun.errors import MoerunError
from moerun.gguf.reader import GGUFFile

__all__ = ["CHATML_TEMPLATE", "FALLBACK_TEMPLATES", "GEMMA_TEMPLATE", "TemplateError", "render", "template_for"]


class TemplateError(MoerunError):
    """A chat template failed to compile or render, or tried to reach something the sandbox forbids."""


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Gemma's published template (text parts; an image part becomes <start_of_image>).
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

# general.architecture -> template used when the file has no tokenizer.chat_template (else ChatML).
FALLBACK_TEMPLATES: dict[str, str] = dict.fromkeys(("gemma", "gemma2", "gemma3", "gemma3n"), GEMMA_TEMPLATE)

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def template_for(f: GGUFFile) -> str:
    """The file's `tokenizer.chat_template`, else `FALLBACK_TEMPLATES[arch]`, else `CHATML_TEMPLATE`."""
    template = f.get("tokenizer.chat_template")
    if isinstance(template, str) and template.strip():
        return template
    return FALLBACK_TEMPLATES.get(f.get("general.architecture"), CHATML_TEMPLATE)


# -- the environment (mirrors transformers.utils.chat_template_utils._cached_compile_jinja_template) ----


class _Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox, except that touching an unsafe attribute raises instead of rendering ''."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    """json.dumps without Jinja's HTML escaping (as transformers)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja2's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"templates cannot set underscore-prefixed attribute {name!r}")


class _Generation(jinja2.ext.Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` block and renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


@functools.cache
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


@functools.lru_cache(maxsize=64)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise TemplateError(f"chat template does not compile: {type(e).__name__}: {e}") from None


# -- inputs -----------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """Rebuild `value` from plain JSON-like types, so a template never sees a caller's rich objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _messages(messages: list[dict]) -> list[dict]:
    """Drop None-valued keys, copy into plain types, and alias the reasoning fields (as transformers)."""
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise TemplateError(f"a chat message must be a dict, got {type(m).__name__}")
        m = _plain({k: v for k, v in m.items() if v is not None})
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **extra: Any,
) -> str:
    """Render `messages` ([{'role': ..., 'content': ...}, ...]) with `template` in the sandbox.

    `extra` keyword arguments become template variables (e.g. `enable_thinking=False`). Any failure,
    including the template's own `raise_exception`, raises `TemplateError`.
    """
    compiled = _compile(template)
    variables = _plain({"bos_token": bos_token, "eos_token": eos_token, **extra})
    try:
        return compiled.render(
            messages=_messages(messages),
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except TemplateError:
        raise
    except jinja2.exceptions.SecurityError as e:
        raise TemplateError(f"chat template tried something the sandbox forbids: {e}") from None
    except jinja2.exceptions.TemplateError as e:
        raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
    except Exception as e:  # a template is code: any error inside it is the template's
        raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
