"""The tokenizer a GGUF file describes, built with HF's `tokenizers` library, behaving like llama.cpp's.

Two vocabulary models are supported (`tokenizer.ggml.model`):

- `gpt2`: byte-level BPE. Tokens and merges come from the file; the text is first split by the regexes
  llama.cpp uses for the file's `tokenizer.ggml.pre` (table `PRE_TOKENIZERS`, taken from llama.cpp's
  `llm_tokenizer_bpe` constructor), then mapped to GPT-2's byte alphabet.
- `llama`: SentencePiece-style BPE with byte fallback (Llama 1/2, Gemma 3, Phi-3...). The file has no
  merges: they are derived from the vocabulary (every split of a token into two tokens), ranked by the
  token's score, or by its position for Gemma files, exactly as transformers' GGUF loader does. Spaces
  become U+2581; `tokenizer.ggml.add_space_prefix` (default true) puts one before each piece of text.

Special tokens follow llama.cpp: CONTROL (type 3) and USER_DEFINED (type 4) tokens are cut out of the
text before the BPE runs, longest first; USER_DEFINED always, CONTROL only when `parse_special=True`
(llama.cpp's `common_tokenize` defaults: `add_special=True`, `parse_special=False`). A token whose text
names an end of turn (`<|im_end|>`, `<end_of_turn>`, `<|eot_id|>`...) counts as CONTROL, and `eog_ids`
is llama.cpp's end-of-generation set.

Decoding maps each id to its bytes (`token_to_piece`, llama.cpp's `llama_token_to_piece`: CONTROL
tokens render as nothing unless `special=True`) and joins them; `StreamDecoder` releases text only
once its UTF-8 characters are complete. No clean-up of spaces is applied, so streamed and batch
decoding agree.

Anything else (another model type, a pre-tokenizer not in the table) raises `UnsupportedTokenizer`
naming the file and the value, rather than producing wrong ids.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from moerun.errors import MoerunError
from moerun.gguf.reader import GGUFFile

__all__ = ["PRE_TOKENIZERS", "StreamDecoder", "Tokenizer", "UnsupportedTokenizer"]


class UnsupportedTokenizer(MoerunError):
    """The file's tokenizer (model type or pre-tokenizer) is one moerun cannot reproduce exactly."""


# GGUF token types (gguf.TokenType / llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# ---------------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, from llama.cpp's src/llama-vocab.cpp (llm_tokenizer_bpe). Each one splits
# every piece the previous one left, keeping matches and the text between them ("isolated").

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Non-ASCII ranges are written as escapes: an editor's Unicode normalization must not change them.
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM_LETTERS = (
    r"\s?[A-Za-z"
    "\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376"
    "\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_DEEPSEEK_LLM_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp pre-tokenizes one family of `tokenizer.ggml.pre` values.

    `splits`: the regexes, applied in order; `ignore_merges`: a whole pre-token that is itself a token
    is emitted as is (llama.cpp's `ignore_merges`); `add_bos`: llama.cpp's default for
    `add_bos_token` when the file does not say; `bos`: False where llama.cpp has no BOS at all.
    """

    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False
    bos: bool = True


_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_GPT2_PRE = PreTokenizer((_GPT2,))
_STARCODER = PreTokenizer((r"\p{N}", _GPT2))
_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = PreTokenizer((_QWEN2,))

# tokenizer.ggml.pre -> how to split. Families whose regexes llama.cpp's own vocab tests cover here:
# gpt-2, mpt (gpt2 regex), starcoder / refact / command-r (starcoder), llama-bpe (llama3), qwen2,
# qwen35, falcon, deepseek-llm, deepseek-coder; `default` is llama.cpp's fallback.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    **dict.fromkeys(
        ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
         "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"),
        _GPT2_PRE,
    ),
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"), _STARCODER
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
        _LLAMA3_PRE,
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    "chatglm-bpe": PreTokenizer((_LLAMA3,), bos=False),
    **dict.fromkeys(("glm4", "glm5"), PreTokenizer((_LLAMA3,), ignore_merges=True, bos=False)),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2"),
        _QWEN2_PRE,
    ),
    "qwen35": PreTokenizer((_QWEN35,)),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    "deepseek-llm": PreTokenizer(
        ("[\r\n]", _DEEPSEEK_LLM_LETTERS, _DEEPSEEK_LLM_PUNCT, r"\s+$", _CJK, r"\p{N}+")
    ),
    "deepseek-coder": PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
}

# ---------------------------------------------------------------------------------------------------
# Special tokens llama.cpp recognises by their text (llama_vocab::impl::load).

_ID_KEYS = ("bos", "eos", "eot", "eom", "unknown", "padding", "fim_pre", "fim_suf", "fim_mid", "fim_pad",
            "fim_rep", "fim_sep")
_BY_TEXT: dict[str, tuple[str, ...]] = {  # role -> token texts, used when the file gives no id
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
            "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = frozenset(
    ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
     "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
     "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[")
)
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss: USER_DEFINED


@dataclass(frozen=True)
class _ModelDefaults:
    """llama.cpp's defaults per `tokenizer.ggml.model` when the file does not say."""

    bos: int | None
    eos: int | None
    unk: int | None
    add_bos: bool
    add_space_prefix: bool


_MODELS: dict[str, _ModelDefaults] = {
    "llama": _ModelDefaults(bos=1, eos=2, unk=0, add_bos=True, add_space_prefix=True),
    "gpt2": _ModelDefaults(bos=11, eos=11, unk=None, add_bos=False, add_space_prefix=False),
}

# SentencePiece files whose merge order is the token order, not the scores (as transformers' GGUF loader).
_MERGES_BY_POSITION = frozenset(("gemma", "gemma2", "gemma3"))
_SPACE = "\u2581"  # SentencePiece's visible space


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


def _spm_merges(tokens: Sequence[str], rank: Sequence[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a token into two tokens.

    Same result as transformers' `generate_merges(vocab, vocab_scores)`: ordered by the merged token's
    `rank` (higher first), then longer left part, then longer right part, then token order, then by
    the ids of the two parts.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, int, int, int, str, str]] = []
    append = found.append
    for i, tok in enumerate(tokens):
        if vocab.get(tok) != i:
            continue
        score = rank[i]
        for k in range(1, len(tok)):
            left, right = tok[:k], tok[k:]
            li = vocab.get(left)
            if li is None:
                continue
            ri = vocab.get(right)
            if ri is not None:
                append((-score, -k, -(len(tok) - k), i, li, ri, left, right))
    found.sort()
    return [(m[6], m[7]) for m in found]


def _split_merge(merge: str) -> tuple[str, str]:
    """A GGUF merge "a b" as llama.cpp splits it (at the first space after the first character)."""
    pos = merge.find(" ", 1)
    return (merge[:pos], merge[pos + 1 :]) if pos >= 0 else ("", "")


class Tokenizer:
    """A GGUF file's tokenizer. Build it with `Tokenizer.from_gguf(file_or_path)`.

    Attributes: `model` ('gpt2' or 'llama'), `pre` (the pre-tokenizer name), `n_vocab`, `bos_id`,
    `eos_id` (None when absent), `eog_ids` (frozenset), `add_bos` / `add_eos` (what `add_special`
    adds), `add_space_prefix`, `tokens` (the vocabulary strings), `token_types`, and `backend` (the
    `tokenizers.Tokenizer` that runs the BPE on each piece of text between special tokens).
    """

    def __init__(self, f: GGUFFile) -> None:
        self.path = f.path
        model = f.get("tokenizer.ggml.model")
        if model not in _MODELS:
            raise UnsupportedTokenizer(
                f"{f.path}: tokenizer.ggml.model = {model!r} is not supported (moerun supports {sorted(_MODELS)})"
            )
        self.model: str = model
        defaults = _MODELS[model]
        tokens = f.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise UnsupportedTokenizer(f"{f.path}: tokenizer.ggml.tokens is missing or empty")
        n = len(tokens)
        types = list(f.get("tokenizer.ggml.token_type") or [NORMAL] * n)
        if len(types) < n:
            raise UnsupportedTokenizer(f"{f.path}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        types = types[:n]
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp
        self.n_vocab: int = n

        if model == "gpt2":
            pre_name = f.get("tokenizer.ggml.pre") or "default"
            if pre_name not in PRE_TOKENIZERS:
                raise UnsupportedTokenizer(
                    f"{f.path}: tokenizer.ggml.pre = {pre_name!r} is a pre-tokenizer moerun does not know "
                    f"(known: {', '.join(sorted(PRE_TOKENIZERS))})"
                )
            self.pre: str = pre_name
            pre = PRE_TOKENIZERS[pre_name]
            add_bos_default, self.add_space_prefix = pre.add_bos, False
        else:
            self.pre = "default"
            pre = None
            add_bos_default = defaults.add_bos
            self.add_space_prefix = bool(f.get("tokenizer.ggml.add_space_prefix", defaults.add_space_prefix))
            # SentencePiece spells spaces as U+2581; a few files store all-space tokens with real spaces.
            for i, t in enumerate(tokens):
                if t.strip(" ") == "" and types[i] in (USER_DEFINED, NORMAL):
                    tokens[i] = _SPACE * len(t)
                    types[i] = NORMAL
        if len(set(tokens)) != n:
            raise UnsupportedTokenizer(f"{f.path}: tokenizer.ggml.tokens has duplicate strings (llama.cpp refuses)")
        self.tokens: list[str] = tokens
        self._ids: dict[str, int] = {t: i for i, t in enumerate(tokens)}

        ids = self._special_ids(f, defaults, pre)
        types = self._override_types(types, ids)
        self.token_types: list[int] = types
        self.bos_id: int | None = ids["bos"]
        self.eos_id: int | None = ids["eos"]
        self.eot_id: int | None = ids["eot"]
        self.unk_id: int | None = ids["unknown"]
        self.eog_ids: frozenset[int] = self._eog(ids)
        self.add_bos: bool = bool(f.get("tokenizer.ggml.add_bos_token", add_bos_default)) and self.bos_id is not None
        self.add_eos: bool = bool(f.get("tokenizer.ggml.add_eos_token", False)) and self.eos_id is not None

        if model == "gpt2":
            self.backend = self._byte_level_backend(f, pre)
        else:
            self.backend = self._sentencepiece_backend(f)
        self._add_special_tokens()
        self.backend.encode_special_tokens = True  # moerun splits specials itself, llama.cpp's way
        specials = [i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED, UNKNOWN)]
        self._specials_by_first: dict[str, list[int]] = {}
        for i in sorted(specials, key=lambda i: (-len(tokens[i]), i)):
            self._specials_by_first.setdefault(tokens[i][0], []).append(i)
        self._pieces: list[bytes] | None = None

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, f: GGUFFile | str | os.PathLike[str]) -> Tokenizer:
        """The tokenizer of a GGUF file (a `GGUFFile` or a path)."""
        return cls(f if isinstance(f, GGUFFile) else GGUFFile(Path(f)))

    def _special_ids(self, f: GGUFFile, defaults: _ModelDefaults, pre: PreTokenizer | None) -> dict[str, int | None]:
        """Role -> token id: llama.cpp's defaults, then the file's keys, then tokens found by text."""
        ids: dict[str, int | None] = dict.fromkeys(_ID_KEYS)
        ids.update(bos=defaults.bos if pre is None or pre.bos else None, eos=defaults.eos, unknown=defaults.unk)
        for role in _ID_KEYS:
            if ids[role] is not None and ids[role] >= self.n_vocab:
                ids[role] = None
            value = f.get(f"tokenizer.ggml.{role}_token_id")
            if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < self.n_vocab:
                ids[role] = value
        for role, texts in _BY_TEXT.items():
            if ids[role] is None:
                found = [self._ids[t] for t in texts if t in self._ids]
                ids[role] = min(found) if found else None
        return ids

    def _override_types(self, types: list[int], ids: dict[str, int | None]) -> list[int]:
        """Mark end-of-turn / FIM / EOG-looking tokens CONTROL and gpt-oss's markers USER_DEFINED."""
        types = list(types)
        roles = ("eot", "eom", "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")
        for i in [ids[r] for r in roles if ids[r] is not None] + [self._ids[t] for t in _EOG_TEXTS if t in self._ids]:
            if types[i] not in (CONTROL, UNKNOWN):
                types[i] = CONTROL
        for t in _ALWAYS_RENDERED:
            if t in self._ids:
                types[self._ids[t]] = USER_DEFINED
        return types

    def _eog(self, ids: dict[str, int | None]) -> frozenset[int]:
        """llama.cpp's end-of-generation set."""
        eog = {ids[r] for r in ("fim_pad", "fim_rep", "fim_sep", "eos", "eot", "eom") if ids[r] is not None}
        eog |= {self._ids[t] for t in _EOG_TEXTS if t in self._ids}
        texts = {self.tokens[i] for i in eog}
        end = self._ids.get("<|end|>")
        if end is not None and ({"<|return|>", "<|call|>"} <= texts or {"<|calls|>", "<|flush|>"} <= texts):
            eog.discard(end)  # gpt-oss / solar-open: <|end|> closes a message, not the generation
            self.token_types[end] = USER_DEFINED
        s = self._ids.get("</s>")
        if s is not None and texts & {"<|tool_response>", "<|plamo:eos|>"}:
            eog.discard(s)
            self.token_types[s] = NORMAL
        return frozenset(eog)

    def _byte_level_backend(self, f: GGUFFile, pre: PreTokenizer) -> tokenizers.Tokenizer:
        """BPE over GPT-2's byte alphabet, split by the pre-tokenizer's regexes."""
        merges_raw = f.get("tokenizer.ggml.merges")
        if not isinstance(merges_raw, list):
            raise UnsupportedTokenizer(f"{f.path}: a gpt2 tokenizer needs tokenizer.ggml.merges")
        vocab = self._ids
        merges = [m for m in map(_split_merge, merges_raw) if m[0] in vocab and m[1] in vocab]
        tk = tokenizers.Tokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tk.decoder = decoders.ByteLevel()
        return tk

    def _sentencepiece_backend(self, f: GGUFFile) -> tokenizers.Tokenizer:
        """BPE with byte fallback over U+2581-spelled text; merges derived from the vocabulary."""
        tokens = self.tokens
        if f.get("general.architecture") in _MERGES_BY_POSITION:
            rank: Sequence[float] = range(0, -len(tokens), -1)
        else:
            scores = f.get("tokenizer.ggml.scores")
            if not isinstance(scores, list) or len(scores) < len(tokens):
                raise UnsupportedTokenizer(f"{f.path}: a llama (SentencePiece) tokenizer needs tokenizer.ggml.scores")
            rank = scores
        unk = tokens[self.unk_id] if self.unk_id is not None else None
        tk = tokenizers.Tokenizer(
            BPE(vocab=self._ids, merges=_spm_merges(tokens, rank), unk_token=unk, fuse_unk=True, byte_fallback=True)
        )
        tk.normalizer = normalizers.Replace(" ", _SPACE)
        seq = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        tk.decoder = decoders.Sequence(seq)
        return tk

    def _add_special_tokens(self) -> None:
        """Register CONTROL tokens as special and USER_DEFINED ones as plain added tokens (same ids)."""
        control = [AddedToken(t, normalized=False, special=True)
                   for t, ty in zip(self.tokens, self.token_types, strict=True) if ty in (CONTROL, UNKNOWN)]
        user = [AddedToken(t, normalized=False, special=False)
                for t, ty in zip(self.tokens, self.token_types, strict=True) if ty == USER_DEFINED]
        self.backend.add_special_tokens(control)
        self.backend.add_tokens(user)

    # -- encoding --------------------------------------------------------------------------------

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut special tokens out of `text` as llama.cpp's tokenizer_st_partition does.

        Longest token first, every occurrence; CONTROL / UNKNOWN tokens only if `parse_special`.
        Returns text pieces and token ids in order.
        """
        chars = set(text)
        candidates = [
            i for c in chars & self._specials_by_first.keys() for i in self._specials_by_first[c]
            if self.tokens[i] in text and (parse_special or self.token_types[i] == USER_DEFINED)
        ]
        parts: list[str | int] = [text]
        for i in sorted(candidates, key=lambda i: (-len(self.tokens[i]), i)):
            needle = self.tokens[i]
            out: list[str | int] = []
            for p in parts:
                if isinstance(p, int) or needle not in p:
                    out.append(p)
                    continue
                pieces = p.split(needle)
                for k, piece in enumerate(pieces):
                    if k:
                        out.append(i)
                    if piece:
                        out.append(piece)
            parts = out
        return parts

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`, as llama.cpp's `common_tokenize(ctx, text, add_special, parse_special)`.

        `add_special` adds BOS (and EOS) where the file asks for them; `parse_special` lets CONTROL
        tokens written in the text (e.g. `<start_of_turn>`) encode as their single id.
        """
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)  # type: ignore[arg-type]
        parts = self._partition(text, parse_special) if text else []
        texts = [p for p in parts if isinstance(p, str)]
        if self.add_space_prefix:
            texts = [" " + p for p in texts]
        encoded = iter(self.backend.encode_batch_fast(texts, add_special_tokens=False)) if texts else iter(())
        for p in parts:
            out.extend(next(encoded).ids if isinstance(p, str) else (p,))
        if add_special and self.add_eos:
            out.append(self.eos_id)  # type: ignore[arg-type]
        return out

    # -- decoding --------------------------------------------------------------------------------

    def _piece_table(self) -> list[bytes]:
        """[n_vocab] the bytes each token stands for (CONTROL / UNKNOWN: their text)."""
        if self._pieces is None:
            pieces: list[bytes] = []
            byte_level = self.model == "gpt2"
            for t, ty in zip(self.tokens, self.token_types, strict=True):
                if ty in (CONTROL, UNKNOWN, USER_DEFINED):
                    pieces.append(t.encode())
                elif ty == BYTE and not byte_level and len(t) == 6 and t.startswith("<0x"):
                    pieces.append(bytes([int(t[3:5], 16)]))
                elif ty in (NORMAL, BYTE):
                    if byte_level:
                        pieces.append(b"".join(bytes([_BYTE_OF_CHAR[c]]) if c in _BYTE_OF_CHAR else c.encode()
                                               for c in t))
                    else:
                        pieces.append(t.replace(_SPACE, " ").encode())
                else:  # UNUSED / undefined: llama.cpp renders nothing
                    pieces.append(b"")
            self._pieces = pieces
        return self._pieces

    def token_to_piece(self, token_id: int, *, special: bool = True) -> bytes:
        """The bytes of one token (llama.cpp's `llama_token_to_piece`); CONTROL tokens are empty
        unless `special`. A piece can be part of a UTF-8 character."""
        if not 0 <= token_id < self.n_vocab:
            raise MoerunError(f"{self.path}: token id {token_id} is outside the vocabulary (0..{self.n_vocab - 1})")
        if not special and self.token_types[token_id] in (CONTROL, UNKNOWN):
            return b""
        return self._piece_table()[token_id]

    def token_to_id(self, text: str) -> int | None:
        """The id of the token spelled `text` in the vocabulary, or None."""
        return self._ids.get(text)

    def is_eog(self, token_id: int) -> bool:
        """True for tokens that end generation (`eog_ids`)."""
        return token_id in self.eog_ids

    def decode_bytes(self, ids: Iterable[int], *, special: bool = False) -> bytes:
        """The bytes of `ids` joined (CONTROL tokens empty unless `special`), nothing removed."""
        return b"".join(self.token_to_piece(i, special=special) for i in ids)

    def decode(self, ids: Iterable[int], *, special: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 becomes U+FFFD). CONTROL tokens are left out unless `special`.

        With `add_space_prefix`, the space the tokenizer put before the text is removed again.
        """
        ids = list(ids)
        data = self.decode_bytes(ids, special=special)
        if self.add_space_prefix and ids and self.token_types[ids[0]] not in (CONTROL, UNKNOWN):
            data = data[1:] if data.startswith(b" ") else data
        return data.decode("utf-8", errors="replace")

    def stream(self, *, special: bool = False) -> StreamDecoder:
        """A new `StreamDecoder` over this tokenizer."""
        return StreamDecoder(self, special=special)

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab})"


class StreamDecoder:
    """Turns ids arriving one at a time into text, never splitting a multi-byte UTF-8 character.

    `feed(id)` returns the text that became complete (often '' in the middle of an emoji); `flush()`
    returns what is left at the end (an incomplete tail becomes U+FFFD). The concatenation of all the
    returned strings equals `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, *, special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True

    def feed(self, token_id: int) -> str:
        """Add one token; return newly completed text."""
        tok = self.tokenizer
        data = tok.token_to_piece(token_id, special=self.special)
        if self._first:
            self._first = False
            if tok.add_space_prefix and tok.token_types[token_id] not in (CONTROL, UNKNOWN) and data.startswith(b" "):
                data = data[1:]
        return self._utf8.decode(data)

    def feed_many(self, ids: Iterable[int]) -> str:
        """Add several tokens; return newly completed text."""
        return "".join(self.feed(i) for i in ids)

    def flush(self) -> str:
        """End of stream: the rest of the text (an unfinished character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)
