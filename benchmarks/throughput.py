"""Offline throughput and batch-1 decode: cuttle vs transformers `generate` on the same weights.

    python benchmarks/throughput.py                 # Qwen3-0.6B-shaped random checkpoint, bf16
    python benchmarks/throughput.py --quick         # fewer requests/tokens, for a smoke run

Reports output tokens/s, the ratio to transformers, and batch-1 decode as a fraction of the
memory-bandwidth limit (weight bytes per token / copy bandwidth measured in this run), plus the
offline figure as a fraction of the bf16 matmul FLOP limit measured in this run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import QWEN3_0_6B, copy_bandwidth_gbs, machine_info, make_random_checkpoint, markdown_table, matmul_gflops  # noqa: E402


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def bench_cuttle(path: str, dtype: str, reqs: list[list[int]], out_len: int, max_num_seqs: int) -> tuple[float, float]:
    """Returns (offline output tok/s, batch-1 decode tok/s)."""
    from cuttle.engine import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, max_model_len=len(reqs[0]) + out_len + 16, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=2048, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate(reqs[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(reqs, sp, use_tqdm=False)
    offline = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
    engine = llm.engine
    engine.add_request("b1", reqs[0], sp)
    engine.step()  # prefill + first token
    t = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    decode = steps / (time.perf_counter() - t)
    return offline, decode


def bench_transformers(path: str, dtype: torch.dtype, reqs: list[list[int]], out_len: int, batch: int) -> tuple[float, float]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=out_len, max_new_tokens=out_len)
    with torch.inference_mode():
        model.generate(torch.tensor(reqs[:1]), **{**kw, "min_new_tokens": 2, "max_new_tokens": 2})
        t = time.perf_counter()
        total = 0
        for i in range(0, len(reqs), batch):
            out = model.generate(torch.tensor(reqs[i : i + batch]), **kw)
            total += (out.shape[1] - len(reqs[0])) * out.shape[0]
        offline = total / (time.perf_counter() - t)
        x = torch.tensor(reqs[:1])
        t0 = time.perf_counter()
        model.generate(x, **{**kw, "min_new_tokens": 1, "max_new_tokens": 1})
        first = time.perf_counter() - t0
        t = time.perf_counter()
        model.generate(x, **kw)
        decode = (out_len - 1) / (time.perf_counter() - t - first)
    return offline, decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: a Qwen3-0.6B-shaped random one)")
    ap.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/cuttle-bench"))
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--quick", action="store_true", help="16 requests x 32 tokens")
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.output_len = 16, 32
    path = args.model or make_random_checkpoint(os.path.join(args.cache_dir, "qwen3-0.6b-random"), QWEN3_0_6B)
    tdtype = getattr(torch, args.dtype)

    info = machine_info()
    bw = copy_bandwidth_gbs()
    flops = matmul_gflops(tdtype)
    from cuttle.engine.config import ModelConfig

    mc = ModelConfig.from_pretrained(path)
    from cuttle.engine.models import load_model

    n_params = sum(p.numel() for p in load_model(path, mc, tdtype, torch.device("cpu")).parameters())
    weight_bytes = n_params * tdtype.itemsize
    flop_per_token = 2 * (n_params - mc.vocab_size * mc.hidden_size)  # non-embedding matmuls
    bw_limit = bw * 1e9 / weight_bytes

    reqs = prompts(args.num_requests, args.prompt_len, mc.vocab_size)
    print(f"limits: copy {bw:.1f} GB/s, {args.dtype} matmul {flops:.0f} GFLOP/s", flush=True)
    c_off, c_dec = bench_cuttle(path, args.dtype, reqs, args.output_len, args.max_num_seqs)
    print(f"cuttle: offline {c_off:.1f} out tok/s, batch-1 decode {c_dec:.2f} tok/s", flush=True)
    rows = []
    if args.skip_transformers:
        t_off = t_dec = float("nan")
    else:
        t_off, t_dec = bench_transformers(path, tdtype, reqs, args.output_len, args.hf_batch)
        print(f"transformers: offline {t_off:.1f} out tok/s, batch-1 decode {t_dec:.2f} tok/s", flush=True)
    # every output token costs its decode matmuls + lm_head; every prompt token its prefill matmuls
    lm_head = 2 * mc.vocab_size * mc.hidden_size
    flop_limit = flops * 1e9 / ((flop_per_token + lm_head) + flop_per_token * args.prompt_len / args.output_len)
    rows.append(["cuttle", f"{args.max_num_seqs}", c_off, c_off / t_off, c_off / flop_limit, c_dec, c_dec / t_dec, c_dec / bw_limit])
    rows.append(["transformers", f"{args.hf_batch}", t_off, 1.0, t_off / flop_limit, t_dec, 1.0, t_dec / bw_limit])
    print(f"\nmachine: {info}")
    print(f"model: {path} ({n_params / 1e6:.0f}M params, {args.dtype}); {args.num_requests} requests x ({args.prompt_len} prompt, {args.output_len} output)")
    print(f"measured limits: copy {bw:.1f} GB/s -> batch-1 bound {bw_limit:.1f} tok/s; {args.dtype} matmul {flops:.0f} GFLOP/s -> offline bound {flop_limit:.0f} output tok/s\n")
    print(markdown_table(
        ["engine", "batch", "offline out tok/s", "vs transformers", "of FLOP limit", "batch-1 decode tok/s", "vs transformers", "of bandwidth limit"],
        rows,
    ))


if __name__ == "__main__":
    main()
