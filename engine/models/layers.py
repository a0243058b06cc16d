"""Building blocks shared by the attention variants and the decoder: RMSNorm with HF semantics and
the uninitialized, frozen parameter every model weight starts as (the loader fills it).

RMSNorm runs through `cuttle.attention.native.fused.rms_norm`: one native kernel on CPU tensors
(bit-identical to the torch formula), the torch formula elsewhere and under autograd.

Owns no model structure and never reads a config.
"""
from __future__ import annotations

import torch
from torch import nn

from cuttle.attention.native.fused import rms_norm


class RMSNorm(nn.Module):
    """HF semantics: normalize in fp32, cast back, then scale by the weight."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
