"""A LoRA adapter's delta on a projection's output rows through `csrc/lora_delta.c`:
`y[rows] = round(y[rows] + (x[rows] A^T)(sB)^T)`, summed in fp32 and rounded once, with A and sB
given transposed (`at` [K, R], `bt` [R, N], fp32, contiguous; engine/lora.py keeps them).

Why native: a row's value then depends on that row alone, whatever the batch (torch's fp32 GEMM
picks its blocking by shape), and a decode step with an adapter is all native calls, which
`native.graph` records and replays. `add_rows` answers False where the kernel does not apply
(no library, not CPU, another dtype or layout, autograd): the caller computes it in torch.
"""
from __future__ import annotations

import torch

from cuttle.attention.native import kernels
from cuttle.attention.native.build import DTYPE_CODE


def add_rows(y: torch.Tensor, x: torch.Tensor, at: torch.Tensor, bt: torch.Tensor, rows: slice | torch.Tensor | None = None) -> bool:
    """In place on `y` [T, N] (x [T, K]): the delta on every row (`rows` None), a run of rows
    (a slice with step 1), or the rows an int64 index tensor names. False: nothing was done."""
    lib = kernels().lib
    if (lib is None or not (y.is_cpu and x.is_cpu and at.is_cpu and bt.is_cpu) or y.dtype not in DTYPE_CODE
            or x.dtype not in DTYPE_CODE or at.dtype != torch.float32 or bt.dtype != torch.float32
            or y.dim() != 2 or x.dim() != 2 or y.stride(1) != 1 or x.stride(1) != 1 or not at.is_contiguous()
            or not bt.is_contiguous() or at.shape[0] != x.shape[1] or bt.shape[0] != at.shape[1] or bt.shape[1] != y.shape[1]
            or x.shape[0] != y.shape[0] or (torch.is_grad_enabled() and (y.requires_grad or x.requires_grad))):
        return False
    idx, m, y0, x0 = 0, y.shape[0], y, x
    if isinstance(rows, slice):
        if rows.step not in (None, 1):
            return False
        y0, x0 = y[rows], x[rows]
        m = y0.shape[0]
    elif rows is not None:
        if rows.dtype != torch.int64 or rows.dim() != 1 or not rows.is_cpu or not rows.is_contiguous():
            return False
        idx, m = rows.data_ptr(), rows.shape[0]
    if m == 0:
        return True
    rc = lib.lora_add_rows(y0.data_ptr(), DTYPE_CODE[y.dtype], y.stride(0), x0.data_ptr(), DTYPE_CODE[x.dtype], x.stride(0),
                           idx or None, m, x.shape[1], y.shape[1], at.data_ptr(), at.shape[1], bt.data_ptr(), y.shape[0])
    if rc == -3:
        raise IndexError(f"LoRA rows out of range: rows are [0, {y.shape[0]})")
    if rc != 0:
        raise RuntimeError(f"lora_add_rows failed ({rc}): rank {at.shape[1]} (at most 4096) or out of memory")
    return True
