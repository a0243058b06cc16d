"""Building blocks shared by the attention variants and the decoder: RMSNorm with HF semantics,
LayerNorm with a bias (StarCoder2), and the uninitialized, frozen parameter every model weight
starts as (the loader fills it).

RMSNorm runs through `cuttle.attention.native.fused.rms_norm`: one native kernel on CPU tensors
(bit-identical to the torch formula), the torch formula elsewhere and under autograd. LayerNorm
runs through `fused.layer_norm` (within an fp32 ulp or two of torch's `layer_norm`, not its bits;
torch's own elsewhere and under autograd). Both take the residual add that precedes them (`add`):
one fused kernel for RMSNorm, the native add then the norm for LayerNorm.

Owns no model structure and never reads a config.
"""
from __future__ import annotations

import torch
from torch import nn

from cuttle.attention.native.fused import add, add_rms_norm, layer_norm, rms_norm


class RMSNorm(nn.Module):
    """HF semantics: normalize in fp32, cast back, then scale by the weight."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, the norm of it), in one pass."""
        return add_rms_norm(x, delta, self.weight, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim with weight and bias (transformers' `nn.LayerNorm`)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = add(x, delta)
        return x, self(x)


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
