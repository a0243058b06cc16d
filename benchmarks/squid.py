"""Squid document caching vs no caching vs prefix caching, side by side in one run.

A "repository" of real Python standard-library files (300-1000 tokens each under the model's
tokenizer) and N requests, each taking a random subset of 8 files in a random order plus a short
query. For each mode the requests run one at a time (so time to first token is the prefill
latency, not queueing), after a warm-up pass that fills the caches:
  (a) none    the whole prompt is prefilled every time (prefix caching off);
  (b) prefix  prefix caching on: a hit only when the file order repeats from the start;
  (c) squid   every file a document (engine/squid.py): cached once, reused in any order.
Reported: median / p90 TTFT, prefill tokens computed per request, and for squid the ratio to (a).
Quality (on a model trained with the squid layout, `shared` positions): greedy agreement of
squid vs the same prompt with full causal attention over the concatenation. Decode: batch-1
tokens / s after the prompt, squid vs the flat prompt, caches warm (`--decode-tokens`).

    python benchmarks/squid.py                          # the embedded model, 64 requests
    python benchmarks/squid.py --model-preset qwen3-0.6b --requests 16
    python benchmarks/squid.py --json out.json --plot squid.png
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import sysconfig
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import PRESETS, machine_info, markdown_table, preset_checkpoint  # noqa: E402

MODES = ("none", "prefix", "squid")


def repository(tokenizer, n_files: int, lo: int, hi: int, seed: int) -> list[tuple[str, list[int]]]:
    """(name, token ids) of stdlib files whose length under this tokenizer is in [lo, hi]."""
    root = sysconfig.get_paths()["stdlib"]
    names = []
    for d, subdirs, fs in os.walk(root):
        subdirs[:] = sorted(x for x in subdirs if x not in ("test", "tests", "idle_test", "site-packages", "__pycache__"))
        names += [os.path.relpath(os.path.join(d, f), root) for f in sorted(fs) if f.endswith(".py")]
    random.Random(seed).shuffle(names)
    files = []
    for name in names:
        try:
            with open(os.path.join(root, name), encoding="utf-8") as f:
                ids = tokenizer.encode(f.read(), add_special_tokens=False)
        except (OSError, UnicodeDecodeError):
            continue
        if lo <= len(ids) <= hi:
            files.append((name, ids))
            if len(files) == n_files:
                break
    if len(files) < n_files:
        raise SystemExit(f"only {len(files)} stdlib files of {lo}-{hi} tokens under this tokenizer")
    return files


def workload(files, tokenizer, n_requests: int, per_request: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n_requests):
        pick = rng.sample(range(len(files)), per_request)
        query = tokenizer.encode(f"\n# task {i}: use the modules above\ndef ", add_special_tokens=False)
        reqs.append({"documents": [files[j][1] for j in pick], "prompt": query})
    return reqs


def flat(req: dict) -> list[int]:
    return [t for d in req["documents"] for t in d] + req["prompt"]


def run_mode(path: str, dtype: str, mode: str, reqs: list[dict], positions: str, kv_blocks: int) -> dict:
    from cuttle.engine import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, enable_prefix_caching=mode != "none", squid_positions=positions, num_kv_blocks=kv_blocks)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def prompt(r):
        return r if mode == "squid" else flat(r)

    # warm-up: every file computed once, on its own (the target is "with all files cached"), not the
    # measured requests themselves: warming with those would let prefix caching hit whole prompts
    # whenever the pool holds them all, i.e. measure repeated prompts. Nothing to warm without a cache.
    files = list({tuple(d): d for r in reqs for d in r["documents"]}.values())
    if mode == "prefix":
        llm.generate(files, params, use_tqdm=False)
    elif mode == "squid":
        llm.generate([{"documents": [d], "prompt": reqs[0]["prompt"]} for d in files], params, use_tqdm=False)
    before = llm.stats()["prefill_tokens_computed"]
    ttft = []
    for i, r in enumerate(reqs):
        engine.add_request(f"b{i}", prompt(r), params, stream=True)
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            if any(o.outputs[0].token_ids for o in engine.step()):
                ttft.append(time.perf_counter() - t0)
        if len(ttft) != i + 1:
            raise RuntimeError(f"request {i} produced no token")
    s = llm.stats()
    computed = (s["prefill_tokens_computed"] - before) / len(reqs)
    return {"mode": mode, "ttft_median_s": statistics.median(ttft), "ttft_p90_s": sorted(ttft)[int(0.9 * (len(ttft) - 1))],
            "prefill_tokens_per_request": computed, "prompt_tokens_per_request": statistics.mean(len(flat(r)) for r in reqs),
            "query_tokens_per_request": statistics.mean(len(r["prompt"]) for r in reqs),
            "documents_per_request": statistics.mean(len(r["documents"]) for r in reqs)}


def decode_rate(path: str, dtype: str, reqs: list[dict], positions: str, new_tokens: int) -> dict:
    """Batch-1 decode after the prompt, squid vs the flat prompt (prefix caching on), every
    request's documents or prompt already cached: per request, the time of `new_tokens` tokens
    less the time of one (the prefill and the first token), so tokens / s of decode steps alone;
    the median over the requests."""
    from cuttle.engine import LLM, SamplingParams

    out = {}
    for mode in ("prefix", "squid"):
        llm = LLM(path, dtype=dtype, squid_positions=positions)
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        many = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        rates = []
        for r in reqs:
            prompt = r if mode == "squid" else flat(r)
            llm.generate([prompt], one, use_tqdm=False)  # caches the documents (or the prompt)
            t0 = time.perf_counter()
            llm.generate([prompt], many, use_tqdm=False)
            t1 = time.perf_counter()
            llm.generate([prompt], one, use_tqdm=False)
            t2 = time.perf_counter()
            rates.append((new_tokens - 1) / ((t1 - t0) - (t2 - t1)))
        graphs = llm.engine.runner.graphs
        out[mode] = {"decode_tok_s": statistics.median(rates),
                     "graph_steps": graphs.counters["graph_steps"] if graphs is not None else 0}
    return out


def greedy_agreement(path: str, dtype: str, reqs: list[dict], positions: str, new_tokens: int) -> dict:
    """Squid vs full causal attention over the concatenation: the fraction of requests whose
    greedy tokens agree, and the mean length of the agreeing prefix."""
    from cuttle.engine import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, squid_positions=positions)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    a = llm.generate(reqs, params, use_tqdm=False)
    b = llm.generate([flat(r) for r in reqs], params, use_tqdm=False)
    same, prefix = 0, []
    for x, y in zip(a, b):
        tx, ty = x.outputs[0].token_ids, y.outputs[0].token_ids
        same += tx == ty
        k = next((i for i, (p, q) in enumerate(zip(tx, ty)) if p != q), len(tx))
        prefix.append(k)
    return {"identical": same / len(reqs), "mean_agreeing_prefix": statistics.mean(prefix), "new_tokens": new_tokens}


def plot(results: list[dict], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    names = [r["mode"] for r in results]
    a.bar(names, [r["ttft_median_s"] * 1e3 for r in results], color=["#999", "#6a9", "#36c"])
    a.set_ylabel("median TTFT (ms)")
    a.set_yscale("log")
    b.bar(names, [r["prefill_tokens_per_request"] for r in results], color=["#999", "#6a9", "#36c"])
    b.set_ylabel("prefill tokens computed / request")
    b.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: the embedded model, or --model-preset)")
    ap.add_argument("--model-preset", default=None, choices=sorted(PRESETS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--files", type=int, default=24, help="files in the repository (16-32)")
    ap.add_argument("--per-request", type=int, default=8, help="files per request")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=1000)
    ap.add_argument("--positions", default=None, choices=["shared", "concat"], help="default: the model's (else concat)")
    ap.add_argument("--agreement-tokens", type=int, default=32, help="greedy tokens compared, squid vs full causal (0: skip)")
    ap.add_argument("--decode-tokens", type=int, default=64, help="batch-1 decode rate over 4 requests, squid vs flat (0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="write a PNG here")
    args = ap.parse_args()
    if args.model is None and args.model_preset is not None:
        args.model = preset_checkpoint(args.model_preset)
    if args.model is None:
        from cuttle.engine.default_model import default_model_path

        args.model = default_model_path()
    from cuttle.engine.config import ModelConfig
    from cuttle.engine.tokenizer import Tokenizer

    mc = ModelConfig.from_pretrained(args.model)
    positions = args.positions or mc.hf_config.get("squid_positions") or "concat"
    # the flat prompt of modes (a) and (b) must fit the model: 8 files of up to max-tokens each + the query
    fit = (mc.max_position_embeddings - 64) // args.per_request
    if args.max_tokens > fit:
        print(f"files capped at {fit} tokens so {args.per_request} of them fit max_position_embeddings {mc.max_position_embeddings}")
        args.max_tokens = fit
    tok = Tokenizer(args.model)
    files = repository(tok, args.files, args.min_tokens, args.max_tokens, args.seed)
    reqs = workload(files, tok, args.requests, args.per_request, args.seed)
    # room for every file once plus the largest request, so nothing is evicted between passes
    need = sum(len(f[1]) for f in files) + max(len(flat(r)) for r in reqs) * 2
    kv_blocks = (need // 16 + 64) * 2
    print(f"model {args.model} ({args.dtype}), {len(files)} files ({sum(len(f[1]) for f in files)} tokens), "
          f"{len(reqs)} requests x {args.per_request} files, positions {positions}", flush=True)
    results = []
    for mode in MODES:
        r = run_mode(args.model, args.dtype, mode, reqs, positions, kv_blocks)
        print(f"{mode}: median TTFT {r['ttft_median_s'] * 1e3:.1f} ms, prefill {r['prefill_tokens_per_request']:.0f} tok/request", flush=True)
        results.append(r)
    base = results[0]
    rows = [[r["mode"], round(r["ttft_median_s"] * 1e3, 1), round(r["ttft_p90_s"] * 1e3, 1),
             round(base["ttft_median_s"] / r["ttft_median_s"], 1), round(r["prefill_tokens_per_request"], 1),
             round(r["prompt_tokens_per_request"], 1)] for r in results]
    print(markdown_table(["mode", "TTFT p50 (ms)", "TTFT p90 (ms)", "speed-up vs none", "prefill tok / req", "prompt tok / req"], rows))
    sq = results[-1]
    bound = sq["query_tokens_per_request"] + 16 * sq["documents_per_request"]
    print(f"squid: {base['ttft_median_s'] / sq['ttft_median_s']:.1f}x median TTFT vs none (target >= 10x); "
          f"prefill {sq['prefill_tokens_per_request']:.1f} tok/request vs the bound query + one block per document = {bound:.1f}")
    decode = None
    if args.decode_tokens:
        decode = decode_rate(args.model, args.dtype, reqs[:4], positions, args.decode_tokens)
        print(f"batch-1 decode ({args.decode_tokens} tokens, median of 4 requests): squid "
              f"{decode['squid']['decode_tok_s']:.0f} tok/s, flat prompt {decode['prefix']['decode_tok_s']:.0f} tok/s "
              f"(graph steps {decode['squid']['graph_steps']} / {decode['prefix']['graph_steps']})")
    agreement = None
    if args.agreement_tokens:
        agreement = greedy_agreement(args.model, args.dtype, reqs[:16], positions, args.agreement_tokens)
        print(f"greedy agreement squid vs full causal ({agreement['new_tokens']} tokens, 16 requests): "
              f"{agreement['identical']:.0%} identical, mean agreeing prefix {agreement['mean_agreeing_prefix']:.1f} tokens")
    if args.plot:
        plot(results, args.plot, f"squid on {os.path.basename(os.path.normpath(args.model))}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "model": args.model, "dtype": args.dtype, "positions": positions,
                       "files": [f[0] for f in files], "results": results, "agreement": agreement, "decode": decode}, f, indent=2)


if __name__ == "__main__":
    main()
