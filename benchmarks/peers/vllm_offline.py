"""Offline throughput and batch-1 decode of vLLM (CPU build), run INSIDE .peers/vllm by throughput.py.

    .peers/vllm/bin/python benchmarks/peers/vllm_offline.py --model CKPT --prompts P.json --output-len 32

P.json: a JSON list of token-id prompts (all the same length). Greedy, ignore_eos, every request
`--output-len` tokens. Prints one JSON line on stdout, last:
{"engine": "vllm", "offline_tok_s": ..., "decode_tok_s": ..., ...}. Set VLLM_CPU_OMP_THREADS_BIND
(e.g. 0-1) and VLLM_CPU_KVCACHE_SPACE (GiB) in the environment; throughput.py does.
"""
from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON file: list of token-id lists")
    ap.add_argument("--output-len", type=int, required=True)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--enforce-eager", action="store_true", help="skip vLLM's torch.compile / graph capture")
    ap.add_argument("--skip-offline", action="store_true")
    args = ap.parse_args()
    with open(args.prompts) as f:
        reqs: list[list[int]] = json.load(f)

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    max_len = len(reqs[0]) + args.output_len + 16
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=max_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=max(args.max_num_batched_tokens, max_len), enable_prefix_caching=False,
              enforce_eager=args.enforce_eager, seed=0)
    load_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=r) for r in reqs]
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up

    offline = None
    if not args.skip_offline:
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        offline = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)

    # batch-1 decode: (one full request) - (the same request with 1 output token) = the decode steps
    one = prompts[:1]
    t = time.perf_counter()
    llm.generate(one, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    first = time.perf_counter() - t
    t = time.perf_counter()
    out = llm.generate(one, sp, use_tqdm=False)
    n = len(out[0].outputs[0].token_ids)
    decode = (n - 1) / (time.perf_counter() - t - first)
    print(json.dumps({"engine": "vllm", "version": vllm.__version__, "offline_tok_s": offline, "decode_tok_s": decode,
                      "output_tokens_b1": n, "load_s": load_s, "first_token_ids": out[0].outputs[0].token_ids[:8]}), flush=True)


if __name__ == "__main__":
    main()
