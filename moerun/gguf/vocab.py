"""Synthetic GPT-2-style byte-level BPE vocabularies for GGUF files written in tests and benchmarks.

The vocabulary is conventional enough for llama.cpp (`tokenizer.ggml.model = "gpt2"`) and for the
`tokenizers` library (a `BPE` model with a `ByteLevel` pre-tokenizer) to load:

- ids 0..255: the 256 single-byte tokens, token id == byte value, spelled with GPT-2's
  `bytes_to_unicode` characters (e.g. byte 0x20, space, is "Ġ");
- then merged tokens, one per merge, in merge-rank order: first pairs of byte tokens (two characters,
  65,536 possible; letter/digit/space pairs first), then, past 65,536 pairs, a pair token followed by a
  byte token (three characters). Every merge "a b" yields the token "ab", both parts exist earlier in
  the list, and every token string is unique (llama.cpp refuses duplicates);
- last, the special tokens `<|bos|>` and `<|eos|>` (CONTROL).
"""

from __future__ import annotations

import functools

import gguf
import numpy as np

SPECIAL_TOKENS: tuple[str, ...] = ("<|bos|>", "<|eos|>")
N_BYTES = 256
N_PAIRS = N_BYTES * N_BYTES


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (as in openai/gpt-2 encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(N_BYTES):
        if b not in bs:
            bs.append(b)
            cs.append(N_BYTES + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _byte_chars() -> np.ndarray:
    """[256] unicode strings: the GPT-2 character of each byte value."""
    table = bytes_to_unicode()
    return np.array([table[b] for b in range(N_BYTES)], dtype="<U1")


def _common_bytes() -> np.ndarray:
    """[256] bool: bytes that make frequent pairs in text (ASCII letters, digits, space)."""
    common = np.zeros(N_BYTES, dtype=bool)
    for lo, hi in ((ord("a"), ord("z")), (ord("A"), ord("Z")), (ord("0"), ord("9"))):
        common[lo : hi + 1] = True
    common[ord(" ")] = True
    return common


def build_bpe_vocab(n_vocab: int, *, seed: int = 0) -> tuple[list[str], list[int], list[str]]:
    """Build a byte-level BPE vocabulary of exactly `n_vocab` tokens.

    Returns (tokens, token_types, merges): `n_vocab` unique token strings, their `gguf.TokenType`
    values and the `n_vocab - 256 - len(SPECIAL_TOKENS)` merges "a b" in rank order (merge i yields
    token 256 + i). Deterministic for a given `seed`.
    """
    n_special = len(SPECIAL_TOKENS)
    n_merges = n_vocab - N_BYTES - n_special
    if n_merges < 0:
        raise ValueError(f"n_vocab must be >= {N_BYTES + n_special}, got {n_vocab}")
    if n_merges > N_PAIRS * (1 + N_BYTES):
        raise ValueError(f"n_vocab {n_vocab} is too large for a two-level synthetic BPE vocabulary")
    rng = np.random.default_rng(seed)
    chars = _byte_chars()  # [256]

    # Level 1: pairs of byte tokens, common pairs first, random order within each class.
    common = _common_bytes()
    pair_a, pair_b = np.divmod(np.arange(N_PAIRS), N_BYTES)  # [65536] each
    rare = ~(common[pair_a] & common[pair_b])
    order = np.lexsort((rng.random(N_PAIRS), rare))  # common pairs (rare=False) first
    n1 = min(n_merges, N_PAIRS)
    a1, b1 = pair_a[order[:n1]], pair_b[order[:n1]]  # [n1] byte ids
    pair_tokens = np.char.add(chars[a1], chars[b1])  # [n1] two-character tokens
    left = [chars[a1]]
    right = [chars[b1]]

    # Level 2: (pair token, byte token), beyond 65,536 merges.
    n2 = n_merges - n1
    if n2 > 0:
        pick = np.sort(rng.choice(n1 * N_BYTES, size=n2, replace=False))  # [n2]
        p, b2 = np.divmod(pick, N_BYTES)
        left.append(pair_tokens[p])
        right.append(chars[b2])

    lhs = np.concatenate(left).astype(str)
    rhs = np.concatenate(right).astype(str)
    merged = np.char.add(lhs, rhs)  # [n_merges] token strings
    merges = np.char.add(np.char.add(lhs, " "), rhs)

    tokens = chars.tolist() + merged.tolist() + list(SPECIAL_TOKENS)
    types = [int(gguf.TokenType.NORMAL)] * (N_BYTES + n_merges) + [int(gguf.TokenType.CONTROL)] * n_special
    return tokens, types, merges.tolist()


def add_bpe_vocab(writer: gguf.GGUFWriter, n_vocab: int, *, pre: str = "default", seed: int = 0) -> None:
    """Write a GPT-2-style byte-level BPE vocabulary of exactly `n_vocab` tokens (>= 258) to `writer`.

    Keys written: tokenizer.ggml.model ("gpt2"), .pre (`pre`), .tokens, .token_type, .merges,
    .bos_token_id / .eos_token_id (the CONTROL tokens `<|bos|>` / `<|eos|>`, ids n_vocab-2 and
    n_vocab-1) and add_bos_token = False. See the module docstring for the token layout.
    """
    tokens, types, merges = build_bpe_vocab(n_vocab, seed=seed)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index(SPECIAL_TOKENS[0], n_vocab - len(SPECIAL_TOKENS)))
    writer.add_eos_token_id(tokens.index(SPECIAL_TOKENS[1], n_vocab - len(SPECIAL_TOKENS)))
    writer.add_add_bos_token(False)
