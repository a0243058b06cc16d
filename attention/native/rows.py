"""Row copies on CPU through `csrc/rows.c`: gather rows by index (the embedding lookup, the RoPE
table rows of a step), scatter rows into slots (a step's K/V into the paged cache), and widen bf16
to fp32 (the logits). Each is exactly the torch op it replaces (bytes are copied; bf16 -> fp32 is
exact), which stays the path on other devices, under autograd, for layouts the kernel does not
read, and without the library.

Why native: in a decode step these were a torch dispatch each, and with them native every op of
a plain decode step is a kernel call, which `native.graph` can record and replay.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from cuttle.attention.native import kernels


def _dense_rows(t: torch.Tensor) -> bool:
    """Rows along dim 0 whose remaining dims are one contiguous run (any row stride)."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _index_ok(idx: torch.Tensor) -> bool:
    return idx.dim() == 1 and idx.dtype == torch.int64 and idx.is_cpu and idx.is_contiguous()


def _no_grad(*ts: torch.Tensor) -> bool:
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in ts)


def gather(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """src[idx] for 1-D int64 `idx`: rows of `src` along dim 0, as a new contiguous tensor (for
    a 2-D src also F.embedding(idx, src)). An index outside [0, len(src)) raises IndexError."""
    lib = kernels().lib
    if lib is None or src.dim() < 1 or not src.is_cpu or not _index_ok(idx) or not _dense_rows(src) or not _no_grad(src):
        return F.embedding(idx, src) if src.dim() == 2 else src[idx]
    out = torch.empty((idx.shape[0], *src.shape[1:]), dtype=src.dtype)
    row_bytes = out[0].numel() * out.element_size() if idx.shape[0] else 0
    rc = lib.gather_rows(src.data_ptr(), src.shape[0], src.stride(0) * src.element_size(), idx.data_ptr(), idx.shape[0],
                         out.data_ptr(), row_bytes, row_bytes)
    if rc != 0:
        raise IndexError(f"index out of range: rows are [0, {src.shape[0]})")
    return out


def scatter_(dst: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """dst[idx[i]] = src[i] in place (`dst.index_copy_(0, idx, src)` for distinct indices): `dst`
    contiguous, `src` rows of the same shape and dtype. An index outside [0, len(dst)) raises
    IndexError and writes nothing."""
    lib = kernels().lib
    if (lib is None or not dst.is_cpu or not src.is_cpu or dst.dtype != src.dtype or dst.dim() < 1 or src.dim() != dst.dim()
            or src.shape[1:] != dst.shape[1:] or src.shape[0] != idx.shape[0] or not dst.is_contiguous() or not _index_ok(idx)
            or not _dense_rows(src) or not _no_grad(src, dst)):
        dst.index_copy_(0, idx, src)
        return
    row_bytes = dst[0].numel() * dst.element_size() if dst.shape[0] else 0
    rc = lib.scatter_rows(src.data_ptr(), src.stride(0) * src.element_size(), idx.data_ptr(), idx.shape[0], dst.data_ptr(),
                          dst.shape[0], row_bytes, row_bytes)
    if rc != 0:
        raise IndexError(f"index out of range: rows are [0, {dst.shape[0]})")


def to_float(x: torch.Tensor) -> torch.Tensor:
    """x.float(): a 2-D CPU bf16 tensor with unit column stride is widened natively into a new
    contiguous fp32 tensor; anything else is `x.float()` itself."""
    lib = kernels().lib
    if lib is None or x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_cpu or x.stride(1) != 1 or not _no_grad(x):
        return x.float()
    out = torch.empty(x.shape, dtype=torch.float32)
    lib.widen_bf16_rows(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), x.shape[0], x.shape[1])
    return out
