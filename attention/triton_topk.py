"""Triton kernel of training-free top-k attention (`topk.py`) over the paged raw cache.

Owns one kernel and its launcher. A program serves one query row and one KV head, i.e. the GROUP
query heads that share that head and its block choice: it streams the keys of the row's chosen
blocks (given as indices, -1 = none; block j holds keys j*P .. j*P + P - 1, read through the block
table, the query's own block only up to the query) with one online softmax in fp32, and writes o
and the log-sum-exp (so a sparse layer stays a backend `(o, lse)`). The choice itself is the
caller's (`topk_backend.py` computes it with the reference's rule, in torch), as for NSA's kernel
(`triton_nsa.py`, whose tile helpers this reuses). Products are elementwise (no tl.dot), so any
group size works, down to 1; decode is memory-bound. Never allocates cache memory.

On CPU it runs only in the Triton interpreter (TRITON_INTERPRET=1 before triton is imported).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cuttle.attention.topk import TopKConfig
from cuttle.attention.triton_nsa import _online, _raw_tile


@triton.jit
def _topk_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, idx_ptr, row_seq_ptr, row_pos_ptr, bt_ptr,
    scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_lt, stride_it, stride_ih,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, P: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    seq = tl.load(row_seq_ptr + row).to(tl.int64)
    t = tl.load(row_pos_ptr + row)
    g = tl.arange(0, GROUP_PAD)
    g_valid = g < GROUP
    d = tl.arange(0, D_PAD)
    d_valid = d < HEAD_DIM
    head = h * GROUP + g
    q = tl.load(q_ptr + row * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=g_valid[:, None] & d_valid[None, :], other=0.0).to(tl.float32) * scale
    bt_row = bt_ptr + seq * stride_bt
    n = tl.arange(0, BLOCK_N)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    s = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for p in range(NUM_BLOCKS):
        j = tl.load(idx_ptr + row * stride_it + h * stride_ih + p)
        hi = tl.where(j >= 0, tl.minimum(j * P + P, t + 1), 0)
        for start in range(0, P, BLOCK_N):
            tok = j * P + start + n
            valid = (tok >= 0) & (tok < hi)  # hi = 0 for a -1 entry, whose tokens are negative
            k, v = _raw_tile(k_ptr, v_ptr, bt_row, tok, valid, h, d, d_valid, stride_kb, stride_ks, stride_kh, BLOCK_SIZE)
            m, s, acc = _online(q, k, v, valid, m, s, acc)
    # a row attends at least its own key (its block is always chosen); only an empty squid part
    # (row_pos -1, no block) has none: o = 0, lse = -inf, weight 0 in the merge
    o = acc / tl.where(s == 0.0, 1.0, s)[:, None]
    tl.store(out_ptr + row * stride_ot + head[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=g_valid[:, None] & d_valid[None, :])
    tl.store(lse_ptr + row * stride_lt + head, tl.where(s > 0.0, m + tl.log(tl.where(s > 0.0, s, 1.0)), float("-inf")),
             mask=g_valid)


def topk_paged_attention(
    q: torch.Tensor,  # [T, H, D] (unit dim stride)
    k_cache: torch.Tensor,  # [num_blocks, B, Hkv, D]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [T, H, D]
    lse: torch.Tensor,  # [T, H] fp32
    block_indices: torch.Tensor,  # [T, Hkv, n] int32 chosen blocks of P keys, -1 = none
    row_seq: torch.Tensor,  # [T] int32 row of `block_tables` of each query row
    row_pos: torch.Tensor,  # [T] int32 key index of each query row (it sees keys 0 .. row_pos)
    block_tables: torch.Tensor,  # [B, nb] int32
    cfg: TopKConfig,
    scale: float,
) -> None:
    num_rows, heads, dim = q.shape
    hkv = k_cache.shape[2]
    group = heads // hkv
    if num_rows == 0:
        return
    assert k_cache.stride() == v_cache.stride() and lse.dtype == torch.float32
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and out.stride(2) == 1 and lse.stride(1) == 1
    assert block_indices.stride(2) == 1 and block_indices.shape[2] == cfg.num_blocks
    _topk_kernel[(num_rows, hkv)](
        q, k_cache, v_cache, out, lse, block_indices, row_seq, row_pos, block_tables,
        scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
        lse.stride(0), block_indices.stride(0), block_indices.stride(1), block_tables.stride(0),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=dim, D_PAD=triton.next_power_of_2(dim),
        BLOCK_SIZE=k_cache.shape[1], P=cfg.block, NUM_BLOCKS=cfg.num_blocks, BLOCK_N=min(64, cfg.block),
    )
