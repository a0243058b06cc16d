"""A segmented step's query rotation and merge on CPU through `csrc/segment_merge.c`: the query
rows of parts whose keys sit `delta` positions from where they were rotated, turned by -delta in
place (`rotate_rows_`), and the parts' results merged per query row by their log-sum-exp
(`merge_parts`). Each answers False / None where the kernel does not take its tensors (other
devices, autograd, layouts it does not read, no library): the caller (attention/metadata.py
`SegmentBatch`) then runs the torch code it replaces (attention/rope.py `rotate_partial`,
attention/merge.py `merge_lse_rows`), whose arithmetic the kernels follow (fp32, one rounding,
parts summed in index order; exp / log within an ulp). Imports nothing of the attention backends.

Why native: in a decode step over squid's documents these were a dozen torch ops a layer, most of
the step's time on a small model, and with them native such a step is kernel calls only.
"""
from __future__ import annotations

import torch

from cuttle.attention.native import kernels
from cuttle.attention.native.build import DTYPE_CODE

MERGE_MAX_DIM = 1024  # csrc/segment_merge.c


def _plain(*ts: torch.Tensor) -> bool:
    """CPU tensors autograd need not see."""
    return all(t.is_cpu for t in ts) and (not torch.is_grad_enabled() or not any(t.requires_grad for t in ts))


def rotate_rows_(x: torch.Tensor, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """x[rows] = rotate_partial(x[rows], cos, sin) in place: x [N, H, D] contiguous, rows [R] int64,
    cos / sin [R, 1, half] fp32. False: nothing was done (the kernel does not take these)."""
    lib = kernels().lib
    half = cos.shape[-1]
    if (lib is None or x.dim() != 3 or not x.is_contiguous() or x.dtype not in DTYPE_CODE or rows.dtype != torch.int64
            or not rows.is_contiguous() or cos.dtype != torch.float32 or sin.dtype != torch.float32
            or not cos.is_contiguous() or not sin.is_contiguous() or cos.numel() != rows.shape[0] * half
            or sin.numel() != cos.numel() or not _plain(x, rows, cos, sin)):
        return False
    if 2 * half > x.shape[2]:
        raise ValueError(f"rotary dims {2 * half} exceed head_dim {x.shape[2]}")
    if lib.rotate_rows(x.data_ptr(), DTYPE_CODE[x.dtype], x.stride(0), rows.data_ptr(), rows.shape[0], x.shape[1], x.shape[2],
                       cos.data_ptr(), sin.data_ptr(), half) != 0:
        raise ValueError(f"rotate_rows: dtype {x.dtype} is not supported")
    return True


def merge_parts(
    o_parts: torch.Tensor,  # [V, H, D] fp32
    lse_parts: torch.Tensor,  # [V, H] fp32
    ptr: torch.Tensor,  # [T + 1] int64: output row r's parts are idx[ptr[r] : ptr[r + 1]]
    idx: torch.Tensor,  # [V] int64: the parts grouped by output row, in increasing order within each
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`merge_lse_rows` of the parts with o in `dtype`: (o [T, H, D], lse fp32 [T, H]); None where
    the kernel does not take these tensors."""
    lib = kernels().lib
    num_rows = ptr.shape[0] - 1
    if (lib is None or dtype not in DTYPE_CODE or o_parts.dtype != torch.float32 or lse_parts.dtype != torch.float32
            or not o_parts.is_contiguous() or not lse_parts.is_contiguous() or o_parts.dim() != 3
            or o_parts.shape[2] > MERGE_MAX_DIM or ptr.dtype != torch.int64 or idx.dtype != torch.int64
            or not ptr.is_contiguous() or not idx.is_contiguous() or not _plain(o_parts, lse_parts, ptr, idx)):
        return None
    _, heads, dim = o_parts.shape
    out = torch.empty(num_rows, heads, dim, dtype=dtype)
    lse = torch.empty(num_rows, heads, dtype=torch.float32)
    if lib.merge_parts(o_parts.data_ptr(), lse_parts.data_ptr(), ptr.data_ptr(), idx.data_ptr(), num_rows, heads, dim,
                       out.data_ptr(), DTYPE_CODE[dtype], lse.data_ptr()) != 0:
        raise ValueError(f"merge_parts: dtype {dtype} or head_dim {dim} is not supported")
    return out, lse
