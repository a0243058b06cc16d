"""MXFP8 routed experts on CPU through the native MXFP8 GEMM (`cuttle.attention.native.mxfp8`).

Owns the expert loop for MXFP8 weights on CPU: the same structure as the torch path
(`experts_torch.py`: sort once, gather token rows once, two GEMMs per *active* expert, fp32
combine) with each GEMM reading the expert's E4M3 bytes and E8M0 scales as stored, so no
dequantized copy of an expert is ever made and decode reads 8.25 bits a weight. silu * up is the
fused CPU kernel (bit-identical to torch's). The torch path stays the reference and the fallback
(activation quantization, autograd, non-CPU tensors, no kernel library). Element NaN bytes outside
NaN blocks are refused once per weight version (`check_nan_elements`), not per call.
Must never import `cuttle.engine`.
"""
from __future__ import annotations

import torch

from cuttle.attention.native import mxfp8 as native_mx
from cuttle.attention.native.fused import silu_mul
from cuttle.moe.align import align_tokens
from cuttle.moe.mxfp8 import MXTensor

_CHECKED = "_cuttle_mx_checked"  # on the data tensor: (version, ptr) that passed check_nan_elements


def supports(x: torch.Tensor, w13: object, w2: object, act_quant: object = None) -> bool:
    """Whether this call may take the native MXFP8 expert loop."""
    return (
        isinstance(w13, MXTensor) and isinstance(w2, MXTensor) and act_quant is None
        and x.device.type == "cpu" and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16)
        and w13.data.device.type == "cpu" and w13.data.is_contiguous() and w2.data.is_contiguous()
        and w13.scale.is_contiguous() and w2.scale.is_contiguous()
        and not (torch.is_grad_enabled() and x.requires_grad)
        and native_mx.available()
    )


def _checked(w: MXTensor) -> None:
    key = (w.data._version, w.data.data_ptr(), w.scale._version)
    if getattr(w.data, _CHECKED, None) != key:
        native_mx.check_nan_elements(w.data, w.scale)
        setattr(w.data, _CHECKED, key)


def fused_experts_mxfp8_cpu(
    x: torch.Tensor, w13: MXTensor, w2: MXTensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] and w2 [E, H, I] in MXFP8, weights/ids [T, k] -> [T, H] in x's dtype."""
    T, H = x.shape
    k = ids.shape[1]
    _checked(w13)
    _checked(w2)
    aligned = align_tokens(ids, w13.shape[0], block_size=1)
    offsets = aligned.expert_offsets.tolist()
    order = aligned.sorted_ids[: T * k].long()
    xs = x[order // k]
    ys = torch.empty(T * k, H, dtype=x.dtype)
    for e in range(w13.shape[0]):
        start, end = offsets[e], offsets[e + 1]
        if start == end:
            continue
        gate_up = native_mx.linear(xs[start:end], w13.data[e], w13.scale[e])
        native_mx.linear(silu_mul(gate_up), w2.data[e], w2.scale[e], out=ys[start:end])
    y = torch.empty_like(ys)
    y[order] = ys
    return (y.view(T, k, H).float() * weights.float().unsqueeze(-1)).sum(dim=1).to(x.dtype)
