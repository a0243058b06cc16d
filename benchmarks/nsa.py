"""Decode attention per step, dense (today's native paged kernel) vs NSA (the native NSA decode
kernel), at the Qwen3-0.6B attention shape (16 query heads, 8 KV heads, head_dim 128, bf16), one
layer, contexts 8k-64k, batch 1 and 8. Reports KV bytes read (dense: every key and value; NSA: the
tokens its kernel says it read, compressed entries included), time per step, and the time the bytes
alone would take at the copy bandwidth measured in the same run; prints a markdown table and can
write a PNG plot. NSA uses the paper's defaults (l=32, d=16, l'=64, n=16, w=512).

    .venv/bin/python benchmarks/nsa.py [--contexts 8192,16384,32768,65536] [--batches 1,8] [--plot out.png]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbs, machine_info, markdown_table  # noqa: E402

from cuttle.attention import native_attention  # noqa: E402
from cuttle.attention.native import nsa as native_nsa  # noqa: E402
from cuttle.attention.nsa import NSAConfig  # noqa: E402
from cuttle.attention.nsa_backend import compressed_slots_per_block  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 64


def _time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run(context: int, batch: int, cfg: NSAConfig, repeats: int) -> dict:
    nb = context // BLOCK
    g = torch.Generator().manual_seed(0)
    shape = (batch * nb, BLOCK, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
    v = torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
    slots = compressed_slots_per_block(cfg, BLOCK)
    ck = torch.randn(batch * nb, slots, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    cv = torch.randn(batch * nb, slots, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    gates = torch.rand(batch, HEADS, 3, generator=g)
    tables = torch.randperm(batch * nb, generator=g).to(torch.int32).view(batch, nb).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int32)
    rows = torch.arange(batch)
    out = torch.empty_like(q)
    lse = torch.empty(batch, HEADS)
    scale = HEAD_DIM**-0.5

    def dense():
        native_attention.paged_attention_rows(q, k, v, out, lse, rows, rows, tables, lens, context, scale)

    touched = torch.zeros(batch, KV_HEADS, dtype=torch.int64)

    def nsa():
        native_nsa.nsa_decode(q, k, v, ck, cv, gates, out, rows, tables, lens, cfg, scale, touched=touched)

    t_dense, t_nsa = _time(dense, repeats), _time(nsa, repeats)
    per_token = 2 * KV_HEADS * HEAD_DIM * 2  # K and V, bf16
    return dict(context=context, batch=batch, dense_bytes=batch * context * per_token,
                nsa_bytes=int(touched[:, 0].sum()) * per_token, nsa_tokens=int(touched[0, 0]), t_dense=t_dense, t_nsa=t_nsa)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="8192,16384,32768,65536")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    if not native_nsa.available():
        raise SystemExit("the native kernel library did not build here")
    cfg = NSAConfig()
    bw = copy_bandwidth_gbs()
    results = [run(c, b, cfg, args.repeats) for b in map(int, args.batches.split(",")) for c in map(int, args.contexts.split(","))]
    info = machine_info()
    print(f"machine: {info}\ncopy bandwidth: {bw:.1f} GB/s (read + write of one copy)\n")
    rows = []
    for r in results:
        rows.append([
            r["context"], r["batch"], r["nsa_tokens"], f"{r['dense_bytes'] / 2**20:.1f}", f"{r['nsa_bytes'] / 2**20:.2f}",
            f"{r['dense_bytes'] / r['nsa_bytes']:.1f}x", f"{r['t_dense'] * 1e3:.2f}", f"{r['t_nsa'] * 1e3:.3f}",
            f"{r['t_dense'] / r['t_nsa']:.1f}x", f"{r['dense_bytes'] / (bw * 1e9) * 1e3:.2f}",
            f"{r['nsa_bytes'] / (bw * 1e9) * 1e3:.3f}",
        ])
    print(markdown_table(
        ["context", "batch", "NSA tokens/row", "dense MiB", "NSA MiB", "bytes ratio", "dense ms", "NSA ms", "speedup",
         "dense ms @copy bw", "NSA ms @copy bw"], rows))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for b in sorted({r["batch"] for r in results}):
            rs = [r for r in results if r["batch"] == b]
            xs = [r["context"] // 1024 for r in rs]
            ax.plot(xs, [r["t_dense"] * 1e3 for r in rs], "o-", label=f"dense, batch {b}")
            ax.plot(xs, [r["t_nsa"] * 1e3 for r in rs], "s-", label=f"NSA, batch {b}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (k tokens)")
        ax.set_ylabel("decode attention per step, one layer (ms)")
        ax.set_title("Qwen3-0.6B attention shape, bf16, CPU native kernels")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
