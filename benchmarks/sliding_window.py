"""Decode attention per step under a sliding window: one layer at the Qwen3-0.6B attention shape
(16 query heads, 8 KV heads, head_dim 128, bf16), contexts 8k-32k, batch 1 and 8, through the
torch backend's decode path (`TorchAttentionBackend`, the native paged kernel): every key (no
window) against a window of W keys (`set_windows`: the rows start at their window's block, the
keys of that block before it skipped). Reports the time per step, the KV bytes each reads, and the
time those bytes alone would take at the copy bandwidth measured in the same run; a windowed step
should cost about what W keys cost, whatever the context.

    .venv/bin/python benchmarks/sliding_window.py [--window 4096] [--contexts 8192,16384,32768] [--batches 1,8]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import best_seconds, copy_bandwidth_gbs, machine_info, markdown_table  # noqa: E402

from cuttle.attention import native_attention  # noqa: E402
from cuttle.attention.metadata import AttentionMetadata  # noqa: E402
from cuttle.attention.torch_backend import TorchAttentionBackend  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16


def run(context: int, batch: int, window: int, repeats: int) -> dict:
    """One decode step of `batch` sequences of `context` keys, without and with the window."""
    nb = -(-context // BLOCK)
    g = torch.Generator().manual_seed(0)
    shape = (batch * nb + 1, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=g).to(torch.bfloat16)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    k = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    v = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    tables = torch.randperm(batch * nb, generator=g).to(torch.int32).view(batch, nb).contiguous()
    lens = [context] * batch
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables, slot_mapping=(tables[:, (context - 1) // BLOCK].long() * BLOCK + (context - 1) % BLOCK),
        block_size=BLOCK, max_query_len=1, max_seq_len=context, query_lens_cpu=[1] * batch, seq_lens_cpu=lens)
    scale = HEAD_DIM**-0.5
    full, windowed = TorchAttentionBackend(), TorchAttentionBackend()
    windowed.set_windows({0: window})

    def step(backend: TorchAttentionBackend):
        def go():
            backend.begin_step(meta)  # a new step's plan, as the engine makes one per step
            backend.forward(0, q, k, v, k_cache, v_cache, meta, scale)
        return go

    per_token = 2 * KV_HEADS * HEAD_DIM * 2  # K and V, bf16
    return dict(context=context, batch=batch, full_bytes=batch * context * per_token,
                window_bytes=batch * min(context, window) * per_token,
                t_full=best_seconds(step(full), repeats), t_window=best_seconds(step(windowed), repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--contexts", default="8192,16384,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if not native_attention.available():
        raise SystemExit("the native kernel library did not build here")
    info = machine_info()
    bw = copy_bandwidth_gbs()
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            r = run(context, batch, args.window, args.repeats)
            rows.append([context, batch, f"{r['t_full'] * 1e3:.2f}", f"{r['full_bytes'] / bw / 1e6:.2f}",
                         f"{r['t_window'] * 1e3:.2f}", f"{r['window_bytes'] / bw / 1e6:.2f}", f"{r['t_full'] / r['t_window']:.2f}x"])
    print(f"machine: {info}; copy bandwidth {bw:.1f} GB/s; window {args.window}, one layer, {HEADS} q / {KV_HEADS} KV heads, "
          f"head_dim {HEAD_DIM}, bf16")
    print(markdown_table(["context", "batch", "every key ms", "its bytes at copy bw ms", f"window {args.window} ms",
                          "its bytes at copy bw ms", "speedup"], rows))


if __name__ == "__main__":
    main()
