"""Rollout benchmark: GRPO groups sampled as one request with n = G (prompt prefilled once, samples
forked copy-on-write) against the same G samples as G independent requests.

    python benchmarks/rollout.py                    # the embedded default model, G = 4, 8, 16
    python benchmarks/rollout.py --model PATH --prompts 8 --prompt-len 256 --max-tokens 32

Reports samples/s and generated tokens/s for both ways, the prefill tokens each computed, and the
prefill tokens saved by group sharing (the peer measured in the same run is the independent-request
way: what a framework that repeats each prompt G times does). Independent requests run without
the prefix cache: submitted together, they are all admitted before any of their blocks is
computed, so the cache could not serve them anyway (`--independent-cache` shows that).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, make_random_checkpoint, markdown_table  # noqa: E402


def model_path(arg: str | None) -> str:
    if arg is not None:
        return arg
    from cuttle.engine.default_model import DEFAULT_MODEL_DIR

    if os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, "config.json")):
        return DEFAULT_MODEL_DIR
    from cuttle.engine.train_default_model import MODEL_CONFIG

    print("embedded default model not built yet: using a random checkpoint of its shape", file=sys.stderr)
    return make_random_checkpoint("/tmp/cuttle-bench-default-shape", {**MODEL_CONFIG, "vocab_size": 8192, "eos_token_id": 0})


def run(path: str, dtype: str, prompts: list[list[int]], g: int, max_tokens: int, shared: bool, cache: bool) -> dict[str, float]:
    from cuttle.engine import LLM, SamplingParams
    from cuttle.rl import sample_groups

    llm = LLM(path, dtype=dtype, enable_prefix_caching=cache, max_num_seqs=len(prompts) * g,
              max_model_len=len(prompts[0]) + max_tokens + 16, max_num_batched_tokens=4096)
    sp = SamplingParams(temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    before = llm.stats()
    t = time.perf_counter()
    if shared:
        groups = sample_groups(llm, prompts, g, sp)
        n_samples = sum(len(gr.samples) for gr in groups)
        n_tokens = sum(len(s.token_ids) for gr in groups for s in gr.samples)
    else:
        reqs = [p for p in prompts for _ in range(g)]
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True, logprobs=0) for i in range(len(reqs))]
        outs = llm.generate(reqs, params, use_tqdm=False)
        n_samples = len(outs)
        n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    dt = time.perf_counter() - t
    after = llm.stats()
    return {"seconds": dt, "samples_per_s": n_samples / dt, "tokens_per_s": n_tokens / dt,
            "prefill": after["prefill_tokens_computed"] - before["prefill_tokens_computed"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--groups", type=int, nargs="+", default=[4, 8, 16], help="group sizes G")
    ap.add_argument("--prompts", type=int, default=8, help="prompts (groups) per batch")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--independent-cache", action="store_true", help="also run independent requests with the prefix cache on")
    args = ap.parse_args()

    path = model_path(args.model)
    from cuttle.engine.config import ModelConfig

    vocab = ModelConfig.from_pretrained(path).vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab - 10, (args.prompts, args.prompt_len), generator=gen).tolist()
    print(f"model {path} ({args.dtype}); {args.prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} new tokens each")
    print(machine_info())
    run(path, args.dtype, prompts[:2], 2, 4, shared=True, cache=True)  # one-time costs (lazy init, allocator)
    rows = []
    for g in args.groups:
        sh = run(path, args.dtype, prompts, g, args.max_tokens, shared=True, cache=True)
        ind = run(path, args.dtype, prompts, g, args.max_tokens, shared=False, cache=False)
        row = [g, sh["samples_per_s"], sh["tokens_per_s"], ind["samples_per_s"], ind["tokens_per_s"],
               sh["tokens_per_s"] / ind["tokens_per_s"], sh["prefill"], ind["prefill"], ind["prefill"] - sh["prefill"],
               1 - sh["prefill"] / ind["prefill"]]
        if args.independent_cache:
            row.append(run(path, args.dtype, prompts, g, args.max_tokens, shared=False, cache=True)["prefill"])
        rows.append(row)
    headers = ["G", "shared samples/s", "shared tok/s", "indep. samples/s", "indep. tok/s", "speed-up",
               "shared prefill tok", "indep. prefill tok", "prefill saved", "saved fraction"]
    if args.independent_cache:
        headers.append("indep.+prefix-cache prefill tok")
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
