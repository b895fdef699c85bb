"""moerun.chat_template: the real templates in llama.cpp's models/templates/ render exactly as transformers'
renderer does, hostile templates cannot leave the sandbox, and files without a template get the fallback."""

from __future__ import annotations

import functools
import json

import pytest
from support import llamacpp_sdist
from transformers.utils.chat_template_utils import render_jinja_template

from moerun.chat_template import CHATML_TEMPLATE, GEMMA_TEMPLATE, TemplateError, render, template_for
from moerun.errors import MoerunError
from moerun.gguf.reader import GGUFFile

CASES: dict[str, list[dict]] = {
    "user": [{"role": "user", "content": "What is 2+2?"}],
    "system+user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!"}],
    "multi-turn": [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Tell me a joke about <tags> & \"quotes\"."},
    ],
    "system+multi-turn": [
        {"role": "system", "content": "Be nice."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "Bye 👋"},
    ],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city"}},
                "required": ["city"],
            },
        },
    }
]
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}
EXTRA = {  # variables some templates need
    "fireworks-ai-llama-3-firefunction-v2.jinja": {"functions": json.dumps(TOOLS), "datetime": "Jan 01 2026"},
}
# Templates that transformers refuses to render for some of the 16 (messages, generation prompt, tools)
# combinations; moerun must refuse exactly those too.
EXPECTED_REFUSALS = {
    "google-gemma-2-2b-it.jinja": 8,  # no system role
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja": 8,  # needs tools
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": 8,  # needs tools
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": 8,  # needs tools
    "llama-cpp-deepseek-r1.jinja": 8,  # its tools branch fails (tojson of a generator)
}


@functools.cache
def template_files() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in llamacpp_sdist.files().template_files()}


def _template_names() -> list[str]:
    """Template names for parametrizing; if the download fails, one name whose test fails with the reason."""
    try:
        return sorted(template_files())
    except Exception:
        return ["<download failed>"]


def _transformers(template: str, messages: list[dict], gen: bool, tools: list | None, extra: dict) -> str:
    rendered, _ = render_jinja_template(
        [messages], tools=tools, chat_template=template, add_generation_prompt=gen, **SPECIALS, **extra
    )
    return rendered[0]


def test_sdist_has_templates() -> None:
    names = template_files()
    assert len(names) >= 60
    assert {"Qwen-Qwen3-0.6B.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja", "google-gemma-2-2b-it.jinja"} <= set(
        names
    )


@pytest.mark.parametrize("name", _template_names())
def test_renders_like_transformers(name: str) -> None:
    template = template_files()[name]
    extra = EXTRA.get(name, {})
    rendered = refused = 0
    for tools in (None, TOOLS):
        for messages in CASES.values():
            for gen in (True, False):
                try:
                    want = _transformers(template, messages, gen, tools, extra)
                except Exception:  # transformers refuses: moerun must refuse too
                    with pytest.raises(TemplateError):
                        render(template, messages, add_generation_prompt=gen, tools=tools, **SPECIALS, **extra)
                    refused += 1
                    continue
                got = render(template, messages, add_generation_prompt=gen, tools=tools, **SPECIALS, **extra)
                assert got == want, (name, messages, gen, tools is not None)
                rendered += 1
    assert rendered > 0, f"{name}: every case raised, nothing was compared"
    assert refused == EXPECTED_REFUSALS.get(name, 0)


def test_tojson_and_helpers_match_transformers() -> None:
    template = (
        "{{ messages | tojson }}|{{ {'b': '<é>', 'a': 1} | tojson(indent=2, sort_keys=True) }}|"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}{{ ns.n }}|{{ dict(x=1) }}|"
        "{{ strftime_now('%Y') }}\n  {% if true %}\n    x\n  {% endif %}\n"
    )
    messages = CASES["multi-turn"]
    assert render(template, messages, add_generation_prompt=False) == _transformers(template, messages, False, None, {})


def test_reasoning_fields_alias_like_transformers() -> None:
    template = "{% for m in messages %}[{{ m.reasoning_content }}|{{ m.thinking }}]{% endfor %}"
    messages = [{"role": "assistant", "content": "4", "reasoning": "2+2"}]
    assert render(template, messages) == _transformers(template, messages, True, None, {}) == "[2+2|2+2]"


def test_raise_exception_is_a_template_error() -> None:
    with pytest.raises(TemplateError, match="roles must alternate") as e:
        render(GEMMA_TEMPLATE, [{"role": "assistant", "content": "x"}])
    assert isinstance(e.value, MoerunError)


@pytest.mark.parametrize(
    "hostile",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{{ lipsum.__globals__['os'].listdir('/') }}",
        "{{ joiner.__init__.__globals__['__builtins__']['open']('/etc/passwd').read() }}",
        "{% include '/etc/passwd' %}",
        "{% import '/etc/passwd' as x %}",
        "{{ self.__init__.__globals__ }}",
        "{{ messages.append(1) }}",
        "{{ namespace(__class__=1) }}",
        "{{ raise_exception.__globals__ }}",
        "{{ range.__globals__ }}",
        "{{ messages.__class__.__init__ }}",
        "{{ (messages|first).__class__ }}",
        "{% for x in range(10**9) %}{% endfor %}",
    ],
)
def test_hostile_templates_raise(hostile: str) -> None:
    with pytest.raises(TemplateError):
        render(hostile, [{"role": "user", "content": "hi"}])


def test_bad_template_syntax_is_a_template_error() -> None:
    with pytest.raises(TemplateError, match="does not compile"):
        render("{% for m in messages %}", [])


def test_template_for_uses_the_file_or_a_fallback(tmp_path) -> None:
    models = llamacpp_sdist.files().models
    qwen = GGUFFile(models / "ggml-vocab-qwen2.gguf")
    assert template_for(qwen) == qwen.get("tokenizer.chat_template")
    gpt2 = GGUFFile(models / "ggml-vocab-gpt-2.gguf")  # no template, architecture gpt2
    assert gpt2.get("tokenizer.chat_template") is None
    assert template_for(gpt2) == CHATML_TEMPLATE
    messages = CASES["system+multi-turn"]
    assert render(CHATML_TEMPLATE, messages) == (
        "<|im_start|>system\nBe nice.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
        "<|im_start|>assistant\nHi!<|im_end|>\n<|im_start|>user\nBye 👋<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(GEMMA_TEMPLATE, messages, bos_token="<bos>") == (
        "<bos><start_of_turn>user\nBe nice.\n\nHello<end_of_turn>\n<start_of_turn>model\nHi!<end_of_turn>\n"
        "<start_of_turn>user\nBye 👋<end_of_turn>\n<start_of_turn>model\n"
    )
