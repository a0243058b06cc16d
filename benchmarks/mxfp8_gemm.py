"""MXFP8 CPU GEMM (attention/csrc/mxfp8_gemm.c) against the memory it has to read.

Decode (M = 1..4): weights of the given shape are laid out many times over (more bytes than the
last-level cache) and walked in turn, as a model's layers are, so every call reads its weight from
memory; reported as GB/s of weight bytes (E4M3 + E8M0 = 8.25 bits a weight) next to the copy
bandwidth measured in the same run, and next to the bf16 and fp32 weight-streaming kernels on the
same shapes (`cuttle.attention.native.gemm.linear`). Prefill (M > 4): GFLOP/s of the tile loop
against torch's fp32 matmul on the dequantized weight (the dequantization not counted for torch).

    python benchmarks/mxfp8_gemm.py [--quick] [--clock cpu] [--json out.json]
    python benchmarks/mxfp8_gemm.py --ab-placed [--rounds 7]

`--ab-placed` times the AVX2 placed loop (1-8 x rows, `mx_placed32`, block sums scaled) against the
fp16-route decode loop (`native.mxfp8.set_placed_loops`), alternating the two in one process round
by round, on the shapes above and two lm_heads; it reports the median and range of the per-round
ratios (fp16-route time / placed time). A control row per shape times the placed loop against
itself (one row): its ratios show the machine's noise. Beside each, the rate on a weight that stays
in the last-level cache: where it is no higher than from memory, the loop is bound by the core, not
by memory.

`--clock cpu` runs one thread and times it with the process CPU clock: on a shared, overloaded
machine wall time measures the scheduler; CPU time still includes the memory system's contention.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, markdown_table  # noqa: E402

from cuttle.attention.native import gemm, mxfp8  # noqa: E402
from cuttle.moe.mxfp8 import dequantize_mxfp8, quantize_mxfp8  # noqa: E402

# (name, N, K): the 0.6B dense linears and a Qwen3-30B-A3B expert's two GEMMs
SHAPES = [("0.6B qkv", 4096, 1024), ("0.6B gate|up", 6144, 1024), ("0.6B down", 1024, 3072),
          ("30B-A3B expert w13", 1536, 2048), ("30B-A3B expert w2", 2048, 768)]


CLOCK = time.perf_counter


def best_of(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = CLOCK()
        fn()
        best = min(best, CLOCK() - t)
    return best


def copy_gbs(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Best copy rate (read + write bytes) under the chosen clock, as common.copy_bandwidth_gbs."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_of(lambda: dst.copy_(src), repeats) / 1e9


def decode_rates(N: int, K: int, M: int, total_bytes: int, repeats: int) -> dict[str, float]:
    """GB/s of weight bytes for MXFP8, bf16 and fp32 weights of [N, K] at M rows, weights from memory."""
    copies = max(2, total_bytes // (N * K))
    w = torch.randn(N, K) * 0.02
    d, s = quantize_mxfp8(w)
    mx_set = [(d.clone(), s.clone()) for _ in range(copies)]
    x = torch.randn(M, K)
    out = {}
    t = best_of(lambda: [mxfp8.linear(x, a, b) for a, b in mx_set], repeats)
    out["mxfp8"] = copies * (d.numel() + s.numel()) / t / 1e9
    mx_set.clear()  # free the copies before the next set (the lambda above holds the list)
    wb = [w.bfloat16() for _ in range(copies)]
    xb = x.bfloat16()
    t = best_of(lambda: [gemm.linear(xb, a) for a in wb], repeats)
    out["bf16"] = copies * N * K * 2 / t / 1e9
    wb.clear()
    copies32 = max(2, copies // 2)
    wf = [w.clone() for _ in range(copies32)]
    t = best_of(lambda: [gemm.linear(x, a) for a in wf], repeats)
    out["fp32"] = copies32 * N * K * 4 / t / 1e9
    return out


# lm_heads: the Qwen3-MoE preset's (hidden 512) and Qwen3-0.6B's (hidden 1024)
LM_HEADS = [("lm_head h512", 151936, 512), ("lm_head h1024", 151936, 1024)]


def in_cache_gbs(K: int, M: int, repeats: int) -> float:
    """GB/s of weight bytes of the current loop at M rows on an 8 MiB weight, which stays in the
    last-level cache on the CPUs we run (a per-call overhead of ~10-20 µs is then a few per cent):
    next to the from-memory rate it tells a core-bound loop from a memory-bound one."""
    N = (8 << 20) // K
    d, s = quantize_mxfp8(torch.randn(N, K) * 0.02)
    x, y, calls = torch.randn(M, K), torch.empty(M, N), 10
    t = best_of(lambda: [mxfp8.linear(x, d, s, out=y) for _ in range(calls)], repeats)
    return calls * N * K * 1.03125 / t / 1e9


def ab_placed(rounds: int, total_bytes: int, repeats: int) -> list[dict]:
    """Per shape and row count: placed loops on / off, alternating, as ratios off-time / on-time,
    and a control (on / on, one row) for this machine's noise."""
    out, rows = [], []
    for name, N, K in LM_HEADS + SHAPES:
        copies = max(1, total_bytes // (N * K))
        d, s = quantize_mxfp8(torch.randn(N, K) * 0.02)
        mx_set = [(d.clone(), s.clone()) for _ in range(copies)]
        del d, s
        for M, control in ((1, False), (2, False), (3, False), (4, False), (8, False), (1, True)):
            x = torch.randn(M, K)
            ratios, t_on = [], []
            for r in range(rounds):
                t = {}
                for side in ((True, False) if r % 2 == 0 else (False, True)):
                    mxfp8.set_placed_loops(side or control)
                    t[side] = best_of(lambda: [mxfp8.linear(x, a, b) for a, b in mx_set], repeats)
                mxfp8.set_placed_loops(True)
                ratios.append(t[False] / t[True])
                t_on.append(t[True])
            ratios.sort()
            gbs = copies * N * K * 1.03125 / min(t_on) / 1e9
            llc = in_cache_gbs(K, M, repeats)
            out.append({"shape": name, "N": N, "K": K, "M": M, "control": control, "ratios": ratios,
                        "placed_gbs": gbs, "in_llc_gbs": llc})
            rows.append([name, f"{N}x{K}", f"{M} (control)" if control else M, f"{ratios[len(ratios) // 2]:.2f}",
                         f"{ratios[0]:.2f}-{ratios[-1]:.2f}", f"{gbs:.1f}", f"{llc:.1f}"])
        mx_set.clear()
    print(markdown_table(["shape", "N x K", "M", "fp16 route / placed (median)", "range", "placed GB/s (best)",
                          "same, 8 MiB weight (in LLC)"], rows))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, decode only at M=1")
    ap.add_argument("--json", default=None)
    ap.add_argument("--mb", type=int, default=256, help="MiB of weights walked per decode measurement (> LLC)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: one thread, process CPU time")
    ap.add_argument("--ab-placed", action="store_true", help="A/B the AVX2 placed loop against the fp16 route, M=1..8")
    ap.add_argument("--rounds", type=int, default=7, help="--ab-placed: alternating rounds")
    args = ap.parse_args()
    global CLOCK
    if args.clock == "cpu":
        torch.set_num_threads(1)
        CLOCK = time.process_time
    repeats = 3 if args.quick else 7
    info = machine_info()
    info["load_before"] = os.getloadavg()
    info["clock"] = args.clock
    copy = copy_gbs(1 << 28)
    if args.ab_placed:
        if not mxfp8.fast_path_available():
            sys.exit("--ab-placed needs the AVX2 path (AVX2, FMA, F16C); this CPU lacks it")
        print(f"copy bandwidth {copy:.1f} GB/s (read + write)")
        results = {"copy_gbs": copy, "ab_placed": ab_placed(args.rounds, args.mb << 20, 3 if args.quick else 5)}
        info["load_after"] = os.getloadavg()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": info, **results}, f, indent=1)
        return
    read_bound = copy / 2  # copy counts read + write bytes: a pure stream reads about this much
    rows, results = [], {"copy_gbs": copy, "decode": [], "prefill": []}
    for name, N, K in SHAPES:
        for M in ((1,) if args.quick else (1, 4)):
            r = decode_rates(N, K, M, args.mb << 20, repeats)
            results["decode"].append({"shape": name, "N": N, "K": K, "M": M, **r})
            rows.append([name, f"{N}x{K}", M, f"{r['mxfp8']:.1f}", f"{r['mxfp8'] / read_bound:.2f}", f"{r['bf16']:.1f}",
                         f"{r['fp32']:.1f}", f"{(r['mxfp8'] / 1.03125) / (r['bf16'] / 2):.2f}"])
    print(f"copy bandwidth {copy:.1f} GB/s (read + write); a read stream is bounded near {read_bound:.1f} GB/s")
    print(markdown_table(["shape", "N x K", "M", "MXFP8 GB/s", "of copy/2", "bf16 GB/s", "fp32 GB/s",
                          "MXFP8 speed-up vs bf16 (bf16 time / MXFP8 time)"], rows))
    prow = []
    for name, N, K in SHAPES[:3]:
        w = torch.randn(N, K) * 0.02
        d, s = quantize_mxfp8(w)
        wd = dequantize_mxfp8(d, s, 32, torch.float32)
        for M in ((64,) if args.quick else (16, 64, 256)):
            x = torch.randn(M, K)
            t_mx = best_of(lambda: mxfp8.linear(x, d, s), repeats)
            t_t = best_of(lambda: x @ wd.T, repeats)
            results["prefill"].append({"shape": name, "M": M, "mxfp8_gflops": 2 * M * N * K / t_mx / 1e9,
                                       "torch_fp32_gflops": 2 * M * N * K / t_t / 1e9})
            prow.append([name, M, f"{2 * M * N * K / t_mx / 1e9:.1f}", f"{2 * M * N * K / t_t / 1e9:.1f}"])
    print(markdown_table(["shape", "M", "MXFP8 tile GFLOP/s", "torch fp32 mm GFLOP/s (dequantized W)"], prow))
    info["load_after"] = os.getloadavg()
    print(f"load average before {info['load_before']}, after {info['load_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, **results}, f, indent=1)


if __name__ == "__main__":
    main()
