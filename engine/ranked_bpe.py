"""Mistral's `tekken.json` read as a `tokenizers` Tokenizer, for checkpoints that ship no
tokenizer.json (engine/tokenizer.py asks for it).

A tekken file is a byte-level BPE given as ranked tokens (tiktoken's form: a token's rank is its
merge priority), its regex pre-split, and its special tokens, which take the first ids (the
configured `default_num_special_tokens`; those the file does not name are `<SPECIAL_i>` fillers)
with the ranked tokens after them, cut to `default_vocab_size` in all. A BPE over ranks is a BPE
over merges: each token of two or more bytes is made by exactly one merge, the last one BPE applies
when it encodes the token's bytes with only lower ranks, so the merges come out in rank order, and
a pre-split piece that is itself a token is taken whole (`ignore_merges`, tiktoken's rule). Bytes
are mapped to characters as GPT-2's byte-level BPE maps them. Special tokens written in text are
read as special tokens (as every tokenizer.json cuttle reads does), so chat templates that spell
them work; a file without its special tokens (versions v3 / v7 relied on a built-in list) is
refused, naming the conversion that handles it.
"""
from __future__ import annotations

import base64
import json
from typing import Any

from tokenizers import Tokenizer as HFTokenizer


def _byte_chars() -> list[str]:
    """GPT-2's byte -> character map: printable Latin-1 bytes stand for themselves, the others
    take the code points from 256 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars: list[str] = [""] * 256
    extra = 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _last_merge(token: bytes, ranks: dict[bytes, int], rank: int) -> tuple[bytes, bytes]:
    """The two parts BPE joins last when it encodes `token`'s bytes with the ranks below `rank`."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = rank, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1], rank)
            if r < best:
                best, at = r, i
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    if len(parts) != 2:
        raise ValueError(f"tekken.json: token {token!r} (rank {rank}) is not a merge of two lower-ranked tokens")
    return parts[0], parts[1]


def tekken_tokenizer(path: str) -> HFTokenizer:
    """The `tokenizers` Tokenizer of the tekken.json at `path` (see the module docstring)."""
    with open(path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    cfg = data.get("config") if isinstance(data, dict) else None
    if not isinstance(cfg, dict) or not isinstance(data.get("vocab"), list) or not all(
            k in cfg for k in ("pattern", "default_vocab_size", "default_num_special_tokens")):
        raise ValueError(f"{path} is not a tekken vocabulary: it needs config.pattern, config.default_vocab_size, "
                         "config.default_num_special_tokens and vocab")
    specials = data.get("special_tokens")
    if specials is None:
        raise ValueError(f"{path} names no special_tokens (tekken version {cfg.get('version')!r}): convert it to "
                         "tokenizer.json with transformers' convert_tekken_tokenizer and save it beside it")
    num_special = int(cfg["default_num_special_tokens"])
    inner = int(cfg["default_vocab_size"]) - num_special
    vocab = data["vocab"][:inner]
    ranks = {base64.b64decode(t["token_bytes"]): t["rank"] for t in vocab}
    if len(ranks) != len(vocab) or sorted(ranks.values()) != list(range(len(vocab))):
        raise ValueError(f"{path}: the vocab's ranks are not 0 .. {len(vocab) - 1}, one token each")
    chars = _byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    ids = {text(tok): rank + num_special for tok, rank in ranks.items()}
    merges = [[text(a), text(b)] for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]) if len(tok) > 1
              for a, b in [_last_merge(tok, ranks, rank)]]
    named = {int(t["rank"]): t["token_str"] for t in specials}
    added = [{"id": i, "content": named.get(i, f"<SPECIAL_{i}>"), "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i in range(num_special)]
    # (in the model's vocabulary too: an added token takes the model's id for its text, else one after it)
    ids.update({t["content"]: t["id"] for t in added})
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": cfg["pattern"]}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": ids, "merges": merges},
    }
    return HFTokenizer.from_str(json.dumps(spec))
