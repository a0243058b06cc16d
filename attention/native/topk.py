"""Training-free top-k decode on CPU: the Python binding of `csrc/topk_decode.c`
(`topk_decode_rows`), called by the top-k backend for every query row on CPU (a prefill row is a
query token with its own key count, like a decode row); tested against the torch
reference (`cuttle.attention.topk`).

One call attends one query token per row against its sequence's paged K/V, choosing the row's
blocks itself from the block summaries, writes o and the log-sum-exp, and can report the blocks it
chose and how many K/V tokens it read per (row, KV head). Block-table entries flagged `HOST_BLOCK`
name blocks of the host pool (the KV host tier's caches and summaries, passed beside the device
ones), read in place. Which library runs is the process's
`KernelSet` (`cuttle.attention.native.kernels()`); this module declares the C signature and packs
arguments.
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from cuttle.attention.native import available as native_available
from cuttle.attention.native import kernels, supports_rows
from cuttle.attention.native.build import DTYPE_CODE

if TYPE_CHECKING:  # the config is only an annotation here: the kernel library stays free of the backends
    from cuttle.attention.topk import TopKConfig

__all__ = ["available", "supports", "topk_decode", "set_fast_path", "set_dot_path"]

_vp, _i64, _int, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGTYPES = [
    _vp, _int, _i64, _vp, _vp, _vp,  # q, q dtype, q row stride, k, v, summaries
    _vp, _vp, _vp, _int,  # the host pool's k, v, summaries (read in place; NULL: none), kv dtype
    _vp, _int, _i64, _vp, _i64,  # out, out dtype, out row stride, lse, lse row stride
    _vp, _vp, _i64, _vp, _i64,  # rows, tables, table stride, lens, num rows
    _i64, _i64, _i64, _i64, _i64, _i64,  # kv heads, group, head_dim, block_size, summary slots per block, summary rows
    _i64, _i64, _i64, _i64,  # P, blocks attended, init, local
    _i64, _float, _i64, _vp, _vp,  # max_len, scale, head chunks, selected, touched
]
_declared: ctypes.CDLL | None = None


def _fn(lib: ctypes.CDLL):
    global _declared
    fn = lib.topk_decode_rows
    if _declared is not lib:
        fn.argtypes, fn.restype = _ARGTYPES, _int
        lib.sparse_attend_set_fast_path.argtypes, lib.sparse_attend_set_fast_path.restype = [_int], None
        lib.sparse_attend_fast_available.argtypes, lib.sparse_attend_fast_available.restype = [], _int
        lib.sparse_attend_set_dot_path.argtypes, lib.sparse_attend_set_dot_path.restype = [_int], _int
        _declared = lib
    return fn


available = native_available


def set_fast_path(enabled: bool) -> bool:
    """Switch the sparse kernels' vector loops (AVX2, and the bf16 dot loop where built) off for
    the scalar loops, or back on (tests compare them); returns whether this build has the AVX2
    loop at all."""
    lib = kernels().lib
    assert lib is not None
    _fn(lib)
    lib.sparse_attend_set_fast_path(int(enabled))
    return bool(lib.sparse_attend_fast_available())


def set_dot_path(enabled: bool) -> bool:
    """Switch the sparse kernels' bf16-dot loop (AVX512-BF16 builds: bf16 rows and caches, head_dim
    64/128/256) on or off, so that tests and timings can compare it with the AVX2 loop; returns
    whether it is now in use (False where this build has none)."""
    lib = kernels().lib
    assert lib is not None
    _fn(lib)
    return bool(lib.sparse_attend_set_dot_path(int(enabled)))


supports = supports_rows  # the same tensor rules for every native attention kernel


def topk_decode(
    q: torch.Tensor,  # [*, H, D] rows dense
    k_cache: torch.Tensor,  # [num_blocks, B, Hkv, D]
    v_cache: torch.Tensor,
    summ: torch.Tensor,  # [num_blocks, S, R, Hkv, D] block summaries (topk_backend.py's layout)
    out: torch.Tensor,  # [*, H, D] contiguous, written at `rows`
    lse: torch.Tensor | None,  # [*, H] fp32, unit head stride, written at `rows`
    rows: torch.Tensor,  # [N] int64 row of q / out of each decode token
    tables: torch.Tensor,  # [N, nb] int32 raw block ids (also the summary cache's)
    lens: torch.Tensor,  # [N] int32 keys of each row, the query's own included (>= 1)
    cfg: TopKConfig,
    scale: float,
    selected: torch.Tensor | None = None,  # [N, Hkv, n] int32 out: chosen blocks, rank order, -1 padded
    touched: torch.Tensor | None = None,  # [N, Hkv] int64 out: K/V tokens read
    host: tuple[torch.Tensor, ...] | None = None,  # the host pool's (k, v, summaries), same layouts: HOST_BLOCK ids
) -> None:
    lib = kernels().lib
    assert lib is not None, "the native library is not loaded (check available())"
    _, block_size, hkv, dim = k_cache.shape
    n = rows.shape[0]
    assert summ.shape[2] == cfg.summary_rows and summ.shape[3:] == k_cache.shape[2:] and summ.dtype == k_cache.dtype
    assert summ.is_contiguous() and v_cache.is_contiguous()
    hp = [None] * 3
    if host is not None:
        for h, d in zip(host, (k_cache, v_cache, summ)):
            assert h.dtype == d.dtype and h.shape[1:] == d.shape[1:] and h.is_contiguous() and h.device.type == "cpu"
        hp = [h.data_ptr() for h in host]
    assert rows.dtype == torch.int64 and tables.dtype == lens.dtype == torch.int32 and tables.stride(1) == 1
    assert tables.shape[0] == lens.shape[0] == n and bool((lens >= 1).all())
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.stride(1) == 1
    if selected is not None:
        assert selected.dtype == torch.int32 and selected.is_contiguous() and selected.shape == (n, hkv, cfg.num_blocks)
    if touched is not None:
        assert touched.dtype == torch.int64 and touched.is_contiguous() and touched.shape == (n, hkv)
    # Few rows: split each one's KV heads so every thread has work; many: all heads per item, so
    # each summary (and key, within the budget) is read as one contiguous run (topk_decode.c)
    threads = torch.get_num_threads()
    head_chunks = min(hkv, max(1, -(-2 * threads // max(n, 1))))
    rc = _fn(lib)(
        q.data_ptr(), DTYPE_CODE[q.dtype], q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), summ.data_ptr(), *hp,
        DTYPE_CODE[k_cache.dtype], out.data_ptr(), DTYPE_CODE[out.dtype], out.stride(0),
        lse.data_ptr() if lse is not None else None, lse.stride(0) if lse is not None else 0,
        rows.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(), n,
        hkv, q.shape[1] // hkv, dim, block_size, summ.shape[1], cfg.summary_rows, cfg.block, cfg.num_blocks,
        cfg.init_blocks, cfg.local_blocks, int(lens.max()), scale, head_chunks,
        selected.data_ptr() if selected is not None else None, touched.data_ptr() if touched is not None else None,
    )
    if rc == -2:
        raise ValueError("topk_decode: a block table names a host block (HOST_BLOCK) but no host pool was given")
    if rc != 0:
        raise MemoryError("topk_decode_rows: scratch allocation failed")
