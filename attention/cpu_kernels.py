"""Paged decode attention on CPU: the Python binding of `csrc/paged_decode.c` (K/V read in place
from the paged cache), called by the torch backend; tested against the torch path it replaces.

The kernel library itself (build, load, the other kernels) is `cuttle.attention.native`.
"""
from __future__ import annotations

import torch

from cuttle.attention.native.build import DTYPE_CODE as _DTYPE_CODE
from cuttle.attention.native.build import load

__all__ = ["load", "supports", "paged_decode_attention"]


def supports(q: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the native decode kernel takes these tensors (CPU, fp32/bf16, dense rows)."""
    return (
        q.device.type == "cpu" and k_cache.device.type == "cpu"
        and q.dtype in _DTYPE_CODE and k_cache.dtype in _DTYPE_CODE and out.dtype in _DTYPE_CODE
        and q.stride(-1) == 1 and q.stride(-2) == q.shape[-1] and out.is_contiguous() and k_cache.is_contiguous()
    )


def paged_decode_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [T, Hq, D], written at the decode rows
    rows: torch.Tensor,  # [Bd] int64 row of each decode sequence
    tables: torch.Tensor,  # [Bd, nb] int32 block ids
    seq_lens: torch.Tensor,  # [Bd] int32
    max_seq_len: int,
    scale: float,
) -> None:
    lib = load()
    assert lib is not None, "call load() first"
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    # Few sequences: split each one's heads so every thread has work; many: whole sequences per
    # item, so each token's K/V row (all heads) is read as one contiguous run.
    threads = torch.get_num_threads()
    head_chunks = min(num_kv_heads, max(1, -(-2 * threads // rows.shape[0])))
    rc = lib.paged_decode_attention(
        q.data_ptr(), _DTYPE_CODE[q.dtype], q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        _DTYPE_CODE[k_cache.dtype], out.data_ptr(), _DTYPE_CODE[out.dtype], out.stride(0), rows.data_ptr(),
        tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(), rows.shape[0], num_kv_heads, group, head_dim,
        block_size, max_seq_len, scale, head_chunks,
    )
    if rc != 0:
        raise MemoryError("paged_decode_attention: scratch allocation failed")
