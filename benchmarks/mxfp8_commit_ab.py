"""The MXFP8 CPU linear of two commits side by side: the kernel library is built from `attention/csrc`
at --base (a git revision) and from the working tree, by the engine's own build (`native.build`), and
the two builds' `mxfp8_linear` are called alternately in one process, round by round (base/tree,
then tree/base), on the same weights and x.

    python benchmarks/mxfp8_commit_ab.py --base 27577a0 [--rows 1,2,4] [--rounds 7] [--json out.json]
    python benchmarks/mxfp8_commit_ab.py --base dbea0b1 --experts [--rows 1,4]

`--experts` compares the routed experts' MXFP8 kernel (`moe_experts`, the W_MXFP8 panels) instead,
at `--rows` tokens (bf16 activations, as the engine runs them), on the MoE preset's expert layer
(32 experts, hidden 512, width 256, top-4) and Qwen3-30B-A3B's (128, 2048, 768, top-8), with
layers cycled past the last-level cache; each token routed to distinct random experts.

Weights of each shape are laid out many times over (more bytes than the last-level cache) and
walked in turn, so every call reads its weight from memory, as in `benchmarks/mxfp8_gemm.py`.
Reports per shape and row count the median and range of the per-round time ratios base / tree
(above 1: the working tree is faster). fp32 activations, so the AVX2 loops run on an AVX2 CPU; on
an AVX512-BF16 build bf16 x would take the bf16-dot loop instead (not what this compares).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from common import machine_info, markdown_table  # noqa: E402
from mxfp8_gemm import LM_HEADS, SHAPES  # noqa: E402

from cuttle.attention.native import build  # noqa: E402
from cuttle.attention.native import moe as native_moe  # noqa: E402
from cuttle.attention.native import mxfp8 as native_mx  # noqa: E402
from cuttle.moe.mxfp8 import quantize_mxfp8  # noqa: E402


def _load(src_dir: str) -> ctypes.CDLL:
    """The kernel library built from `src_dir` (the engine's build and flags, cached by content),
    with mxfp8_linear declared as the binding declares it."""
    try:
        lib = ctypes.CDLL(build.build(src_dir))
    except RuntimeError as e:
        sys.exit(str(e))
    lib.mxfp8_linear.argtypes, lib.mxfp8_linear.restype = native_mx._SIGNATURES["mxfp8_linear"]
    lib.moe_experts.argtypes, lib.moe_experts.restype = native_moe._SIGNATURES["moe_experts"]
    return lib


def alternate(libs: dict[str, ctypes.CDLL], run, rounds: int) -> list[float]:
    """Sorted per-round time ratios base / tree, the two sides alternating which goes first."""
    ratios = []
    for r in range(rounds):
        t = {}
        for side in (("base", "tree") if r % 2 == 0 else ("tree", "base")):
            t[side] = run(libs[side])
        ratios.append(t["base"] / t["tree"])
    return sorted(ratios)


# (name, experts, hidden, width, top-k)
EXPERT_SHAPES = [("MoE preset experts", 32, 512, 256, 4), ("30B-A3B experts", 128, 2048, 768, 8)]


def expert_rows(libs: dict[str, ctypes.CDLL], rows_list: list[int], rounds: int, mb: int) -> tuple[list, list]:
    results, table = [], []
    g = torch.Generator().manual_seed(0)
    for name, E, H, I, k in EXPERT_SHAPES:
        layer_bytes = E * 3 * H * I * 33 // 32
        packs = []
        for _ in range(max(2, (mb << 20) // layer_bytes)):
            w13 = quantize_mxfp8(torch.randn(E, 2 * I, H, generator=g) * 0.02)
            w2 = quantize_mxfp8(torch.randn(E, H, I, generator=g) * 0.02)
            packs.append(native_moe.pack_mxfp8(w13, w2))
        for T in rows_list:
            x = torch.randn(T, H, generator=g).bfloat16()
            ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).contiguous()
            weights = torch.full((T, k), 1.0 / k)
            out = torch.empty(T, H, dtype=torch.bfloat16)

            def run(lib: ctypes.CDLL) -> float:
                best = float("inf")
                for _ in range(3):
                    t = time.perf_counter()
                    for p in packs:
                        rc = lib.moe_experts(x.data_ptr(), 1, H, T, H, ids.data_ptr(), weights.data_ptr(), k,
                                             p.w13.data_ptr(), p.w2.data_ptr(), p.fmt, p.s13.data_ptr(), p.s2.data_ptr(),
                                             E, I, out.data_ptr(), 1, 0)
                        if rc != 0:
                            sys.exit(f"moe_experts returned {rc}")
                    best = min(best, time.perf_counter() - t)
                return best

            ratios = alternate(libs, run, rounds)
            med = statistics.median(ratios)
            results.append({"shape": name, "E": E, "H": H, "I": I, "top_k": k, "tokens": T, "ratios": ratios})
            table.append([name, f"{E}x{H}x{I}, top-{k}", T, f"{med:.2f}", f"{ratios[0]:.2f}-{ratios[-1]:.2f}"])
            print(f"{name} T={T}: base / tree {med:.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})", flush=True)
        packs.clear()
    return results, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="git revision whose attention/csrc is the baseline")
    ap.add_argument("--rows", default="1,2,4", help="x row counts, comma list")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--mb", type=int, default=256, help="MiB of weights walked per measurement (> LLC)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--experts", action="store_true", help="the routed experts' kernel (moe_experts) instead")
    args = ap.parse_args()
    rows_list = [int(v) for v in args.rows.split(",")]
    if args.rounds < 1 or any(m < 1 for m in rows_list):
        ap.error("--rounds and --rows must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        base_src = os.path.join(tmp, "base")
        os.makedirs(base_src)
        archive = subprocess.run(["git", "-C", ROOT, "archive", args.base, "attention/csrc"], capture_output=True)
        if archive.returncode != 0:
            sys.exit(f"git archive {args.base}: {archive.stderr.decode()[-500:]}")
        subprocess.run(["tar", "-x", "-C", base_src], input=archive.stdout, check=True)
        libs = {"base": _load(os.path.join(base_src, "attention", "csrc")), "tree": _load(build.SRC_DIR)}
        results, table = [], []
        torch.manual_seed(0)
        for name, N, K in ([] if args.experts else LM_HEADS + SHAPES):
            copies = max(1, (args.mb << 20) // (N * K))
            ws = []
            for _ in range(copies):
                d, s = quantize_mxfp8(torch.randn(N, K) * 0.02)
                ws.append((d.view(torch.uint8).contiguous(), s.view(torch.uint8).contiguous()))
            for M in rows_list:
                x, y = torch.randn(M, K), torch.empty(M, N)

                def run(lib: ctypes.CDLL) -> float:
                    best = float("inf")
                    for _ in range(3):
                        t = time.perf_counter()
                        for d, s in ws:
                            rc = lib.mxfp8_linear(x.data_ptr(), 0, K, d.data_ptr(), s.data_ptr(), None, y.data_ptr(), 0,
                                                  M, N, K, 0)
                            if rc != 0:
                                sys.exit(f"mxfp8_linear returned {rc}")
                        best = min(best, time.perf_counter() - t)
                    return best

                ratios = alternate(libs, run, args.rounds)
                med = statistics.median(ratios)
                results.append({"shape": name, "N": N, "K": K, "M": M, "ratios": ratios})
                table.append([name, f"{N}x{K}", M, f"{med:.2f}", f"{ratios[0]:.2f}-{ratios[-1]:.2f}"])
                print(f"{name} M={M}: base / tree {med:.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})", flush=True)
            ws.clear()
        if args.experts:
            results, table = expert_rows(libs, rows_list, args.rounds, args.mb)
    print(f"base {args.base} vs the working tree: time ratio base / tree (above 1: the tree is faster)")
    print(markdown_table(["shape", "experts x hidden x width" if args.experts else "N x K",
                          "tokens" if args.experts else "M", "base / tree (median)", "range"], table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
