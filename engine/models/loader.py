"""Builds a model from an HF checkpoint directory: architecture check, safetensors (single file
or sharded index, memory-mapped), HF tensor names sliced into the fused parameters.

Owns the name mapping from HF layouts to `CausalLM`. Every parameter must be filled exactly once
from a tensor of the right shape; anything else is a clear error naming the tensor.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open

from cuttle.engine.config import ModelConfig
from cuttle.engine.models.transformer import CausalLM


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise FileNotFoundError(f"checkpoint {path!r} is missing shards listed in its index: {missing}")
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"checkpoint {path!r} has no *.safetensors weights")
    return [os.path.join(path, f) for f in found]


def iter_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class _Filler:
    """Copies checkpoint tensors into (slices of) parameters and records what was covered."""

    def __init__(self, model: CausalLM):
        self.model = model
        self.filled: dict[str, int] = {}  # parameter name -> number of elements filled

    def put(self, name: str, param: torch.Tensor, src: torch.Tensor, ckpt_name: str, rows: slice | None = None, index: int | None = None) -> None:
        dst = param
        if index is not None:
            dst = dst[index]
        if rows is not None:
            dst = dst[rows]
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"shape mismatch for {ckpt_name!r}: checkpoint has {tuple(src.shape)}, model expects {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(src)
        self.filled[name] = self.filled.get(name, 0) + src.numel()


def load_model(path: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    model = CausalLM(cfg, dtype, device)
    load_weights(model, iter_tensors(path), strict=True, source=path)
    return model.to(device)


def load_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = False, source: str = "weights") -> list[str]:
    """Copy HF-named tensors into the model's (fused) parameters, in place.

    `strict`: every parameter must be covered (loading a checkpoint); otherwise any subset may be
    given (a weight update). Returns the names that have no place in this model and were skipped
    (e.g. `rotary_emb.inv_freq` buffers of old checkpoints); a name that maps to a parameter but
    has the wrong shape is an error.
    """
    cfg = model.cfg
    params = dict(model.named_parameters(remove_duplicate=False))
    filler = _Filler(model)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qkv_rows = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
    unused: list[str] = []
    for name, t in tensors:
        if name == "model.embed_tokens.weight":
            filler.put("embed", params["embed"], t, name)
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                filler.put("lm_head", params["lm_head"], t, name)
        elif name == "model.norm.weight":
            filler.put("norm.weight", params["norm.weight"], t, name)
        elif (m := _LAYER.match(name)) is not None:
            i, rest = int(m.group(1)), m.group(2)
            if i >= cfg.num_layers:
                raise ValueError(f"tensor {name!r} is for layer {i} but the config has {cfg.num_layers} layers")
            p = f"layers.{i}."
            mi = cfg.moe_intermediate_size
            if (e := _EXPERT.match(rest)) is not None:
                eid, kind = int(e.group(1)), e.group(2)
                if p + "mlp.w2" not in params:
                    raise ValueError(f"tensor {name!r} is an expert weight but layer {i} is not a MoE layer here")
                if kind == "down_proj":
                    filler.put(p + "mlp.w2", params[p + "mlp.w2"], t, name, index=eid)
                else:
                    rows = slice(0, mi) if kind == "gate_proj" else slice(mi, 2 * mi)
                    filler.put(p + "mlp.w13", params[p + "mlp.w13"], t, name, rows=rows, index=eid)
                continue
            target = _layer_target(rest)
            if target is None:
                unused.append(name)
                continue
            pname, rows = target
            if pname.endswith("qkv_weight") or pname.endswith("qkv_bias"):
                rows = qkv_rows[rows]
            elif pname.endswith("gate_up_weight"):
                inter = cfg.intermediate_size
                rows = slice(0, inter) if rows == "gate" else slice(inter, 2 * inter)
            if p + pname not in params:
                raise ValueError(f"tensor {name!r} has no place in a {cfg.architecture} model")
            filler.put(p + pname, params[p + pname], t, name, rows=rows)
        else:
            unused.append(name)
    if strict:
        missing = [n for n, prm in params.items() if filler.filled.get(n, 0) != prm.numel() and not (cfg.tie_word_embeddings and n == "lm_head")]
        if missing:
            raise ValueError(f"checkpoint {source!r} does not provide: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    return unused


def _layer_target(rest: str) -> tuple[str, object] | None:
    """Maps the part of an HF name after `model.layers.N.` to (parameter, slice key)."""
    table: dict[str, tuple[str, object]] = {
        "input_layernorm.weight": ("input_norm.weight", None),
        "post_attention_layernorm.weight": ("post_attn_norm.weight", None),
        "self_attn.o_proj.weight": ("attn.o_weight", None),
        "self_attn.q_norm.weight": ("attn.q_norm.weight", None),
        "self_attn.k_norm.weight": ("attn.k_norm.weight", None),
        "mlp.down_proj.weight": ("mlp.down_weight", None),
        "mlp.gate_proj.weight": ("mlp.gate_up_weight", "gate"),
        "mlp.up_proj.weight": ("mlp.gate_up_weight", "up"),
        "mlp.gate.weight": ("mlp.gate_weight", None),
        "mlp.experts.gate_up_proj": ("mlp.w13", None),  # transformers-5 fused expert layout
        "mlp.experts.down_proj": ("mlp.w2", None),
    }
    for proj in ("q_proj", "k_proj", "v_proj"):
        table[f"self_attn.{proj}.weight"] = ("attn.qkv_weight", proj)
        table[f"self_attn.{proj}.bias"] = ("attn.qkv_bias", proj)
    return table.get(rest)
