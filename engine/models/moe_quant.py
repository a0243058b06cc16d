"""MXFP8 routed experts inside the engine's models.

Also owns the engine-wide switch between a model's experts held packed for the native kernels
(`pack_experts`: at load and after every weight update, by the model runner) and held plain
(`unpack_experts`: the loader's first step, since weights are written into plain tensors).

Owns two steps: turning every `FusedMoE` of a freshly built model into its MXFP8 form before any
weight arrives (`prepare_quantized_experts`), and writing expert tensors into such a layer
(`write_quantized`): high-precision tensors are cast to the model dtype and quantized exactly as
`FusedMoE.quantize_` would (blocks of 32 along the reduction dim, rows independent, so quantizing
one expert's gate rows alone gives the same bytes), already-quantized ones are copied. Loading a
checkpoint, quantizing at load and a trainer's weight update all go through `write_quantized`, so
they agree bit for bit. The MXFP8 format itself belongs to `cuttle.moe`; this module never touches
non-expert weights.
"""
from __future__ import annotations

import torch

from cuttle.engine.models.transformer import CausalLM
from cuttle.moe import FusedMoE, quantize_mxfp8

_SCALE_MODE = "floor"  # FusedMoE.quantize_'s default: the OCP spec's rule


def moe_layers(model: CausalLM) -> dict[int, FusedMoE]:
    return {i: layer.mlp for i, layer in enumerate(model.layers) if isinstance(layer.mlp, FusedMoE)}


def pack_experts(model: CausalLM) -> int:
    """Pack every routed-expert layer for the native kernels now and drop its plain copy
    (`FusedMoE.pack_`); returns how many layers were packed (0 where the native path is off)."""
    return sum(layer.pack_() for layer in moe_layers(model).values())


def unpack_experts(model: CausalLM, layers: set[int] | None = None) -> None:
    """Give every packed routed-expert layer (or those of `layers`) its plain tensors back
    (exact), e.g. before a write."""
    for i, layer in moe_layers(model).items():
        if layers is None or i in layers:
            layer.unpack_()


def prepare_quantized_experts(model: CausalLM, mode: str = "mxfp8") -> None:
    """Replace each FusedMoE's high-precision expert weights by (unfilled) MXFP8 buffers."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"moe_quant={mode!r} was asked for, but this {model.cfg.architecture} model has no MoE layers")
    if mode != "mxfp8":
        raise ValueError(f"unsupported MoE quantization {mode!r}")
    for layer in layers.values():
        E, I, H = layer.routing.num_experts, layer.intermediate_size, layer.hidden_size
        layer.load_quantized_({
            "w13_mx": torch.empty(E, 2 * I, H, dtype=torch.float8_e4m3fn),
            "w13_scale": torch.empty(E, 2 * I, H // 32, dtype=torch.float8_e8m0fnu),
            "w2_mx": torch.empty(E, H, I, dtype=torch.float8_e4m3fn),
            "w2_scale": torch.empty(E, H, I // 32, dtype=torch.float8_e8m0fnu),
        })


def write_quantized(
    layer: FusedMoE, which: str, src: torch.Tensor, index: int | None = None, rows: slice | None = None,
    check_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a high-precision `src` (one expert's rows, one expert, or all experts of `which`,
    "w13" or "w2") into the layer's MXFP8 buffers. Returns the (data, scale) views written, for
    coverage accounting. Raises on a shape mismatch; `check_only`: only that, nothing written."""
    data, scale = getattr(layer, which + "_mx"), getattr(layer, which + "_scale")
    if index is not None:
        data, scale = data[index], scale[index]
    if rows is not None:
        data, scale = data[rows], scale[rows]
    if tuple(data.shape) != tuple(src.shape):
        raise ValueError(f"expert tensor has shape {tuple(src.shape)}, the layer expects {tuple(data.shape)}")
    if check_only:
        return data, scale
    dtype = layer.gate_weight.dtype  # quantize what quantize_ would see: the model-dtype weight
    stacked = (data, scale, src) if src.dim() == 3 else (data[None], scale[None], src[None])
    with torch.no_grad():
        for dst_data, dst_scale, w in zip(*stacked):  # one expert at a time: small temporaries
            q, q_scale = quantize_mxfp8(w.to(device=dst_data.device, dtype=dtype), 32, _SCALE_MODE)
            dst_data.copy_(q)
            dst_scale.copy_(q_scale)
    return data, scale
