"""cuttle.moe: routers, token-to-expert alignment, grouped expert GEMMs, MXFP8 quantization.

A kernel library: imports only torch (and triton, lazily, for the CUDA / interpreter kernels),
never `cuttle.engine`. Start with docs/moe.md.
"""
from cuttle.moe.align import AlignedTokens, align_tokens
from cuttle.moe.layer import FusedMoE
from cuttle.moe.mxfp8 import MXTensor, dequantize_mxfp8, quantize_mxfp8
from cuttle.moe.routing import RoutingConfig, is_moe_layer, route
from cuttle.moe.shared import SharedExpert

__all__ = [
    "AlignedTokens",
    "FusedMoE",
    "MXTensor",
    "RoutingConfig",
    "SharedExpert",
    "align_tokens",
    "dequantize_mxfp8",
    "is_moe_layer",
    "quantize_mxfp8",
    "route",
]
