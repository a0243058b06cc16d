"""The MXFP8 CPU linear of two commits side by side: the kernel library is built from `attention/csrc`
at --base (a git revision) and from the working tree, by the engine's own build (`native.build`), and
the two builds' `mxfp8_linear` are called alternately in one process, round by round (base/tree,
then tree/base), on the same weights and x.

    python benchmarks/mxfp8_commit_ab.py --base 27577a0 [--rows 1,2,4] [--rounds 7] [--json out.json]

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
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="git revision whose attention/csrc is the baseline")
    ap.add_argument("--rows", default="1,2,4", help="x row counts, comma list")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--mb", type=int, default=256, help="MiB of weights walked per measurement (> LLC)")
    ap.add_argument("--json", default=None)
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
        for name, N, K in LM_HEADS + SHAPES:
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

                ratios = []
                for r in range(args.rounds):
                    t = {}
                    for side in (("base", "tree") if r % 2 == 0 else ("tree", "base")):
                        t[side] = run(libs[side])
                    ratios.append(t["base"] / t["tree"])
                ratios.sort()
                med = statistics.median(ratios)
                results.append({"shape": name, "N": N, "K": K, "M": M, "ratios": ratios})
                table.append([name, f"{N}x{K}", M, f"{med:.2f}", f"{ratios[0]:.2f}-{ratios[-1]:.2f}"])
                print(f"{name} M={M}: base / tree {med:.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})", flush=True)
            ws.clear()
    print(f"base {args.base} vs the working tree: time ratio base / tree (above 1: the tree is faster)")
    print(markdown_table(["shape", "N x K", "M", "base / tree (median)", "range"], table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
