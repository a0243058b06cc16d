"""Triton kernels over the paged KV cache: writing this step's K/V into slots, and paged attention.

Owns the kernels and their thin launchers. It knows nothing about scheduling or how a batch is
split into tiles (triton_backend.py plans that); it never allocates cache memory and never makes
the device wait on the host.

One attention kernel serves prefill chunks and decode. A program owns one *tile*: up to BLOCK_Q
consecutive new tokens of one sequence times the GROUP query heads that share one KV head, folded
into BLOCK_M = BLOCK_Q * GROUP_PAD rows, so each K/V tile read from the cache feeds every query
head of its group. Keys are visited in BLOCK_N-token steps; each key's physical slot is looked up
through the block table, so any block_size and any block order work. Softmax is online, in fp32.
Every row's output comes with its log-sum-exp (natural log, -inf for a row that saw no key).
With SPLIT the key range is cut into chunks of `split_len` tokens (flash-decoding); each chunk
writes a normalised partial output and its log-sum-exp, and `_merge_splits_kernel` combines them.
A "sequence" may also be one part of a segmented step (a query's rows against one cached
segment): with FULL_VIS a per-sequence flag shows every key to every row instead of the causal
rule. With HOST (read in place) a block-table entry flagged HOST_BLOCK names a block of the host
pool (same layout, `kh`/`vh`): each key is loaded from the pool its block lies in (two masked
loads, one of them empty), so cold blocks are read where they are. On a GPU that needs the host
tensors' device addresses (unified addressing: Grace's C2C link, or mapped pinned memory).

On CPU these run only in the Triton interpreter: TRITON_INTERPRET=1 must be set before this module
is imported (`INTERPRETED` tells which mode the kernels were built in).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from cuttle.attention.metadata import HOST_BLOCK


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    k_dst = k_cache_ptr + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :]
    v_dst = v_cache_ptr + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, kh_ptr, vh_ptr, out_ptr, lse_ptr,
    tile_seq_ptr, tile_qoff_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr, full_ptr, gap_ptr,
    scale, split_len, window,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, FULL_VIS: tl.constexpr, HOST: tl.constexpr,
    HOST_FLAG: tl.constexpr, WINDOW: tl.constexpr, GAPS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    q_off = tl.load(tile_qoff_ptr + tile)
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # new token j sits at logical index ctx_len + j
    # a window measures positions: row j sits w_base + j past the sequence's (part's) first key
    w_base = ctx_len
    if GAPS:
        w_base = tl.load(gap_ptr + seq)
    if FULL_VIS:
        # a full-visibility part: every row sits at or past the last key, so it sees all of them
        ctx_len = tl.where(tl.load(full_ptr + seq) != 0, seq_len - 1, ctx_len)

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    tok = q_off + rows // GROUP_PAD
    g = rows % GROUP_PAD
    head = kv_head * GROUP + g
    row_valid = (tok < q_len) & (g < GROUP)
    d = tl.arange(0, D_PAD)
    d_valid = d < HEAD_DIM
    q_rows = (q_begin + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    q_pos = ctx_len + tok

    # The tile's last row sees keys up to its own position; nothing beyond is visited.
    kv_hi = tl.minimum(seq_len, ctx_len + q_off + BLOCK_Q)
    kv_lo = 0
    if SPLIT:
        kv_lo = split * split_len
        kv_hi = tl.minimum(kv_hi, kv_lo + split_len)
    if WINDOW:
        # a sliding window: the tile's first row sees keys from its position - window + 1 on, so
        # the walk starts at the BLOCK_N step holding that key (rows mask the rest below)
        first = tl.maximum(w_base + q_off - window + 1, 0)
        kv_lo = tl.maximum(kv_lo, (first // BLOCK_N) * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_valid = n < kv_hi
        raw = tl.load(bt_row + n // BLOCK_SIZE, mask=n_valid, other=0)
        if WINDOW:
            # NULL_BLOCK (-1): a block given back behind the window (its keys are before every
            # row's window); nothing is loaded from it
            n_valid = n_valid & (raw >= 0)
        off = n % BLOCK_SIZE
        kv_mask = n_valid[:, None] & d_valid[None, :]
        if HOST:
            on_host = (raw >= HOST_FLAG)[:, None]
            blk = (raw & (HOST_FLAG - 1)).to(tl.int64)
            k_off = blk[:, None] * stride_kb + off[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
            # exactly one of the two loads holds each key; the other adds 0
            k = (tl.load(k_cache_ptr + k_off, mask=kv_mask & (on_host == 0), other=0.0)
                 + tl.load(kh_ptr + k_off, mask=kv_mask & on_host, other=0.0)).to(q.dtype)
        else:
            blk = raw.to(tl.int64)
            k = tl.load(
                k_cache_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                mask=kv_mask,
                other=0.0,
            ).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        visible = (n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        if WINDOW:
            visible = visible & (n[None, :] > (w_base + tok)[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key yet keeps m = -inf; shift by 0 so exp never sees -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = blk[:, None] * stride_vb + off[:, None] * stride_vs + kv_head * stride_vh + d[None, :]
        if HOST:
            v = (tl.load(v_cache_ptr + v_off, mask=kv_mask & (on_host == 0), other=0.0)
                 + tl.load(vh_ptr + v_off, mask=kv_mask & on_host, other=0.0)).to(q.dtype)
        else:
            v = tl.load(v_cache_ptr + v_off, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # l == 0 only for padding rows and for split chunks past a sequence's end (lse = -inf there).
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    out_mask = row_valid[:, None] & d_valid[None, :]
    if SPLIT:
        tile64 = tile.to(tl.int64)
        o_ptrs = out_ptr + tile64 * stride_ot + head[:, None] * stride_oh + split * stride_os + d[None, :]
        tl.store(o_ptrs, o, mask=out_mask)
        tl.store(lse_ptr + tile64 * stride_lt + head * stride_lh + split, m_i + tl.log(l_safe), mask=row_valid)
    else:
        o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=out_mask)
        tl.store(lse_ptr + q_rows * stride_lt + head * stride_lh, m_i + tl.log(l_safe), mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, out_lse_ptr, tile_seq_ptr, query_start_ptr, num_splits,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh, stride_olt,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = tl.load(query_start_ptr + tl.load(tile_seq_ptr + tile)).to(tl.int64)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_valid = s < num_splits
    lse = tl.load(lse_ptr + tile * stride_lt + head * stride_lh + s, mask=s_valid, other=float("-inf"))
    # A sequence with no key (an empty segment) has every chunk at -inf: shift by 0, weights 0.
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    mask = s_valid[:, None] & (d[None, :] < HEAD_DIM)
    part = tl.load(part_ptr + tile * stride_pt + head * stride_ph + s[:, None] * stride_ps + d[None, :], mask=mask, other=0.0)
    total = tl.sum(w, 0)
    o = tl.sum(w[:, None] * part, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
    tl.store(out_lse_ptr + row * stride_olt + head, m_safe + tl.log(total))


INTERPRETED: bool = isinstance(_paged_attention_kernel, InterpretedFunction)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter K/V rows [T, num_kv_heads, head_dim] (any token/head strides) into their cache slots."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        H_PAD=triton.next_power_of_2(num_kv_heads), D_PAD=triton.next_power_of_2(head_dim),
    )


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim], any token/head strides
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [T, num_heads, head_dim]; only the rows of the given tiles are written
    lse: torch.Tensor,  # [T, num_heads] fp32, unit head stride; written at the same rows
    tile_seqs: torch.Tensor,  # [num_tiles] int32, sequence of each tile
    tile_qoffs: torch.Tensor,  # [num_tiles] int32, first new token of each tile within its sequence
    block_q: int,  # new tokens per tile (power of two)
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    block_n: int,
    num_splits: int = 1,
    split_len: int = 0,  # keys per split chunk, a multiple of block_n; used when num_splits > 1
    full: torch.Tensor | None = None,  # [num_seqs] int32, 1 = every key visible to every row; None: all causal
    k_host: torch.Tensor | None = None,  # the host pool's caches (HOST_BLOCK entries); None: no table names one
    v_host: torch.Tensor | None = None,
    window: int | None = None,  # a sliding window: a row at position p sees keys p - window + 1 .. p; None: all
    gaps: torch.Tensor | None = None,  # [num_seqs] int32 under a window: each one's first new token's position less
    # its first key's (a segmented step's parts); None: a causal sequence's cached length
) -> None:
    """Attention of the tiles' query rows over their sequences' paged K/V, written into `out`
    (and the rows' log-sum-exp into `lse`).

    Splitting is meant for one-token tiles (decode), where a program per (sequence, KV head) alone
    leaves most of a GPU idle on long contexts.
    """
    num_tiles = tile_seqs.shape[0]
    if num_tiles == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    # A merge reads one output row per tile, so only one-token (decode) tiles may be split.
    assert num_splits <= 1 or block_q == 1
    if block_q * group_pad < 16:
        # tl.dot needs 16 rows: a decode tile pads with rows past its one token (masked out);
        # a wider tile would overlap its neighbour, so the planner must not ask for one.
        assert block_q == 1, "multi-token tiles must fill at least 16 rows"
        block_q = 16 // group_pad
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert block_n >= 16 and block_n & (block_n - 1) == 0
    if q.dtype == torch.float32:
        # fp32 tiles take twice the shared memory: 32 keys keep a 64-row, head_dim-128 tile at
        # ~74 KB, under the ~100 KB of consumer GPUs (64 keys need ~115 KB).
        block_n = min(block_n, 32)
    # fp32 inputs must not silently drop to TF32 on tensor cores: the fp32 path is the exact one.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    num_warps = 8 if block_q * group_pad * d_pad >= 128 * 128 else 4
    assert lse.dtype == torch.float32 and lse.stride(1) == 1
    host = k_host is not None
    if host:
        # one set of strides serves both pools: the host tier has the device pool's layout
        assert v_host is not None and k_host.stride() == k_cache.stride() and v_host.stride() == v_cache.stride()
        assert k_host.dtype == k_cache.dtype and v_host.dtype == v_cache.dtype
    common = dict(
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_Q=block_q, BLOCK_N=block_n,
        DOT_PRECISION=precision, FULL_VIS=full is not None, HOST=host, HOST_FLAG=HOST_BLOCK, WINDOW=window is not None,
        GAPS=gaps is not None, num_warps=num_warps,
    )
    kh, vh = (k_host, v_host) if host else (k_cache, v_cache)  # never read without HOST
    full_arg = full if full is not None else seq_lens  # never read without FULL_VIS
    gap_arg = gaps if gaps is not None else seq_lens  # never read without GAPS
    cache_strides = (
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
    )
    if num_splits <= 1:
        _paged_attention_kernel[(num_tiles, num_kv_heads, 1)](
            q, k_cache, v_cache, kh, vh, out, lse,
            tile_seqs, tile_qoffs, query_start_loc, seq_lens, block_tables, full_arg, gap_arg,
            scale, 0, window or 0,
            q.stride(0), q.stride(1), *cache_strides,
            out.stride(0), out.stride(1), 0, lse.stride(0), 1,
            block_tables.stride(0),
            SPLIT=False, **common,
        )
        return
    assert split_len % block_n == 0
    part = torch.empty(num_tiles, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_tiles, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _paged_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, kh, vh, part, part_lse,
        tile_seqs, tile_qoffs, query_start_loc, seq_lens, block_tables, full_arg, gap_arg,
        scale, split_len, window or 0,
        q.stride(0), q.stride(1), *cache_strides,
        part.stride(0), part.stride(1), part.stride(2), part_lse.stride(0), part_lse.stride(1),
        block_tables.stride(0),
        SPLIT=True, **common,
    )
    _merge_splits_kernel[(num_tiles, num_heads)](
        part, part_lse, out, lse, tile_seqs, query_start_loc, num_splits,
        part.stride(0), part.stride(1), part.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), S_PAD=triton.next_power_of_2(num_splits),
    )
