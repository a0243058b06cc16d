"""Paged attention on CPU: the Python binding of `csrc/paged_decode.c` (`paged_attention_rows`),
called by the torch backend for decode rows, short prefill chunks and the parts of a segmented
step; tested against the torch path it replaces and against a float64 oracle. A sliding window
is a row's table starting at the window's block and `skips`, the keys of that block before it.

A call attends query rows, each against its own block table and key count, reading K/V in place
from the paged cache, and writes each row's output and (optionally) its log-sum-exp. Which
library a call uses is the process's `KernelSet` (`cuttle.attention.native.kernels()`); this
module only declares the kernel's C signature and packs the arguments.

Read in place: table entries flagged `HOST_BLOCK` (metadata.py) are blocks of a second pool of
the same layout, `k_host` / `v_host` (the KV host tier), read where they lie.
"""
from __future__ import annotations

import ctypes

import torch

from cuttle.attention.native import available as native_available
from cuttle.attention.native import kernels, supports_rows
from cuttle.attention.native.build import DTYPE_CODE

__all__ = ["available", "supports", "paged_attention_rows"]

_vp, _i64, _int, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGTYPES = [
    _vp, _int, _i64, _vp, _vp, _vp, _vp, _int,  # q, q dtype, q row stride, k, v, host k, host v, kv dtype
    _vp, _int, _i64,  # out, out dtype, out stride
    _vp, _i64, _vp, _vp,  # lse, lse row stride, q rows, out rows
    _vp, _i64, _vp, _vp, _i64,  # tables, table stride, lens, skips, rows
    _i64, _i64, _i64, _i64, _float, _i64,  # kv heads, group, head_dim, block_size, scale, head chunks
]
_declared: ctypes.CDLL | None = None


def _fn(lib: ctypes.CDLL):
    global _declared
    fn = lib.paged_attention_rows
    if _declared is not lib:
        fn.argtypes, fn.restype = _ARGTYPES, _int
        _declared = lib
    return fn


available = native_available


supports = supports_rows  # the same tensor rules for every native attention kernel


def paged_attention_rows(
    q: torch.Tensor,  # [*, Hq, D] (rows dense: head stride D, unit dim stride)
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [*, Hq, D] contiguous, written at `out_rows`
    lse: torch.Tensor | None,  # [*, Hq] fp32 with unit head stride, written at `out_rows`; None: not wanted
    q_rows: torch.Tensor,  # [N] int64, q row of each kernel row
    out_rows: torch.Tensor,  # [N] int64, out (and lse) row of each kernel row
    tables: torch.Tensor,  # [N, nb] int32 block ids, rows dense
    lens: torch.Tensor,  # [N] int32 keys of each row (0 allowed: o = 0, lse = -inf)
    scale: float,
    k_host: torch.Tensor | None = None,  # [host blocks, block_size, Hkv, D]: the pool of HOST_BLOCK entries
    v_host: torch.Tensor | None = None,
    skips: torch.Tensor | None = None,  # [N] int32: each row's first skips[i] keys weigh 0 (a sliding window); None: none
) -> None:
    lib = kernels().lib
    assert lib is not None, "the native library is not loaded (check available())"
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    n = q_rows.shape[0]
    assert out_rows.shape[0] == n and tables.shape[0] == n and lens.shape[0] == n and tables.stride(1) == 1
    assert q_rows.dtype == out_rows.dtype == torch.int64 and tables.dtype == lens.dtype == torch.int32
    assert skips is None or (skips.dtype == torch.int32 and skips.shape[0] == n and skips.is_contiguous())
    if k_host is not None:
        assert v_host is not None and k_host.dtype == k_cache.dtype and k_host.shape[1:] == k_cache.shape[1:]
        assert k_host.is_contiguous() and v_host.is_contiguous() and k_host.device.type == "cpu"
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.stride(1) == 1 and lse.device.type == "cpu"
    # Few rows: split each one's heads so every thread has work; many: whole rows per item, so
    # each token's K/V row (all heads) is read as one contiguous run.
    threads = torch.get_num_threads()
    head_chunks = min(num_kv_heads, max(1, -(-2 * threads // max(n, 1))))
    rc = _fn(lib)(
        q.data_ptr(), DTYPE_CODE[q.dtype], q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        k_host.data_ptr() if k_host is not None else None, v_host.data_ptr() if v_host is not None else None,
        DTYPE_CODE[k_cache.dtype], out.data_ptr(), DTYPE_CODE[out.dtype], out.stride(0),
        lse.data_ptr() if lse is not None else None, lse.stride(0) if lse is not None else 0,
        q_rows.data_ptr(), out_rows.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        skips.data_ptr() if skips is not None else None, n,
        num_kv_heads, group, head_dim, block_size, scale, head_chunks,
    )
    if rc == -2:
        raise ValueError("paged_attention_rows: a block table names a host block (HOST_BLOCK) but no host pool was given")
    if rc != 0:
        raise MemoryError("paged_attention_rows: scratch allocation failed")
