"""Writes a checkpoint directory whose routed experts are stored in MXFP8, so serving it needs no
high-precision expert weights at all (`load_model` reads it back by its safetensors header).

Owns only the layout of such a directory: shard 1 holds every non-expert tensor exactly as the
source checkpoint has it, shard 2 the experts in `cuttle.moe.checkpoint`'s format (with its
header), plus a `model.safetensors.index.json` and the source's other files (config, tokenizer)
copied. It never quantizes: the experts written are the loaded model's own bytes, so a reload
gives a bit-identical model.
"""
from __future__ import annotations

import json
import os
import shutil

from safetensors.torch import save_file

from cuttle.engine.models.loader import is_expert_tensor, iter_tensors
from cuttle.engine.models.moe_quant import moe_layers
from cuttle.engine.models.transformer import CausalLM
from cuttle.moe.checkpoint import save_quantized_experts
from cuttle.moe.layer import QUANTIZED_NAMES

_DENSE_SHARD = "model-00001-of-00002.safetensors"
_EXPERT_SHARD = "model-00002-of-00002.safetensors"


def save_quantized_checkpoint(model: CausalLM, source: str, out: str) -> None:
    """`model` was loaded from the HF checkpoint `source` with moe_quant="mxfp8"; write it to `out`."""
    layers = moe_layers(model)
    if not layers or any(layer.quant != "mxfp8" for layer in layers.values()):
        raise ValueError("save_quantized_checkpoint needs a model whose MoE layers are all MXFP8 (load it with moe_quant='mxfp8')")
    os.makedirs(out, exist_ok=True)
    dense = {name: t.contiguous() for name, t in iter_tensors(source) if not is_expert_tensor(name)}
    save_file(dense, os.path.join(out, _DENSE_SHARD), metadata={"format": "pt"})
    experts = {f"model.layers.{i}.mlp.experts": layer for i, layer in layers.items()}
    save_quantized_experts(os.path.join(out, _EXPERT_SHARD), experts)
    weight_map = {name: _DENSE_SHARD for name in dense}
    weight_map.update({f"{prefix}.{field}": _EXPERT_SHARD for prefix in experts for field in QUANTIZED_NAMES})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    for name in os.listdir(source):
        src = os.path.join(source, name)
        if os.path.isfile(src) and not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            shutil.copy2(src, os.path.join(out, name))
