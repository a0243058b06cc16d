"""The LoRA delta's native CPU kernel (attention/native/lora_delta.py) against the torch fp32 path
it replaced (`y.add_(F.linear(F.linear(x.float(), A), sB))`), at the rows of a decode batch and of
a prefill, on one projection's shape (default: the Qwen3-0.6B q|k|v projection, hidden 1024, out
4096, rank 16 for each of q, k, v: R = 48), bf16 activations. Medians of `--repeats` timings; the
copy bandwidth is measured in the same run (at one row the adapter's bytes are what a call reads).

    python benchmarks/lora_kernel.py [--rows 1,4,16,64,256,2048] [--k 1024] [--n 4096] [--r 48]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from cuttle.attention.native import kernels
from cuttle.attention.native.lora_delta import add_rows

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbs, markdown_table  # noqa: E402


def timed(fn, repeats: int) -> float:
    fn()
    calls = max(1, int(0.02 / max(_once(fn), 1e-6)))  # ~20 ms a timing
    return statistics.median(_once(fn, calls) for _ in range(repeats))


def _once(fn, calls: int = 1) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16,64,256,2048")
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--r", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if kernels().lib is None:
        raise SystemExit("the native CPU kernel library is not built here")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(args.r, args.k, generator=g), torch.randn(args.n, args.r, generator=g)
    at, bt = a.t().contiguous(), b.t().contiguous()
    gbs = copy_bandwidth_gbs()
    rows = []
    for m in (int(x) for x in args.rows.split(",")):
        x = torch.randn(m, args.k, generator=g).bfloat16()
        y = torch.randn(m, args.n, generator=g).bfloat16()
        native = timed(lambda: add_rows(y, x, at, bt), args.repeats)
        torch_path = timed(lambda: y.add_(F.linear(F.linear(x.float(), a), b)), args.repeats)
        rows.append([m, f"{native * 1e6:.0f}", f"{torch_path * 1e6:.0f}", f"{torch_path / native:.2f}"])
    print(f"K {args.k}, N {args.n}, R {args.r}, bf16 activations, {torch.get_num_threads()} threads; copy bandwidth "
          f"{gbs:.1f} GB/s (the adapter's {4 * args.r * (args.k + args.n) / 2**20:.2f} MiB read in "
          f"{4 * args.r * (args.k + args.n) / gbs / 1e3:.0f} us at that rate)\n")
    print(markdown_table(["rows", "native us", "torch fp32 us", "torch / native"], rows))


if __name__ == "__main__":
    main()
