"""Triton kernel of NSA's three gated branches over the paged raw and compressed caches.

Owns one kernel and its launcher. A program serves one query row and one KV head, i.e. the
GROUP query heads that share that head and its block selection: it streams the row's visible
compressed entries (through the block table: entry i sits in raw block table[e // B] at slot
(e % B) // d, e = i*d + l - 1, the layout of nsa_backend.py), the keys of its selected blocks
(given as indices, -1 = none; the query's own block only up to the query) and its window, each
branch with its own online softmax in fp32, and writes g_cmp o_cmp + g_slc o_slc + g_win o_win,
or (`branches=`) the three branches apart, normalised, with their log-sum-exps: a squid part's
result, which the caller merges over a row's parts before the gates (nsa_backend.py).
The selection itself is the caller's (nsa_backend.py computes it with the reference's rule).
Products are elementwise (no tl.dot) so any group size works, down to 1; the kernel is
memory-bound at decode, where it matters. Never allocates cache memory.

On CPU it runs only in the Triton interpreter (TRITON_INTERPRET=1 before triton is imported).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cuttle.attention.nsa import NSAConfig


@triton.jit
def _online(q, k, v, valid, m, s, acc):
    """One tile of keys: q [G, D] (pre-scaled), k/v [N, D], valid [N]; online-softmax state update."""
    x = tl.sum(q[:, None, :] * k[None, :, :], 2)  # [G, N]
    x = tl.where(valid[None, :], x, float("-inf"))
    m_new = tl.maximum(m, tl.max(x, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(x - m_safe[:, None])
    s = s * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
    return m_new, s, acc


@triton.jit
def _raw_tile(k_ptr, v_ptr, bt_row, tok, valid, h, d, d_valid, stride_kb, stride_ks, stride_kh,
              BLOCK_SIZE: tl.constexpr):
    blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    off = (blk * stride_kb + (tok % BLOCK_SIZE) * stride_ks + h * stride_kh)[:, None] + d[None, :]
    mask = valid[:, None] & d_valid[None, :]
    k = tl.load(k_ptr + off, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + off, mask=mask, other=0.0).to(tl.float32)
    return k, v


@triton.jit
def _nsa_kernel(
    q_ptr, k_ptr, v_ptr, ck_ptr, cv_ptr, g_ptr, out_ptr, idx_ptr, row_seq_ptr, row_pos_ptr, bt_ptr, bo_ptr, bl_ptr,
    scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_cb, stride_cs, stride_ch,
    stride_gt, stride_gh, stride_ot, stride_oh, stride_it, stride_ih, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, L_CMP: tl.constexpr, D_CMP: tl.constexpr, L_SEL: tl.constexpr,
    TOP_N: tl.constexpr, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, BRANCHES: tl.constexpr,
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

    # compression branch: entries 0 .. nc-1
    nc = tl.where(t + 1 >= L_CMP, (t + 1 - L_CMP) // D_CMP + 1, 0)
    m_c = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    s_c = tl.zeros([GROUP_PAD], tl.float32)
    a_c = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for start in range(0, nc, BLOCK_N):
        i = start + n
        valid = i < nc
        e = i * D_CMP + L_CMP - 1
        blk = tl.load(bt_row + e // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        off = (blk * stride_cb + ((e % BLOCK_SIZE) // D_CMP) * stride_cs + h * stride_ch)[:, None] + d[None, :]
        mask = valid[:, None] & d_valid[None, :]
        ck = tl.load(ck_ptr + off, mask=mask, other=0.0).to(tl.float32)
        cv = tl.load(cv_ptr + off, mask=mask, other=0.0).to(tl.float32)
        m_c, s_c, a_c = _online(q, ck, cv, valid, m_c, s_c, a_c)

    # selected blocks (each L_SEL keys, causal inside the query's own block)
    m_s = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    s_s = tl.zeros([GROUP_PAD], tl.float32)
    a_s = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for p in range(TOP_N):
        j = tl.load(idx_ptr + row * stride_it + h * stride_ih + p)
        hi = tl.where(j >= 0, tl.minimum(j * L_SEL + L_SEL, t + 1), 0)
        for start in range(0, L_SEL, BLOCK_N):
            tok = j * L_SEL + start + n
            valid = (tok >= 0) & (tok < hi)  # hi = 0 for a -1 entry, whose tokens are negative
            k, v = _raw_tile(k_ptr, v_ptr, bt_row, tok, valid, h, d, d_valid, stride_kb, stride_ks, stride_kh, BLOCK_SIZE)
            m_s, s_s, a_s = _online(q, k, v, valid, m_s, s_s, a_s)

    # sliding window: keys t - WINDOW + 1 .. t
    m_w = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    s_w = tl.zeros([GROUP_PAD], tl.float32)
    a_w = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    lo = tl.maximum(t + 1 - WINDOW, 0)
    for start in range(lo, t + 1, BLOCK_N):
        tok = start + n
        valid = tok <= t
        k, v = _raw_tile(k_ptr, v_ptr, bt_row, tok, valid, h, d, d_valid, stride_kb, stride_ks, stride_kh, BLOCK_SIZE)
        m_w, s_w, a_w = _online(q, k, v, valid, m_w, s_w, a_w)

    if BRANCHES:  # fp32 [rows, H, 3, D] and [rows, H, 3], contiguous: each branch apart
        num_heads = tl.num_programs(1) * GROUP
        base = (row * num_heads + head) * 3  # [GROUP_PAD]
        store = g_valid[:, None] & d_valid[None, :]
        tl.store(bo_ptr + (base * HEAD_DIM)[:, None] + d[None, :], a_c / tl.where(s_c == 0.0, 1.0, s_c)[:, None], mask=store)
        tl.store(bo_ptr + ((base + 1) * HEAD_DIM)[:, None] + d[None, :], a_s / tl.where(s_s == 0.0, 1.0, s_s)[:, None],
                 mask=store)
        tl.store(bo_ptr + ((base + 2) * HEAD_DIM)[:, None] + d[None, :], a_w / tl.where(s_w == 0.0, 1.0, s_w)[:, None],
                 mask=store)
        tl.store(bl_ptr + base, tl.where(s_c > 0.0, m_c + tl.log(tl.where(s_c > 0.0, s_c, 1.0)), float("-inf")), mask=g_valid)
        tl.store(bl_ptr + base + 1, tl.where(s_s > 0.0, m_s + tl.log(tl.where(s_s > 0.0, s_s, 1.0)), float("-inf")),
                 mask=g_valid)
        tl.store(bl_ptr + base + 2, tl.where(s_w > 0.0, m_w + tl.log(tl.where(s_w > 0.0, s_w, 1.0)), float("-inf")),
                 mask=g_valid)
    else:
        gp = g_ptr + row * stride_gt + head * stride_gh
        w_c = tl.load(gp, mask=g_valid, other=0.0).to(tl.float32) / tl.where(s_c == 0.0, 1.0, s_c)
        w_s = tl.load(gp + 1, mask=g_valid, other=0.0).to(tl.float32) / tl.where(s_s == 0.0, 1.0, s_s)
        w_w = tl.load(gp + 2, mask=g_valid, other=0.0).to(tl.float32) / tl.where(s_w == 0.0, 1.0, s_w)
        o = w_c[:, None] * a_c + w_s[:, None] * a_s + w_w[:, None] * a_w
        tl.store(out_ptr + row * stride_ot + head[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=g_valid[:, None] & d_valid[None, :])


def nsa_paged_attention(
    q: torch.Tensor,  # [T, H, D] (unit dim stride)
    k_cache: torch.Tensor,  # [num_blocks, B, Hkv, D]
    v_cache: torch.Tensor,
    ck_cache: torch.Tensor,  # [num_blocks, S_c, Hkv, D]
    cv_cache: torch.Tensor,
    gates: torch.Tensor | None,  # [T, H, 3]; None with `branches`
    out: torch.Tensor | None,  # [T, H, D]; None with `branches`
    block_indices: torch.Tensor,  # [T, Hkv, top_n] int32 selected blocks, -1 = none
    row_seq: torch.Tensor,  # [T] int32 row of `block_tables` of each query row
    row_pos: torch.Tensor,  # [T] int32 key index of each query row (it sees keys 0 .. row_pos)
    block_tables: torch.Tensor,  # [B, nb] int32
    cfg: NSAConfig,
    scale: float,
    branches: tuple[torch.Tensor, torch.Tensor] | None = None,  # out: fp32 ([T, H, 3, D], [T, H, 3]) contiguous
) -> None:
    num_rows, heads, dim = q.shape
    hkv = k_cache.shape[2]
    group = heads // hkv
    if num_rows == 0:
        return
    assert k_cache.stride() == v_cache.stride() and ck_cache.stride() == cv_cache.stride()
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and ck_cache.stride(3) == 1
    assert block_indices.stride(2) == 1 and block_indices.shape[2] == cfg.top_n
    if branches is not None:
        bo, bl = branches
        assert bo.dtype == bl.dtype == torch.float32 and bo.is_contiguous() and bl.is_contiguous()
        assert bo.shape == (num_rows, heads, 3, dim) and bl.shape == (num_rows, heads, 3)
        gates = out = bo  # not read: placeholders for the pointers
        g_strides = o_strides = (0, 0)
    else:
        assert gates is not None and out is not None and out.stride(2) == 1 and gates.stride(2) == 1
        bo = bl = out
        g_strides, o_strides = (gates.stride(0), gates.stride(1)), (out.stride(0), out.stride(1))
    block_n = min(64, triton.next_power_of_2(cfg.select_block))
    _nsa_kernel[(num_rows, hkv)](
        q, k_cache, v_cache, ck_cache, cv_cache, gates, out, block_indices, row_seq, row_pos, block_tables, bo, bl,
        scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ck_cache.stride(0), ck_cache.stride(1), ck_cache.stride(2),
        *g_strides, *o_strides, block_indices.stride(0), block_indices.stride(1),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=dim, D_PAD=triton.next_power_of_2(dim),
        BLOCK_SIZE=k_cache.shape[1], L_CMP=cfg.compress_block, D_CMP=cfg.compress_stride, L_SEL=cfg.select_block,
        TOP_N=cfg.top_n, WINDOW=cfg.window, BLOCK_N=block_n, BRANCHES=branches is not None,
    )
