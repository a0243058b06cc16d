"""cuttle.moe: routers, token-to-expert alignment, grouped expert GEMMs, MXFP8 quantization.

A kernel library: imports only torch (and triton where present), never `cuttle.engine`.
"""
from cuttle.moe.layer import FusedMoE, RoutingConfig, route

__all__ = ["FusedMoE", "RoutingConfig", "route"]
