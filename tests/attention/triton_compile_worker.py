"""Compiles the Triton kernels ahead of time for an NVIDIA target (sm_90 unless given) without a GPU,
in the variants the backend launches, and prints one JSON line per variant with its shared memory.
The interpreter does not enforce GPU rules (dot shapes, dtypes, layouts); this does. Run as a
script, without TRITON_INTERPRET (test_attention_triton.py starts it in a subprocess).
"""
from __future__ import annotations

import json
import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import cuttle.attention.triton_kernels as K

INDEX_PTRS = ("tile_seq_ptr", "tile_qoff_ptr", "query_start_ptr", "seq_lens_ptr", "block_tables_ptr", "full_ptr", "gap_ptr")


def compile_kernel(fn: Any, ptr_types: dict[str, str], consts: dict[str, Any], target: GPUTarget, num_warps: int = 4) -> int:
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[(i,)] = consts[p.name]
        elif p.name.endswith("_ptr"):
            signature[p.name] = ptr_types[p.name]
        else:
            signature[p.name] = "fp32" if p.name == "scale" else "i32"
    compiled = triton.compile(ASTSource(fn, signature, constexprs), target=target, options={"num_warps": num_warps})
    return compiled.metadata.shared


def attention_variant(
    dtype: str, group: int, head_dim: int, block_m: int, decode: bool, full: bool, target: GPUTarget, host: bool = False,
    window: bool = False, gaps: bool = False,
) -> dict[str, Any]:
    group_pad = triton.next_power_of_2(group)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    block_q = 1 if decode else max(1, block_m // group_pad)
    if block_q * group_pad < 16:  # as paged_attention pads a decode tile
        block_q = 16 // group_pad
    out_type = "*fp32" if decode or full else f"*{dtype}"  # split partials and segment parts are fp32
    ptrs = {"q_ptr": f"*{dtype}", "k_cache_ptr": f"*{dtype}", "v_cache_ptr": f"*{dtype}", "kh_ptr": f"*{dtype}",
            "vh_ptr": f"*{dtype}", "out_ptr": out_type, "lse_ptr": "*fp32"}
    ptrs.update({name: "*i32" for name in INDEX_PTRS})
    consts = dict(
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=16, BLOCK_Q=block_q,
        BLOCK_N=32 if dtype == "fp32" else 64, SPLIT=decode, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
        FULL_VIS=full, HOST=host, HOST_FLAG=K.HOST_BLOCK, WINDOW=window, GAPS=gaps,
    )
    num_warps = 8 if block_q * group_pad * d_pad >= 128 * 128 else 4
    shared = compile_kernel(K._paged_attention_kernel, ptrs, consts, target, num_warps)
    return {"kernel": "paged_attention", "dtype": dtype, "group": group, "head_dim": head_dim, "decode": decode,
            "full": full, "host": host, "window": window, "gaps": gaps, "shared": shared}


def main(arch: int) -> None:
    target = GPUTarget("cuda", arch, 32)
    # (dtype, group, head_dim, decode, full-visibility parts of a segmented step, host blocks read in place, sliding window)
    variants = [("fp32", 1, 128, False, False, False, False), ("bf16", 4, 128, False, True, False, False),
                ("bf16", 8, 64, True, True, False, False), ("fp16", 3, 24, True, False, True, False),
                ("bf16", 4, 128, False, False, False, True), ("bf16", 8, 128, True, False, False, True)]
    for dtype, group, head_dim, decode, full, host, window in variants:
        print(json.dumps(attention_variant(dtype, group, head_dim, 64, decode, full, target, host, window)), flush=True)
    # a segmented step under a window (squid's documents): positions per part (gap_ptr)
    for decode in (False, True):
        print(json.dumps(attention_variant("bf16", 4, 64, 64, decode, True, target, False, True, gaps=True)), flush=True)
    for dtype in ("fp32", "bf16"):
        merge_ptrs = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": f"*{dtype}", "out_lse_ptr": "*fp32",
                      "tile_seq_ptr": "*i32", "query_start_ptr": "*i32"}
        shared = compile_kernel(K._merge_splits_kernel, merge_ptrs, dict(HEAD_DIM=128, D_PAD=128, S_PAD=16), target)
        print(json.dumps({"kernel": "merge_splits", "dtype": dtype, "shared": shared}), flush=True)
        write_ptrs = {n: f"*{dtype}" for n in ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")} | {"slot_ptr": "*i64"}
        consts = dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, H_PAD=8, D_PAD=128)
        shared = compile_kernel(K._write_kv_kernel, write_ptrs, consts, target)
        print(json.dumps({"kernel": "write_kv", "dtype": dtype, "shared": shared}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
