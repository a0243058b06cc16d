"""On-disk format of already-quantized (MXFP8) routed experts, and its save/load helpers.

Owns the tensor names and the safetensors header keys; the engine's loader calls these helpers
(or `parse_quantized_name` + `FusedMoE.load_quantized_`) and owns everything else in a checkpoint.
Never imports `cuttle.engine`.

Format: safetensors, one group of four tensors per MoE layer, `<prefix>` being the layer's experts
module as the checkpoint names it (e.g. `model.layers.3.mlp.experts`):
  <prefix>.w13_mx     float8_e4m3fn   [E, 2*I, H]   gate_proj rows, then up_proj rows
  <prefix>.w13_scale  float8_e8m0fnu  [E, 2*I, H/32]
  <prefix>.w2_mx      float8_e4m3fn   [E, H, I]     down_proj
  <prefix>.w2_scale   float8_e8m0fnu  [E, H, I/32]
header metadata: cuttle_moe_quant = "mxfp8", cuttle_mx_block_size = "32". The scale rule used
(floor or rceil) needs no record: dequantization is the same for both.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cuttle.moe.layer import QUANTIZED_NAMES, FusedMoE

QUANT_KEY = "cuttle_moe_quant"
BLOCK_KEY = "cuttle_mx_block_size"
_DTYPES = {"w13_mx": torch.float8_e4m3fn, "w2_mx": torch.float8_e4m3fn,
           "w13_scale": torch.float8_e8m0fnu, "w2_scale": torch.float8_e8m0fnu}


def is_quantized_checkpoint(metadata: Mapping[str, str] | None) -> bool:
    """Whether a safetensors header says its experts are MXFP8 in this format."""
    return metadata is not None and metadata.get(QUANT_KEY) == "mxfp8"


def parse_quantized_name(name: str) -> tuple[str, str] | None:
    """`model.layers.3.mlp.experts.w13_mx` -> (`model.layers.3.mlp.experts`, `w13_mx`); None otherwise."""
    prefix, _, field = name.rpartition(".")
    return (prefix, field) if prefix and field in QUANTIZED_NAMES else None


def save_quantized_experts(path: str | Path, layers: Mapping[str, FusedMoE]) -> None:
    """Write the MXFP8 experts of `layers` (prefix -> quantized layer) to one safetensors file."""
    tensors: dict[str, torch.Tensor] = {}
    for prefix, layer in layers.items():
        if layer.quant != "mxfp8":
            raise ValueError(f"layer {prefix!r} is not MXFP8-quantized; call quantize_('mxfp8') first")
        w13, w2 = layer.expert_weights()  # unpacked copies for a layer held packed
        for field, t in zip(QUANTIZED_NAMES, (w13.data, w13.scale, w2.data, w2.scale)):
            tensors[f"{prefix}.{field}"] = t.contiguous().cpu()
    save_file(tensors, str(path), metadata={QUANT_KEY: "mxfp8", BLOCK_KEY: "32"})


def load_quantized_experts(path: str | Path, layers: Mapping[str, FusedMoE]) -> None:
    """Fill every layer of `layers` (prefix -> FusedMoE) from a file written by `save_quantized_experts`."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        if not is_quantized_checkpoint(metadata) or metadata.get(BLOCK_KEY) != "32":
            raise ValueError(f"{path} is not an MXFP8 expert checkpoint (header {metadata})")
        for name in f.keys():
            parsed = parse_quantized_name(name)
            if parsed is None:
                continue
            prefix, field = parsed
            if prefix not in layers:
                raise ValueError(f"{path} has experts {prefix!r} that no layer takes")
            tensor = f.get_tensor(name)
            if tensor.dtype != _DTYPES[field]:
                raise ValueError(f"{name} is {tensor.dtype}, expected {_DTYPES[field]}")
            groups.setdefault(prefix, {})[field] = tensor
    for prefix, layer in layers.items():
        fields = groups.get(prefix, {})
        missing = [f for f in QUANTIZED_NAMES if f not in fields]
        if missing:
            raise ValueError(f"{path} lacks {missing} for {prefix!r}")
        layer.load_quantized_(fields)
