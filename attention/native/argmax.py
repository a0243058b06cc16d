"""Row-wise argmax on CPU (`csrc/argmax.c`): the sampler's greedy pick, which torch.argmax did
at ~4 GB/s over [64, 151936] fp32 logits. Same answer as torch.argmax, ties and NaN included;
torch.argmax wherever the kernel does not apply or the library is absent."""
from __future__ import annotations

import torch

from cuttle.attention.native import kernels


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for a 2-D CPU fp32 tensor with unit column stride (first index of
    the maximum; NaN counts as the maximum), natively where the library is present."""
    lib = kernels().lib
    if lib is None or x.dim() != 2 or x.device.type != "cpu" or x.dtype != torch.float32 or x.stride(-1) != 1 or x.shape[1] == 0:
        return torch.argmax(x, dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows_f32(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out


def argmax_into_if(want: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
    """out = argmax(x) when want[0] != 0 at the time of the call, else out untouched: one native
    call whose condition is read from memory, so a kernel graph can record it once and each replay
    decide (want: int32 [1]; x: 2-D fp32 CPU rows with unit column stride; out: int64 [rows])."""
    lib = kernels().lib
    if lib is None:
        raise RuntimeError("argmax_into_if needs the native CPU kernel library")
    if want.dtype != torch.int32 or want.numel() != 1 or x.dim() != 2 or x.dtype != torch.float32 or x.stride(-1) != 1:
        raise ValueError("argmax_into_if: want must be int32 [1] and x 2-D fp32 with unit column stride")
    if out.dtype != torch.int64 or out.shape != (x.shape[0],) or not out.is_contiguous():
        raise ValueError(f"argmax_into_if: out must be a contiguous int64 [{x.shape[0]}] tensor")
    lib.argmax_rows_f32_if(want.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
