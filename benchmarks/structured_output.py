"""Structured output's cost on this machine (issue 19).

1. `--libs`: the per-token cost of the two kept libraries' token masks, xgrammar vs llguidance,
   on one JSON schema with the embedded model's tokenizer (vocab 8196) and the Qwen2/Qwen3
   tokenizer (151,936 logits): each library walks the tokens of the same JSON document, filling
   the mask before every token. Also the sampler's mask application (engine/sampler.py
   `apply_token_mask`) at batch 1 and 16.
2. `--engine`: whole decode runs at batch 1 and 16, free vs under a JSON schema that cannot end
   within max_tokens (an array of at least 100 objects, so both runs generate exactly the same
   number of tokens): the per-token overhead of structured output as a share of decode time,
   on the embedded model and the Qwen3-0.6B shape (random weights, --dtype float32).
3. `--fill`: xgrammar's fill per row as the engine's mask stage meets it, synchronously: 16
   matchers on the engine's compiled grammar for the `--engine` schema, each walking random
   allowed tokens (as temperature-1 sampling under the mask does), filled one by one and through
   xgrammar's batch fill; the cost one constrained row adds to a step in CPU time.

Prints markdown tables (ratios are taken within one run; the machine is shared: record `uptime`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}, "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                "required": ["street", "city", "zip"]},
    "active": {"type": "boolean"}}, "required": ["name", "age", "email", "tags", "address", "active"], "additionalProperties": False}
DOC = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "poetry", "engines"],
       "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"}, "active": True}


def _tokenizers() -> list[tuple[str, str, int]]:
    from common import _write_qwen_tokenizer

    from cuttle.engine.default_model import default_model_path

    qwen = os.path.join(os.path.expanduser("~/.cache/cuttle-bench"), "qwen2-tokenizer")
    if not os.path.isfile(os.path.join(qwen, "tokenizer.json")):
        os.makedirs(qwen, exist_ok=True)
        _write_qwen_tokenizer(qwen, 151645)
    return [("embedded (8,196)", default_model_path(), 8196), ("Qwen3 (151,936)", qwen, 151936)]


def bench_libs(reps: int) -> None:
    from cuttle.engine.sampling_params import SamplingParams, StructuredOutputsParams
    from cuttle.engine.sampler import apply_token_mask
    from cuttle.engine.structured_output import StructuredOutput, TokenMask
    from cuttle.engine.tokenizer import Tokenizer

    text = json.dumps(DOC, separators=(", ", ": "))
    print("| tokenizer | library | setup (s) | compile (ms) | mask fill, mean (us/token) | median | p90 |")
    print("|---|---|---:|---:|---:|---:|---:|")
    applies = []
    for label, path, vocab in _tokenizers():
        tok = Tokenizer(path)
        eos = tok.eos_token_id if tok.eos_token_id is not None else 0
        ids = tok.encode(text, add_special_tokens=False)
        # xgrammar through cuttle's own mask stage (its vocabulary reading, its matcher)
        t0 = time.perf_counter()
        so = StructuredOutput(tok, vocab, {eos})
        spec = StructuredOutputsParams(json=SCHEMA)
        ctl = so.prepare(SamplingParams(structured_outputs=spec))
        t1 = time.perf_counter()  # vocabulary read + first compile
        so._compiled.clear()
        ctl = so.prepare(SamplingParams(structured_outputs=spec))
        t2 = time.perf_counter()
        import xgrammar as xgr

        bitmask = torch.full((1, so.width), -1, dtype=torch.int32)
        fills = []
        for _ in range(reps):
            m = xgr.GrammarMatcher(ctl.grammar, max_rollback_tokens=0)
            for t in ids + [eos]:
                a = time.perf_counter()
                m.fill_next_token_bitmask(bitmask, 0)
                fills.append(time.perf_counter() - a)
                assert m.accept_token(t), (t, tok.token_text(t))
        _row(label, "xgrammar 0.2.8", t1 - t0 - (t2 - t1), t2 - t1, fills)
        try:
            import llguidance as llg
            import llguidance.torch as llt
        except ImportError:
            print(f"| {label} | llguidance | not installed | | | | |")
        else:
            t0 = time.perf_counter()
            lt = llg.LLTokenizer(tok.tok.to_str(), n_vocab=vocab, eos_token=eos)
            t1 = time.perf_counter()
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
            llg.LLMatcher(lt, grammar)
            t2 = time.perf_counter()
            bm = llt.allocate_token_bitmask(1, vocab)
            fills = []
            for _ in range(reps):
                m = llg.LLMatcher(lt, grammar)
                for t in ids + [eos]:
                    a = time.perf_counter()
                    llt.fill_next_token_bitmask(m, bm, 0)
                    fills.append(time.perf_counter() - a)
                    assert m.consume_token(t), m.get_error()
            _row(label, f"llguidance {llg.get_version() if hasattr(llg, 'get_version') else ''}".strip(), t1 - t0, t2 - t1, fills)
        for batch in (1, 16):
            logits = torch.randn(batch, vocab)
            mask = TokenMask(list(range(batch)), torch.randint(-2**31, 2**31 - 1, (batch, so.width), dtype=torch.int32))
            times = []
            for _ in range(20):
                x = logits.clone()
                a = time.perf_counter()
                apply_token_mask(x, mask)
                times.append(time.perf_counter() - a)
            applies.append((label, batch, statistics.median(times) * 1e3))
    print()
    print("| tokenizer | batch | sampler apply_token_mask (ms/step, median) |")
    print("|---|---:|---:|")
    for label, batch, ms in applies:
        print(f"| {label} | {batch} | {ms:.3f} |")


def _row(label: str, lib: str, setup: float, compile_s: float, fills: list[float]) -> None:
    fills = sorted(fills)
    print(f"| {label} | {lib} | {setup:.2f} | {compile_s * 1e3:.1f} | {1e6 * statistics.mean(fills):.1f} | "
          f"{1e6 * fills[len(fills) // 2]:.1f} | {1e6 * fills[int(len(fills) * 0.9)]:.1f} |")


def bench_engine(models: list[str], batches: list[int], tokens: int, reps: int, threads: int | None) -> None:
    from common import preset_checkpoint

    from cuttle.engine import LLM, SamplingParams
    from cuttle.engine.default_model import default_model_path
    from cuttle.engine.sampling_params import StructuredOutputsParams

    endless = StructuredOutputsParams(json={"type": "array", "items": SCHEMA, "minItems": 100})
    print("| model | batch | tokens/row | free (ms/step) | structured (ms/step) | overhead |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in models:
        path = default_model_path() if name == "embedded" else preset_checkpoint(name)
        kw = {"num_threads": threads} if threads else {}
        llm = LLM(path, dtype="float32", num_kv_blocks=max(64, max(batches) * ((tokens + 64) // 16 + 2)), max_num_seqs=max(batches), **kw)
        prompt = [5, 6, 7, 8]
        for batch in batches:
            free = SamplingParams(temperature=1.0, seed=1, max_tokens=tokens, ignore_eos=True)
            cons = SamplingParams(temperature=1.0, seed=1, max_tokens=tokens, structured_outputs=endless)
            llm.generate([prompt] * batch, [cons] * batch, use_tqdm=False)  # warm-up: compile, caches
            ratios, tf, tc = [], [], []
            for _ in range(reps):  # alternate, so drift in the machine's load hits both alike
                a = _timed(llm, prompt, batch, free, tokens)
                b = _timed(llm, prompt, batch, cons, tokens)
                tf.append(a)
                tc.append(b)
                ratios.append(b / a - 1)
            print(f"| {name} | {batch} | {tokens} | {1e3 * statistics.median(tf):.1f} | {1e3 * statistics.median(tc):.1f} | "
                  f"{100 * statistics.median(ratios):+.1f}% |", flush=True)


def bench_fill(rows: int = 16, steps: int = 48) -> None:
    import random

    import numpy as np
    import xgrammar as xgr

    from cuttle.engine.default_model import default_model_path
    from cuttle.engine.sampling_params import StructuredOutputsParams
    from cuttle.engine.structured_output import StructuredOutput
    from cuttle.engine.tokenizer import Tokenizer

    tok = Tokenizer(default_model_path())
    so = StructuredOutput(tok, tok.vocab_size, {tok.eos_token_id} if tok.eos_token_id is not None else set())
    grammar = so.compile(StructuredOutputsParams(json={"type": "array", "items": SCHEMA, "minItems": 100}))
    rng = random.Random(0)
    matchers = [xgr.GrammarMatcher(grammar, max_rollback_tokens=0) for _ in range(rows)]
    bitmask = torch.full((rows, so.width), -1, dtype=torch.int32)
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    one = both = accept = 0.0
    for _ in range(steps):
        t = time.perf_counter()
        for k, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, k)
        one += time.perf_counter() - t
        t = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, bitmask)
        both += time.perf_counter() - t
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, : tok.vocab_size]
        picks = [int(rng.choice(np.flatnonzero(bits[k]))) for k in range(rows)]
        t = time.perf_counter()
        for m, p in zip(matchers, picks):
            assert m.accept_token(p)
        accept += time.perf_counter() - t
    n = rows * steps
    print(f"xgrammar, embedded tokenizer ({tok.vocab_size}), {rows} rows x {steps} steps: fill {1e6 * one / n:.1f} us/row, "
          f"batch fill {1e6 * both / n:.1f} us/row, accept {1e6 * accept / n:.1f} us/row")


def _timed(llm, prompt: list[int], batch: int, params, tokens: int) -> float:
    """Seconds per generated token of each row (a 4-token prompt's prefill included, in both runs alike)."""
    t0 = time.perf_counter()
    outs = llm.generate([prompt] * batch, [params] * batch, use_tqdm=False)
    t1 = time.perf_counter()
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs), [len(o.outputs[0].token_ids) for o in outs]
    return (t1 - t0) / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--libs", action="store_true", help="library mask cost (xgrammar vs llguidance) and the sampler's apply")
    ap.add_argument("--engine", action="store_true", help="decode overhead, free vs structured")
    ap.add_argument("--fill", action="store_true", help="xgrammar's fill per row on the engine's schema, synchronously")
    ap.add_argument("--models", default="embedded,qwen3-0.6b")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    print(f"uptime: {open('/proc/loadavg').read().split()[:3]}")
    everything = not (args.libs or args.engine or args.fill)
    if args.libs or everything:
        bench_libs(args.reps)
    if args.fill or everything:
        bench_fill()
    if args.engine or everything:
        bench_engine(args.models.split(","), [int(b) for b in args.batches.split(",")], args.tokens, args.reps, args.threads)
    print(f"uptime: {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
