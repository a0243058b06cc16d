"""Structured output and the token-level sampling controls, as one mask stage.

Owns what decides, per sampled row, which tokens may come next: the grammar of a request's
`structured_outputs` (JSON schema, JSON object, regex, choice, EBNF grammar, structural tag),
`allowed_token_ids`, `bad_words`, `logit_bias` and `thinking_token_budget`. Concretely:
- grammar compilation through xgrammar: the tokenizer's vocabulary is read once (lazily, at the
  first request that needs it), and compiled grammars are cached per spec (LRU);
- the per-request state (`Controls`), created at admission, so a bad spec is refused before
  anything is queued (a `ValueError` naming the field);
- one grammar matcher per *sample*: the `n` samples of a request (and the members of a GRPO
  group, which are separate requests) never share one. A matcher is created on a sample's first
  sampled step and fed that sample's own output tokens, so a fork needs no copy;
- the per-step job (`start`): on a worker thread, every constrained sample's matcher catches up
  with the tokens appended since the last step and fills the sample's row of the token bitmask,
  while the main thread runs the model's forward. The sampler then waits for the `TokenMask`
  and applies it (engine/sampler.py `apply_token_mask`).

Thinking budget (vLLM's `thinking_token_budget`): the model's thinking tags are single tokens of
its vocabulary (`<think>` / `</think>`: Qwen3, DeepSeek-R1, GLM-4.5; `<seed:think>` /
`</seed:think>`: Seed-OSS), found once in the tokenizer. A sample is in its thinking block from
the start if the prompt leaves one open (its last opening tag after its last closing one), else
from the opening tag it writes. Once it has written `thinking_token_budget` tokens there without
closing the block, its row allows only the closing tag, which overrides every other control; the
budget covers the first block only. Its state per sample catches up with the output as a
matcher does.

Preemption and recompute keep a sequence's tokens, so a matcher never has to roll back: it
counts the tokens it has consumed and only ever catches up. It never samples and never touches
logits. xgrammar is optional: `cuttle.engine` imports without it, and a request that needs it is
refused with an error naming the missing package. Why xgrammar and not llguidance: docs/server.md.
"""
from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from cuttle.engine.grammar_support import (REGEX_DOT, UNENFORCED_WHAT, explicit_dots, schema_with_explicit_dots,
                                           unenforced_keywords, unenforced_regex)
from cuttle.engine.sampling_params import SamplingParams, StructuredOutputsParams
from cuttle.engine.token_calls import CallProgram, CompiledCalls, compile_calls, fill_calls

if TYPE_CHECKING:
    from cuttle.engine.sequence import Request, Sequence
    from cuttle.engine.tokenizer import Tokenizer

# tokenizers' decoders whose output is the concatenation of each token's own bytes: a grammar over
# tokens is then a grammar over the text (WordPiece and friends insert spaces between tokens)
_CONCAT_DECODERS = {"ByteLevel", "Metaspace", "ByteFallback", "Fuse", "Strip", "Replace"}
_CACHE_SIZE = 64  # compiled grammars kept (a JSON schema on a 151k vocab compiles in ~0.1 s)
# JSON is generated in one layout, separators ", " and ": " and no other whitespace: with free
# whitespace a code model's vocabulary (tokens of dozens of spaces, runs of newlines) fills
# max_tokens with indentation (measured: 16 of 16 embedded-model samples cut at 200 tokens).
_JSON_LAYOUT = {"any_whitespace": False}


def xgrammar() -> Any:
    """The xgrammar module, or a ValueError naming the package to install."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise ValueError("structured_outputs needs the xgrammar package, which is not installed "
                         "(pip install 'cuttle[serve]', or pip install xgrammar)") from None
    return xgr


def build_grammar(spec: StructuredOutputsParams) -> Any:
    """The spec as an (uncompiled, tokenizer-free) xgrammar Grammar; a ValueError naming the field
    when the schema / regex / grammar does not parse."""
    xgr = xgrammar()
    kind = spec.kind
    if kind == "json":
        try:
            parsed = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        except ValueError:
            parsed = None  # not JSON: xgrammar's error below names it
        bad = unenforced_keywords(parsed)
        if bad:
            raise ValueError(f"structured_outputs.json uses {', '.join(bad[:4])}: a keyword the grammar does not enforce "
                             f"({UNENFORCED_WHAT}), so the output could break it")
    if kind == "regex" and isinstance(spec.regex, str) and (why := unenforced_regex(spec.regex)):
        raise ValueError(f"structured_outputs.regex uses {why}, which the grammar does not enforce ({UNENFORCED_WHAT}), "
                         "so the output could break it")
    try:
        if kind == "json":
            # (not JSON: the text as sent, for xgrammar's error to name)
            schema = json.dumps(schema_with_explicit_dots(parsed)) if parsed is not None else spec.json
            return xgr.Grammar.from_json_schema(schema, strict_mode=True, **_JSON_LAYOUT)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', **_JSON_LAYOUT)
        if kind == "regex":
            return xgr.Grammar.from_regex(explicit_dots(spec.regex, REGEX_DOT))
        if kind == "choice":
            # an EBNF alternation of string literals (JSON string escapes are EBNF's too)
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.grammar)
        return xgr.Grammar.from_structural_tag(spec.structural_tag)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / its own types for a bad spec
        raise ValueError(f"structured_outputs.{kind} does not compile: {str(e).strip()[:300]}") from None


_tokenizer_verdicts: weakref.WeakKeyDictionary[Tokenizer, str] = weakref.WeakKeyDictionary()


def check_tokenizer(tok: Tokenizer | None) -> None:
    """Refuse a tokenizer whose decoded text is not the concatenation of its tokens' texts (the
    verdict is cached: serializing a 151k vocabulary to read its decoder takes ~0.1 s)."""
    if tok is None:
        raise ValueError("structured_outputs needs a tokenizer (the engine runs without one)")
    why = _tokenizer_verdicts.get(tok)
    if why is None:
        bad = sorted(_decoder_kinds(json.loads(tok.tok.to_str()).get("decoder")) - _CONCAT_DECODERS)
        why = _tokenizer_verdicts[tok] = (
            f"structured_outputs is not supported for this checkpoint's tokenizer: its decoder {bad[0]} does not decode "
            "text as the concatenation of its tokens (byte-level BPE, byte-fallback and raw vocabularies do)") if bad else ""
    if why:
        raise ValueError(why)


def _decoder_kinds(decoder: dict[str, Any] | None) -> set[str]:
    if decoder is None:
        return set()
    if decoder.get("type") == "Sequence":
        return set().union(*(_decoder_kinds(d) for d in decoder.get("decoders", [])))
    return {decoder.get("type", "?")}


@dataclass(slots=True)
class Controls:
    """One request's controls, compiled."""

    grammar: Any = None  # xgrammar CompiledGrammar
    allowed: np.ndarray | None = None  # uint32 bitmask row of allowed_token_ids
    banned: np.ndarray | None = None  # single-token bad words, always banned
    bad_seqs: list[tuple[int, ...]] = field(default_factory=list)  # multi-token bad words
    bias_ids: torch.Tensor | None = None
    bias_vals: torch.Tensor | None = None
    matchers: dict[int, list[Any]] = field(default_factory=dict)  # sample index (the key) -> [matcher, tokens consumed]
    think: tuple[int, int, int] | None = None  # thinking budget: (opening tag id, closing tag id, budget)
    thinking: dict[int, list[int]] = field(default_factory=dict)  # sample index -> [tokens consumed, phase, tokens in the block]
    calls: CompiledCalls | None = None  # tool calls with special-token markers (engine/token_calls.py)
    call_states: dict[int, list[Any]] = field(default_factory=dict)  # sample index -> its program's state

    @property
    def masks(self) -> bool:
        return (self.grammar is not None or self.allowed is not None or self.banned is not None or bool(self.bad_seqs)
                or self.think is not None or self.calls is not None)


# a sample's place in its thinking budget (Controls.thinking)
_BEFORE, _THINKING, _AFTER = 0, 1, 2
# the thinking tags, most specific first, that a budget looks for among the vocabulary's tokens
_THINK_TAGS = (("<seed:think>", "</seed:think>"), ("<think>", "</think>"))


@dataclass(slots=True)
class TokenMask:
    """What the sampler applies to one step's logits rows (engine/sampler.py `apply_token_mask`)."""

    rows: list[int]  # rows that have a bitmask row, in order
    bitmask: torch.Tensor  # int32 [len(rows), ceil(vocab / 32)]; bit t of a row set = token t allowed
    bias_rows: torch.Tensor | None = None  # long [k]: logit_bias entries as (row, token, value)
    bias_ids: torch.Tensor | None = None
    bias_vals: torch.Tensor | None = None
    failed: dict[int, str] = field(default_factory=dict)  # row -> why its grammar rejected its own tokens

    def take(self, src: list[int]) -> TokenMask:
        """The mask for rows `src[k]` placed at row k (the n samples of a prompt that just forked
        share its row)."""
        where = {r: i for i, r in enumerate(self.rows)}
        rows = [k for k, r in enumerate(src) if r in where]
        bitmask = self.bitmask[[where[src[k]] for k in rows]] if rows else self.bitmask[:0]
        out = TokenMask(rows, bitmask, failed={k: self.failed[r] for k, r in enumerate(src) if r in self.failed})
        if self.bias_rows is not None:
            pos = torch.tensor(src)
            picks = (pos[:, None] == self.bias_rows[None, :]).nonzero()  # (new row, entry)
            out.bias_rows, out.bias_ids, out.bias_vals = picks[:, 0], self.bias_ids[picks[:, 1]], self.bias_vals[picks[:, 1]]
        return out


class StructuredOutput:
    """The engine's mask stage: per-request controls and the per-step bitmask job."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.width = (vocab_size + 31) // 32
        self.eos_token_ids = sorted(t for t in eos_token_ids if t < vocab_size)
        self._compiler: Any = None
        self._json_safe: np.ndarray | None = None  # bitmask row: tokens free of raw control characters
        self._compiled: OrderedDict[tuple, Any] = OrderedDict()
        # specs being compiled, each by the first thread that asked: another asking for the same
        # spec waits for that compile, while a cache hit or a different spec never waits for it
        self._compiling: dict[tuple, Future] = {}
        # the cache and the in-flight table, held only to look up and to store: a compile (xgrammar
        # releases the GIL; a hostile schema runs for seconds on a large vocabulary) holding it would
        # stall the engine thread's admission of any structured request, and with it every decode
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()  # building the vocabulary's tables, once
        self._controls: weakref.WeakKeyDictionary[Request, Controls] = weakref.WeakKeyDictionary()
        self._pool: ThreadPoolExecutor | None = None
        self._think_tags: tuple[int, int] | None = None

    # ---- admission -------------------------------------------------------------------------
    def prepare(self, params: SamplingParams, stop_ids: Collection[int] = ()) -> Controls | None:
        """The compiled controls of `params` (None if it sets none); a ValueError naming the field
        for a token id out of the vocabulary, a spec that does not compile, or allowed_token_ids
        that bad_words (and, under min_tokens, the stop ids `stop_ids`) leave empty."""
        if not params.has_controls:
            return None
        ctl = Controls()
        v = self.vocab_size
        if params.logit_bias is not None:
            bad = next((t for t in params.logit_bias if t >= v), None)
            if bad is not None:
                raise ValueError(f"logit_bias token ids must be in [0, {v - 1}], got {bad}")
            ctl.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            ctl.bias_vals = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        if params.allowed_token_ids is not None:
            bad = next((t for t in params.allowed_token_ids if t >= v), None)
            if bad is not None:
                raise ValueError(f"allowed_token_ids must be in [0, {v - 1}], got {bad}")
            ctl.allowed = np.zeros(self.width, dtype=np.uint32)
            _set_bits(ctl.allowed, np.array(params.allowed_token_ids, dtype=np.int64))
        single: set[int] = set()
        if params.bad_words is not None:
            single, ctl.bad_seqs = self._bad_word_ids(params.bad_words)
            if single:
                ctl.banned = np.array(sorted(single), dtype=np.int64)
        if params.allowed_token_ids is not None:
            # every logit -inf: the sample would be garbage (token 0, NaN logprobs)
            left = set(params.allowed_token_ids) - single
            if not left:
                raise ValueError(f"allowed_token_ids {sorted(set(params.allowed_token_ids))[:8]} are all banned by bad_words: "
                                 "nothing could be sampled")
            if stop_ids and left <= set(stop_ids):
                raise ValueError(f"allowed_token_ids {sorted(left)[:8]} left by bad_words are all stop or EOS tokens, which "
                                 f"min_tokens ({params.min_tokens}) forbids: nothing could be sampled")
        if params.thinking_token_budget is not None:
            ctl.think = (*self.thinking_tags(), params.thinking_token_budget)
        so = params.structured_outputs
        if so is not None and so.kind == "tool_calls":
            ctl.calls = self.compile(so)
        elif so is not None:
            ctl.grammar = self.compile(so)
            if so.kind in ("json", "json_object"):
                # xgrammar's rule for a string with maxLength / minLength admits raw control
                # characters, which JSON forbids (and our JSON layout has no raw whitespace either)
                safe = self._json_safe
                assert safe is not None
                ctl.allowed = safe.copy() if ctl.allowed is None else ctl.allowed & safe
        return ctl

    def _text_of(self, token: int) -> str:
        """A token's text, special tokens spelled (a tool-call program's opening texts read it)."""
        assert self.tokenizer is not None
        return self.tokenizer.tok.decode([token], skip_special_tokens=False)

    def thinking_tags(self) -> tuple[int, int]:
        """The ids of the model's thinking tags (opening, closing); a ValueError naming
        thinking_token_budget where the vocabulary has no such pair of single tokens."""
        if self._think_tags is None:
            tok = self.tokenizer
            if tok is None:
                raise ValueError("thinking_token_budget needs a tokenizer (the engine runs without one) to find the "
                                 "model's thinking tags")
            for opening, closing in _THINK_TAGS:
                ids = tok.tok.token_to_id(opening), tok.tok.token_to_id(closing)
                if None not in ids and max(ids) < self.vocab_size:
                    self._think_tags = ids
                    break
            else:
                raise ValueError("thinking_token_budget needs thinking tags that are single tokens of the model's vocabulary ("
                                 + ", ".join(f"{a} / {b}" for a, b in _THINK_TAGS) + "); this tokenizer has none")
        return self._think_tags

    def attach(self, req: Request, ctl: Controls | None) -> None:
        if ctl is not None:
            self._controls[req] = ctl

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of `spec`, from the cache or compiled now (a ValueError naming the
        field if it does not compile). Thread-safe; concurrent compiles of different specs run
        side by side, and one of the same spec is shared."""
        key = spec.key()
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
            pending = self._compiling.get(key)
            owner = pending is None
            if owner:
                pending = self._compiling[key] = Future()
        assert pending is not None
        if not owner:
            return pending.result()  # (re-raises the owner's ValueError)
        try:
            compiled = self._compile_new(spec)
        except BaseException as e:
            with self._lock:
                del self._compiling[key]
            pending.set_exception(e)
            raise
        with self._lock:
            self._compiled[key] = compiled
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
            del self._compiling[key]
        pending.set_result(compiled)
        return compiled

    def _compile_new(self, spec: StructuredOutputsParams) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = self._build_compiler()
        if spec.kind == "tool_calls":
            assert spec.tool_calls is not None
            xgr = xgrammar()

            def segment(seg: dict[str, Any]) -> Any:  # (a tool's schema as the other tool-call grammars take it: best effort)
                grammar = (xgr.Grammar.from_regex(seg["regex"]) if "regex" in seg else
                           xgr.Grammar.from_json_schema(json.dumps(seg["json"]), strict_mode=True, **_JSON_LAYOUT))
                if "lead" in seg:  # a regex before the JSON (an optional space)
                    grammar = xgr.Grammar.concat(xgr.Grammar.from_regex(seg["lead"]), grammar)
                return self._compiler.compile_grammar(grammar)

            return compile_calls(CallProgram.from_json(spec.tool_calls), segment)
        grammar = build_grammar(spec)
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except RuntimeError as e:  # xgrammar's own checks failing on a spec it parsed (seen on some patterns)
            raise ValueError(f"structured_outputs.{spec.kind} does not compile (xgrammar: "
                             f"{str(e).strip()[:300]})") from None
        _check_admits_output(compiled, spec)
        return compiled

    def _build_compiler(self) -> Any:
        """xgrammar's view of the vocabulary: each token's text as the tokenizer stores it (the
        byte-level / byte-fallback encoding xgrammar decodes), special tokens blanked so a grammar
        never emits them as text (the stop tokens end the output), ids past the tokenizer up to
        the logits' width never allowed."""
        xgr = xgrammar()
        tok = self.tokenizer
        check_tokenizer(tok)
        assert tok is not None
        # how xgrammar reads the stored token strings: GPT-2 byte-level, sentencepiece byte
        # fallback (<0x0A>, with the metaspace prefix), or as they are
        kinds = _decoder_kinds(json.loads(tok.tok.to_str()).get("decoder"))
        vocab_type = (xgr.VocabType.BYTE_LEVEL if "ByteLevel" in kinds else
                      xgr.VocabType.BYTE_FALLBACK if "ByteFallback" in kinds else xgr.VocabType.RAW)
        n = min(tok.vocab_size, self.vocab_size)
        vocab = [tok.tok.id_to_token(i) or "" for i in range(n)]
        for i in tok.special_ids:
            if i < n:
                vocab[i] = ""
        info = xgr.TokenizerInfo(vocab, vocab_type, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids,
                                 add_prefix_space="Metaspace" in kinds)
        safe = np.zeros(self.width, dtype=np.uint32)
        clean = [i for i, b in enumerate(info.decoded_vocab) if b and not any(c < 0x20 for c in b)]
        _set_bits(safe, np.array(clean + self.eos_token_ids, dtype=np.int64))
        self._json_safe = safe
        return xgr.GrammarCompiler(info, max_threads=1)

    def _bad_word_ids(self, words: list[str]) -> tuple[set[int], list[tuple[int, ...]]]:
        """Each word as tokens, alone and after a space (vLLM's rule: the spaced form counts when
        it is a different token sequence of the same length)."""
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer (the engine runs without one)")
        single: set[int] = set()
        seqs: list[tuple[int, ...]] = []
        for w in words:
            plain = self.tokenizer.encode(w, add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + w.lstrip(" "), add_special_tokens=False)
            forms = [plain] + ([spaced] if len(spaced) == len(plain) and spaced != plain else [])
            for ids in forms:
                if len(ids) == 1:
                    single.add(ids[0])
                elif ids and tuple(ids) not in seqs:
                    seqs.append(tuple(ids))
        return single, seqs

    # ---- the step ----------------------------------------------------------------------------
    def start(self, seqs: list[Sequence]) -> Future | None:
        """Start filling the masks of the rows sampled this step (row j = seqs[j]) on the worker
        thread; None when no row has controls (the common case costs one dict lookup per row)."""
        if not self._controls:
            return None
        picks = [(j, s, c) for j, s in enumerate(seqs) if (c := self._controls.get(s.request)) is not None]
        if not picks:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="cuttle-mask")
        return self._pool.submit(self._fill, picks)

    def _fill(self, picks: list[tuple[int, Sequence, Controls]]) -> TokenMask:
        masked = [(j, s, c) for j, s, c in picks if c.masks]
        bitmask = torch.full((len(masked), self.width), -1, dtype=torch.int32)
        bits = bitmask.numpy().view(np.uint32)
        failed: dict[int, str] = {}
        for k, (j, seq, ctl) in enumerate(masked):
            # the output is read from its end only (new tokens, a bad word's prefix): no copy of it
            ids = seq.token_ids
            err = self.fill_row(ctl, seq.index, ids, seq.num_prompt_tokens, len(ids), bitmask, bits, k)
            if err is not None:
                failed[j] = err
        mask = TokenMask([j for j, _, _ in masked], bitmask, failed=failed)
        biased = [(j, c) for j, _, c in picks if c.bias_ids is not None]
        if biased:
            mask.bias_rows = torch.cat([torch.full((len(c.bias_ids),), j, dtype=torch.long) for j, c in biased])
            mask.bias_ids = torch.cat([c.bias_ids for _, c in biased])
            mask.bias_vals = torch.cat([c.bias_vals for _, c in biased])
        return mask

    def fill_row(self, ctl: Controls, key: int, ids: list[int], start: int, end: int, bitmask: torch.Tensor,
                 bits: np.ndarray, k: int) -> str | None:
        """Row k of `bitmask` (int32 [rows, width], all bits set; `bits` its uint32 view): the tokens
        `ctl` allows at position `end` of `ids`, whose output (one engine request's) began at
        `start`. `key` names the sample's grammar matcher, which consumes the output up to `end`
        (calls for one key come in increasing `end`). The reason, where the grammar rejects a token
        of that output; else None. Also the RL trainer's replay of a sampled token's mask."""
        err = self._fill_grammar(ctl, key, ids, start, end, bitmask, k) if ctl.grammar is not None else None
        if ctl.calls is not None:
            err = fill_calls(ctl.calls, ctl.call_states, key, ids, start, end, bits, k, self.width, self._text_of)
        if ctl.allowed is not None:
            bits[k] &= ctl.allowed
        if ctl.banned is not None:
            _clear_bits(bits[k], ctl.banned)
        if ctl.bad_seqs:
            hit = [s[-1] for s in ctl.bad_seqs if end - start >= len(s) - 1 and tuple(ids[end - len(s) + 1 : end]) == s[:-1]]
            if hit:
                _clear_bits(bits[k], np.array(hit, dtype=np.int64))
        if ctl.think is not None and _thinking_spent(ctl, key, ids, start, end):
            bits[k] = 0  # the budget is spent inside the block: only its closing tag, whatever else says
            _set_bits(bits[k], np.array([ctl.think[1]], dtype=np.int64))
        return err

    def _fill_grammar(self, ctl: Controls, key: int, ids: list[int], start: int, end: int, bitmask: torch.Tensor,
                      k: int) -> str | None:
        entry = ctl.matchers.get(key)
        if entry is None:
            entry = ctl.matchers[key] = [xgrammar().GrammarMatcher(ctl.grammar, max_rollback_tokens=0), 0]
        matcher, done = entry
        for t in ids[start + done : end]:  # the output tokens sampled since the last fill (preemption keeps them all)
            if not matcher.accept_token(t):
                return f"token {t} at output position {done} is not allowed by the request's grammar"
            done += 1
        entry[1] = done
        matcher.fill_next_token_bitmask(bitmask, k)
        return None


def _thinking_spent(ctl: Controls, key: int, ids: list[int], start: int, end: int) -> bool:
    """Whether sample `key`, whose output began at `start`, has written its thinking budget inside
    an open thinking block by position `end` (see the module docstring)."""
    assert ctl.think is not None
    opening, closing, budget = ctl.think
    state = ctl.thinking.get(key)
    if state is None:  # where the prompt leaves it: in a block if its last opening tag follows its last closing one
        last_open = last_close = -1
        for i in range(start - 1, -1, -1):
            t = ids[i]
            if t == opening and last_open < 0:
                last_open = i
            elif t == closing and last_close < 0:
                last_close = i
            if last_open >= 0 and last_close >= 0:
                break
        state = ctl.thinking[key] = [0, _THINKING if last_open > last_close else _BEFORE, 0]
    done, phase, count = state
    for t in ids[start + done : end]:
        if phase == _BEFORE:
            phase = _THINKING if t == opening else _BEFORE
        elif phase == _THINKING:
            if t == closing:
                phase = _AFTER
            else:
                count += 1
    state[:] = [end - start, phase, count]
    return phase == _THINKING and count >= budget


def _check_admits_output(compiled: Any, spec: StructuredOutputsParams) -> None:
    """A grammar whose first step allows no token (`root ::= root`: no finite string) would fail
    its request at the first sample: refused at compile time instead, naming the field."""
    xgr = xgrammar()
    matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=0)
    mask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(mask, 0)
    if not bool(mask.any()):
        raise ValueError(f"structured_outputs.{spec.kind} admits no output: its first token can be none "
                         "(a rule with no finite expansion?)")


def _set_bits(row: np.ndarray, ids: np.ndarray) -> None:
    np.bitwise_or.at(row, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))


def _clear_bits(row: np.ndarray, ids: np.ndarray) -> None:
    np.bitwise_and.at(row, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))


# ---- tool calls ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _CallShape:
    """One tool-call format's text around a call's arguments, as its grammar writes it. NAME
    stands for the tool's name, QNAME for it as a JSON string."""

    style: str | None  # the arguments' xgrammar style (None: JSON)
    named_lead: str  # a named call's text before its arguments, after the server's opening
    required_head: str  # a required call's text before its arguments, after the server's opening
    forced_end: str  # after a forced call's arguments (then only EOS)
    trigger: str  # auto: what, written by the model, puts the call under the grammar
    tag_begin: str  # auto: a call's text up to its arguments
    tag_end: str  # auto: its text after them


_DS_CALL_END = "<｜tool▁call▁end｜>"
# the openings written for forced calls are chat.py's `_OPENINGS`; these continue them
_SHAPES = {
    "hermes": _CallShape(None, " ", ' QNAME, "arguments": ', "}\n</tool_call>", "<tool_call>",
                         '<tool_call>\n{"name": QNAME, "arguments": ', "}\n</tool_call>"),
    "llama3_json": _CallShape(None, " ", ' QNAME, "parameters": ', "}", '{"name": ', '{"name": QNAME, "parameters": ', "}"),
    "qwen3_coder": _CallShape("qwen_xml", "", "NAME>\n", "\n</function>\n</tool_call>", "<tool_call>\n<function=",
                              "<tool_call>\n<function=NAME>\n", "\n</function>\n</tool_call>"),
    "seed_oss": _CallShape("qwen_xml", "", "NAME>\n", "\n</function>\n</seed:tool_call>", "<seed:tool_call>\n<function=",
                           "<seed:tool_call>\n<function=NAME>\n", "\n</function>\n</seed:tool_call>"),
    "glm45": _CallShape("glm_xml", "", "NAME", "</tool_call>", "<tool_call>", "<tool_call>NAME", "</tool_call>"),
    "minimax_m2": _CallShape("minimax_xml", "", 'NAME">\n', "</invoke>\n</minimax:tool_call>", '<invoke name="',
                             '<invoke name="NAME">\n', "</invoke>"),
    "deepseek_v31": _CallShape(None, "", "NAME<｜tool▁sep｜>", _DS_CALL_END + "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                               "<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>", _DS_CALL_END),
    "deepseek_v3": _CallShape(None, "", "NAME\n```json\n", "\n```" + _DS_CALL_END + "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                              "<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n", "\n```" + _DS_CALL_END),
    # gpt-oss's harmony: the server's opening is the whole header up to `<|message|>`, the call ends
    # at a stop token (`<|call|>`, the model's EOS), so a named call's grammar is its arguments
    # alone; a required or auto call would need the grammar to write the special markers after
    # the name, which xgrammar does not (`_CHOICES`)
    "openai": _CallShape(None, "", "", "", "", "", ""),
    # Mistral's and Granite's JSON list of calls (Mistral's v3 / v7 templates; Granite always):
    # the server's opening holds the marker, the rest is plain text, so named and required calls
    # have grammars; an auto call's trigger, the marker, is a special token in their vocabularies,
    # which a grammar does not write: a token program (`_token_program`)
    "mistral_list": _CallShape(None, " ", ' QNAME, "arguments": ', "}]", "", "", ""),
    "granite": _CallShape(None, " ", ' QNAME, "arguments": ', "}]", "", "", ""),
    # Mistral's `[TOOL_CALLS]NAME[ARGS]{...}` (v11 on): a named call's opening ends at [ARGS] and
    # the call at its JSON value (then EOS); a required or auto call's name is followed by special
    # markers: a token program (`_token_program`)
    "mistral": _CallShape(None, "", "", "", "", "", ""),
}
# the tool_choice values each format's grammar covers (others: every one but none); gpt-oss's
# required and auto calls and Mistral v11's run as token programs
_CHOICES = {"openai": ("named", "required", "auto"), "mistral": ("named", "required", "auto"),
            "mistral_list": ("named", "required", "auto"), "granite": ("named", "required", "auto")}


def tool_call_structure(fmt: str, choice: str, name: str | None, tools: list[dict[str, Any]] | None,
                        tokenizer: Tokenizer | None, parallel: bool = True,
                        template: str | None = None) -> StructuredOutputsParams | None:
    """The structured output that makes a chat request's tool calls parse, in the format's shape
    (`_SHAPES`):
    - `named` / `required`: the server has already written the call's opening for the model
      (engine/server/chat.py `_forced_prefix`); the rest is the function's name (required: one
      of the tools), its arguments under the tool's JSON schema, and the call's end; then only
      EOS. One call per turn.
    - `auto`: free text, but once the model writes the format's trigger (`<tool_call>`, ...) the
      call follows the grammar (xgrammar's triggered tags); with `parallel` false (the request's
      parallel_tool_calls), the first call ends the output (only EOS may follow it).
    JSON arguments are written with one space at most between tokens; the XML formats'
    parameters follow the schema in xgrammar's styles (`qwen_xml` for qwen3_coder and seed_oss,
    `glm_xml`, `minimax_xml`: schema order, required keys present, each value of its type, string
    values raw text, one whitespace character admitted beside each value tag, which the parsers
    take as the separator).
    None when there is nothing to enforce: no tools, `none`, a format without a grammar here or
    without one for this choice (`_CHOICES`: gpt-oss's `openai` and Mistral's v11 layout, named
    calls only; Mistral's list layout (`template`) and Granite, named and required),
    xgrammar missing, a tokenizer it cannot serve, or one that marks the format's markers special
    (tool calls then work as they did before structured output: prefix forcing, no guarantee
    that the call parses)."""
    if fmt == "mistral" and not (template is not None and "[ARGS]" in template):
        fmt = "mistral_list"  # (the template's layout, as engine/server/chat.py `_forced_prefix` writes its opening)
    if not tools or choice == "none":
        return None
    # layouts with special tokens between a call's parts run as token programs (engine/token_calls.py)
    as_program = (fmt == "kimi_k2" or (fmt in ("mistral", "openai") and choice != "named")
                  or (fmt in ("mistral_list", "granite") and choice == "auto"))
    shape = _SHAPES.get(fmt)
    if not as_program and (shape is None or choice not in _CHOICES.get(fmt, (choice,))):
        return None
    try:
        xgrammar()
        check_tokenizer(tokenizer)
    except ValueError:
        return None
    if as_program:
        program = (_kimi_program(choice, name, tools, tokenizer, parallel) if fmt == "kimi_k2" else
                   _token_program(fmt, choice, tools, tokenizer, parallel, template))
        return None if program is None else StructuredOutputsParams(tool_calls=program.to_json())
    if tokenizer is not None and _special_markers(tokenizer, fmt):
        # xgrammar never emits a special token inside a grammar: the calls would be spelled in
        # pieces the model was not trained on, so they are left unconstrained (as without xgrammar)
        return None

    def args(t: dict[str, Any]) -> dict[str, Any]:
        if shape.style is None:
            # one space at most between JSON tokens (a code model otherwise writes indentation forever)
            return {"type": "json_schema", "json_schema": _tool_schema(t), "max_whitespace_cnt": 1}
        schema = t["function"].get("parameters") or {"type": "object"}
        return {"type": "json_schema", "json_schema": schema, "style": shape.style, "max_whitespace_cnt": 1}

    def text(template: str, t: dict[str, Any]) -> str:  # (one pass: a name may itself hold "NAME")
        n = t["function"]["name"]
        return re.sub("QNAME|NAME", lambda m: json.dumps(n) if m.group() == "QNAME" else n, template)

    def const(value: str) -> dict[str, Any]:
        return {"type": "const_string", "value": value}

    if choice == "named":
        [tool] = [t for t in tools if t["function"]["name"] == name]
        fmt_: dict[str, Any] = {"type": "sequence", "elements": [
            *([const(shape.named_lead)] if shape.named_lead else []), args(tool),
            *([const(shape.forced_end)] if shape.forced_end else [])]}
    elif choice == "required":
        alts = [{"type": "sequence", "elements": [const(text(shape.required_head, t)), args(t), const(shape.forced_end)]}
                for t in tools]
        fmt_ = alts[0] if len(alts) == 1 else {"type": "or", "elements": alts}
    else:
        fmt_ = {"type": "triggered_tags", "triggers": [shape.trigger], "tags": [
            {"type": "tag", "begin": text(shape.tag_begin, t), "content": args(t), "end": shape.tag_end} for t in tools],
            "stop_after_first": not parallel}
    return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": fmt_}))


def _tool_schema(t: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters as its call's JSON grammar takes them (an object where none is given)."""
    return schema_with_explicit_dots(t["function"].get("parameters") or {"type": "object"})


def _regex_literal(text: str) -> str:
    return re.sub(r"([\\.^$|?*+()\[\]{}/-])", r"\\\1", text)


def _token_program(fmt: str, choice: str, tools: list[dict[str, Any]], tokenizer: Tokenizer | None, parallel: bool,
                   template: str | None) -> CallProgram | None:
    """The calls of a layout whose markers are special tokens (engine/token_calls.py), after the
    server's opening (required) or from free text (auto); None where the vocabulary does not hold
    the markers as single tokens.
    - Mistral v11 / v13: `[TOOL_CALLS]` opens a call (the server writes it for required), then the
      name, `[CALL_ID]` and a 9-character id where the template writes ids, `[ARGS]`, the
      arguments, then EOS, or `[TOOL_CALLS]` and another call when calls may be parallel.
    - Mistral's list layout (v3 / v7) and Granite (auto): once the model writes its marker
      (`[TOOL_CALLS]`, `<|tool_call|>`), a space or not, then the JSON list of calls, each
      `{"name": NAME, "arguments": ...}` under its tool's schema (one call when calls may not be
      parallel), then EOS.
    - gpt-oss: after the server's `<|channel|>commentary to=functions.` (required) or once the
      model writes `<|channel|>` then `commentary to=functions.` (auto), the name and a space,
      `<|constrain|>`, `json`, `<|message|>`, the arguments, then `<|call|>` (its stop)."""
    if tokenizer is None:
        return None
    special = {m: tokenizer.tok.token_to_id(m) for m in ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|constrain|>", "<|message|>",
                                                         "<|call|>", "<|channel|>")}
    eos = tokenizer.eos_token_id

    if fmt in ("mistral_list", "granite"):
        marker = tokenizer.tok.token_to_id("[TOOL_CALLS]" if fmt == "mistral_list" else "<|tool_call|>")
        if marker is None or eos is None:
            return None
        items = [{"type": "object", "properties": {"name": {"enum": [t["function"]["name"]]}, "arguments": _tool_schema(t)},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        listed = {"type": "array", "items": {"anyOf": items}, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        return CallProgram([[{"json": listed, "lead": " ?"}]], [eos], [marker])
    if fmt == "mistral":
        if special["[TOOL_CALLS]"] is None or special["[ARGS]"] is None or eos is None:
            return None
        with_ids = template is not None and "[CALL_ID]" in template
        if with_ids and special["[CALL_ID]"] is None:
            return None
        calls = []
        for t in tools:
            segs: list[dict[str, Any]] = [{"regex": _regex_literal(t["function"]["name"])}]
            if with_ids:
                segs += [{"special": special["[CALL_ID]"]}, {"regex": "[A-Za-z0-9]{9}"}]
            calls.append(segs + [{"special": special["[ARGS]"]}, {"json": _tool_schema(t)}])
        opening = special["[TOOL_CALLS]"]
        again = [opening] if parallel else []
        return CallProgram(calls, [eos, *again], [opening], again, start_in_call=choice == "required")
    if None in (special["<|constrain|>"], special["<|message|>"], special["<|call|>"], special["<|channel|>"]):
        return None
    calls = [[{"regex": _regex_literal(t["function"]["name"] + " ")}, {"special": special["<|constrain|>"]}, {"regex": "json"},
              {"special": special["<|message|>"]}, {"json": _tool_schema(t)}] for t in tools]
    if choice == "required":
        return CallProgram(calls, [special["<|call|>"]], start_in_call=True)
    return CallProgram(calls, [special["<|call|>"]], open_texts=[[special["<|channel|>"], "commentary to=functions."]])


def _kimi_program(choice: str, name: str | None, tools: list[dict[str, Any]], tokenizer: Tokenizer | None,
                  parallel: bool) -> CallProgram | None:
    """Kimi-K2's calls (engine/token_calls.py): `<|tool_call_begin|>functions.NAME:IDX` (IDX its
    number in the conversation), `<|tool_call_argument_begin|>`, the arguments under the tool's
    schema, `<|tool_call_end|>`; then `<|tool_calls_section_end|>`, or with parallel calls another
    `<|tool_call_begin|>` and call. Named: the server wrote everything up to the arguments; required:
    up to `<|tool_call_begin|>`; auto: free until the model writes that token."""
    if tokenizer is None:
        return None
    ids = {m: tokenizer.tok.token_to_id(m) for m in ("<|tool_calls_section_end|>", "<|tool_call_begin|>",
                                                      "<|tool_call_argument_begin|>", "<|tool_call_end|>")}
    if None in ids.values():
        return None
    begin, arg, end = ids["<|tool_call_begin|>"], ids["<|tool_call_argument_begin|>"], ids["<|tool_call_end|>"]
    section_end = ids["<|tool_calls_section_end|>"]

    if choice == "named":
        [tool] = [t for t in tools if t["function"]["name"] == name]
        return CallProgram([[{"json": _tool_schema(tool)}]], [end], start_in_call=True, between=[section_end])
    calls = [[{"regex": _regex_literal(f"functions.{t['function']['name']}:") + "[0-9]{1,4}"}, {"special": arg}, {"json": _tool_schema(t)}]
             for t in tools]
    return CallProgram(calls, [end], [begin], start_in_call=choice == "required",
                       between=[section_end, *([begin] if parallel else [])])


_DS_MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", _DS_CALL_END, "<｜tool▁sep｜>")
# the format's markers that checkpoints hold as single tokens
_MARKERS = {"hermes": ("<tool_call>", "</tool_call>"), "qwen3_coder": ("<tool_call>", "</tool_call>"),
            "seed_oss": ("<seed:tool_call>", "</seed:tool_call>"),
            "glm45": ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
            "llama3_json": (),  # (bare JSON: nothing a vocabulary could hold special)
            "deepseek_v3": _DS_MARKERS, "deepseek_v31": _DS_MARKERS, "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>"),
            # (their markers are all in the server's opening or the stop tokens: these grammars write none)
            "openai": (), "mistral": (), "mistral_list": (), "granite": ()}


def _special_markers(tokenizer: Tokenizer, fmt: str) -> list[str]:
    """The format's markers the tokenizer marks special (GLM-4.5's may be)."""
    return [m for m in _MARKERS[fmt] if tokenizer.tok.token_to_id(m) in tokenizer.special_ids]

