"""Batch-1 decode of llama.cpp (llama-cpp-python) on a bf16 GGUF, run INSIDE .peers/llamacpp.

    .peers/llamacpp/bin/python benchmarks/peers/llamacpp_offline.py --gguf M.gguf --prompts P.json --output-len 32

P.json: a JSON list of token-id prompts; the first one is used (llama-cpp-python has no offline
multi-sequence batch API, so offline throughput is not measured: "offline_tok_s": null). Greedy,
eos ignored (the generation loop is ours). Prints one JSON line on stdout, last:
{"engine": "llamacpp", "decode_tok_s": ..., ...}.
"""
from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompts", required=True, help="JSON file: list of token-id lists")
    ap.add_argument("--output-len", type=int, required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    with open(args.prompts) as f:
        prompt: list[int] = json.load(f)[0]

    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=len(prompt) + args.output_len + 16, n_batch=512,
                          n_threads=args.threads, n_threads_batch=args.threads, seed=0, verbose=False)
    load_s = time.perf_counter() - t0

    def run(n_out: int) -> tuple[list[int], float, float]:
        """Greedy tokens, time to the first token, time from the first token to the last."""
        toks: list[int] = []
        t = time.perf_counter()
        t_first = t
        for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            toks.append(tok)
            if len(toks) == 1:
                t_first = time.perf_counter()
            if len(toks) == n_out:
                break
        return toks, t_first - t, time.perf_counter() - t_first

    run(4)  # warm-up
    toks, ttft, dt = run(args.output_len)
    print(json.dumps({"engine": "llamacpp", "version": llama_cpp.__version__, "offline_tok_s": None,
                      "decode_tok_s": (len(toks) - 1) / dt, "ttft_s": ttft, "output_tokens_b1": len(toks),
                      "threads": args.threads, "load_s": load_s, "first_token_ids": toks[:8]}), flush=True)


if __name__ == "__main__":
    main()
