"""The sampler's token-mask apply on CPU (`csrc/token_mask.c`): every logit whose bit is clear in
its row's bitmask (xgrammar's layout, bit t of word w = token 32 w + t) becomes -inf, in place.
Same result as the torch path in `engine/sampler.py`, which stays the fallback for other dtypes,
devices, layouts, or a process without the kernel library."""
from __future__ import annotations

import torch

from cuttle.attention.native import kernels


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> bool:
    """Mask `logits[rows[k]]` by `bitmask[k]` natively; False (nothing done) when the kernel does
    not apply: not a CPU fp32 2-D tensor with unit column stride, a bitmask that is not a
    contiguous int32 [len(rows), >= ceil(vocab / 32)], or no library."""
    lib = kernels().lib
    if (lib is None or logits.dim() != 2 or logits.device.type != "cpu" or logits.dtype != torch.float32
            or logits.stride(-1) != 1 or bitmask.dtype != torch.int32 or bitmask.dim() != 2
            or not bitmask.is_contiguous() or bitmask.shape[0] != len(rows) or bitmask.shape[1] * 32 < logits.shape[1]):
        return False
    n = logits.shape[0]
    if any(not 0 <= r < n for r in rows):
        raise IndexError(f"token mask rows {rows} out of range for {n} logits rows")
    idx = torch.tensor(rows, dtype=torch.int64)
    lib.apply_token_bitmask_f32(logits.data_ptr(), logits.stride(0), logits.shape[1], idx.data_ptr(), len(rows),
                                bitmask.data_ptr(), bitmask.shape[1])
    return True
