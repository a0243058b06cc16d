"""NSA decode on CPU: the Python binding of `csrc/nsa_decode.c` (`nsa_decode_rows`), called by the
NSA backend for every query row on CPU (a prefill row is a query token with its own key count,
like a decode row); tested against the torch reference (`cuttle.attention.nsa`).

One call attends one query token per row against its sequence's paged raw and compressed caches,
choosing the row's blocks itself, and can report the blocks it chose and how many KV tokens it
read per (row, KV head). Block-table entries flagged `HOST_BLOCK` name blocks of the host pool
(the KV host tier's raw and compressed caches, passed beside the device ones), read in place.
Which library runs is the process's `KernelSet`
(`cuttle.attention.native.kernels()`); this module declares the C signature and packs arguments.
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from cuttle.attention.native import available as native_available
from cuttle.attention.native import HOST_BLOCK, kernels, supports_rows
from cuttle.attention.native.build import DTYPE_CODE

if TYPE_CHECKING:  # the config is only an annotation here: the kernel library stays free of the backends
    from cuttle.attention.nsa import NSAConfig

__all__ = ["available", "supports", "nsa_decode"]

_vp, _i64, _int, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGTYPES = [
    _vp, _int, _i64, _vp, _vp, _vp, _vp,  # q, q dtype, q row stride, k, v, ck, cv
    _vp, _vp, _vp, _vp, _int,  # the host pool's k, v, ck, cv (read in place; NULL: none), kv dtype
    _vp, _i64, _vp, _int, _i64,  # gates, gate row stride, out, out dtype, out row stride
    _vp, _vp, _i64, _vp, _i64,  # rows, tables, table stride, lens, num rows
    _i64, _i64, _i64, _i64, _i64,  # kv heads, group, head_dim, block_size, compressed slots per block
    _i64, _i64, _i64, _i64, _i64, _i64, _i64,  # l, d, l', top_n, init, local, window
    _i64, _float, _i64, _vp, _vp,  # max_len, scale, head chunks, selected, touched
    _vp, _vp,  # branch_out, branch_lse (a squid part's branches apart; NULL: the gated sum)
]
_declared: ctypes.CDLL | None = None


def _fn(lib: ctypes.CDLL):
    global _declared
    fn = lib.nsa_decode_rows
    if _declared is not lib:
        fn.argtypes, fn.restype = _ARGTYPES, _int
        _declared = lib
    return fn


available = native_available


supports = supports_rows  # the same tensor rules for every native attention kernel


def nsa_decode(
    q: torch.Tensor,  # [*, H, D] rows dense
    k_cache: torch.Tensor,  # [num_blocks, B, Hkv, D]
    v_cache: torch.Tensor,
    ck_cache: torch.Tensor,  # [num_blocks, S_c, Hkv, D] compressed entries (nsa_backend.py's layout)
    cv_cache: torch.Tensor,
    gates: torch.Tensor | None,  # [*, H, 3]; None with `branches`
    out: torch.Tensor | None,  # [*, H, D] contiguous, written at `rows`; None with `branches`
    rows: torch.Tensor,  # [N] int64 row of q / gates / out of each decode token
    tables: torch.Tensor,  # [N, nb] int32 raw block ids (also the compressed cache's)
    lens: torch.Tensor,  # [N] int32 keys of each row, the query's own included (>= 1)
    cfg: NSAConfig,
    scale: float,
    selected: torch.Tensor | None = None,  # [N, Hkv, top_n] int32 out: chosen blocks, rank order, -1 padded
    touched: torch.Tensor | None = None,  # [N, Hkv] int64 out: KV tokens read
    host: tuple[torch.Tensor, ...] | None = None,  # the host pool's (k, v, ck, cv), same layouts: HOST_BLOCK ids
    branches: tuple[torch.Tensor, torch.Tensor] | None = None,  # out: fp32 ([*, H, 3, D], [*, H, 3]) at `rows`
) -> None:
    """Attend every row; write the gated sum to `out`, or with `branches` the three branches apart
    (normalised) and their log-sum-exps (-inf for a branch with no key), for the caller to merge
    over a row's squid parts before gating."""
    lib = kernels().lib
    assert lib is not None, "the native library is not loaded (check available())"
    _, block_size, hkv, dim = k_cache.shape
    n = rows.shape[0]
    assert ck_cache.shape[2:] == k_cache.shape[2:] and ck_cache.dtype == k_cache.dtype and ck_cache.is_contiguous()
    # the kernel names a compressed entry by its int32 row in [blocks * slots, Hkv, D], HOST_BLOCK-flagged
    assert ck_cache.shape[0] * ck_cache.shape[1] < HOST_BLOCK, "compressed cache rows must fit below HOST_BLOCK"
    hp = [None] * 4
    if host is not None:
        for h, d in zip(host, (k_cache, v_cache, ck_cache, cv_cache)):
            assert h.dtype == d.dtype and h.shape[1:] == d.shape[1:] and h.is_contiguous() and h.device.type == "cpu"
        assert host[2].shape[0] * host[2].shape[1] < HOST_BLOCK, "host compressed cache rows must fit below HOST_BLOCK"
        hp = [h.data_ptr() for h in host]
    assert rows.dtype == torch.int64 and tables.dtype == lens.dtype == torch.int32 and tables.stride(1) == 1
    assert tables.shape[0] == lens.shape[0] == n and bool((lens >= 1).all())
    if branches is not None:
        bo, bl = branches
        assert bo.dtype == bl.dtype == torch.float32 and bo.is_contiguous() and bl.is_contiguous()
        assert bo.shape[1:] == (q.shape[1], 3, dim) and bl.shape == bo.shape[:3] and bo.shape[0] == q.shape[0]
        g, out_ptr, out_dtype, out_stride = None, None, DTYPE_CODE[torch.float32], 0
    else:
        assert gates is not None and out is not None
        g, out_ptr, out_dtype, out_stride = gates.float().contiguous(), out.data_ptr(), DTYPE_CODE[out.dtype], out.stride(0)
    if selected is not None:
        assert selected.dtype == torch.int32 and selected.is_contiguous() and selected.shape == (n, hkv, cfg.top_n)
    if touched is not None:
        assert touched.dtype == torch.int64 and touched.is_contiguous() and touched.shape == (n, hkv)
    # Few rows: split each one's KV heads so every thread has work; many: all heads per item, so
    # each compressed entry and window key is read as one contiguous run (nsa_decode.c)
    threads = torch.get_num_threads()
    head_chunks = min(hkv, max(1, -(-2 * threads // max(n, 1))))
    rc = _fn(lib)(
        q.data_ptr(), DTYPE_CODE[q.dtype], q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), ck_cache.data_ptr(),
        cv_cache.data_ptr(), *hp, DTYPE_CODE[k_cache.dtype], None if g is None else g.data_ptr(),
        0 if g is None else g.stride(0), out_ptr, out_dtype, out_stride, rows.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(), n,
        hkv, q.shape[1] // hkv, dim, block_size, ck_cache.shape[1], cfg.compress_block, cfg.compress_stride,
        cfg.select_block, cfg.top_n, cfg.init_blocks, cfg.local_blocks, cfg.window, int(lens.max()), scale, head_chunks,
        selected.data_ptr() if selected is not None else None, touched.data_ptr() if touched is not None else None,
        None if branches is None else branches[0].data_ptr(), None if branches is None else branches[1].data_ptr(),
    )
    if rc == -2:
        raise ValueError("nsa_decode: a block table names a host block (HOST_BLOCK) but no host pool was given")
    if rc != 0:
        raise MemoryError("nsa_decode_rows: scratch allocation failed")
