"""Reads a model's NSA option from its config.json (`ModelConfig.hf_config["nsa"]`).

An NSA model is one of the supported architectures whose config.json carries an `"nsa"` object;
every attention layer then runs natively sparse attention (`cuttle.attention.nsa`) with the
extra weights the loader names `self_attn.g_proj` (the gates: fla-org's name and layout, row
3*h + branch, branches compressed / selected / window) and `self_attn.compress_k`,
`self_attn.compress_v` (phi "linear": [kv_heads, l*head_dim, head_dim]). Field names are ours,
with fla-org's NSAConfig names accepted for the fields it has (`block_size` = select_block,
`block_counts` = top_n, `window_size` = window). Owns the parsing and the refusal of what cannot
work; never builds modules.

fla-org's own `NSAForCausalLM` checkpoints (flash-linear-attention's NSA model: a Llama-style
decoder, RMSNorm + SwiGLU + RoPE, whose attention is NSA with mean-pooled compression, l = d = l' =
`block_size`, and only the query's own block forced) are read as the equivalent Llama config with
an `"nsa"` object (`fla_nsa_to_hf`) and their tensor names renamed to Llama's as they load
(`fla_tensor_name`); docs/nsa.md says what of their layout is mapped and what is refused.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from cuttle.attention.nsa import NSAConfig

FIELDS = ("compress_block", "compress_stride", "select_block", "top_n", "init_blocks", "local_blocks", "window",
          "compress_fn")
FLA_ALIASES = {"block_size": "select_block", "block_counts": "top_n", "window_size": "window"}


def nsa_config(hf: dict[str, Any]) -> NSAConfig | None:
    """The NSA configuration of a checkpoint, None for a dense model; bad fields raise ValueError
    naming them (`nsa.<field>`)."""
    raw = hf.get("nsa")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"nsa must be an object of NSA fields ({', '.join(FIELDS)}), got {raw!r}")
    fields: dict[str, Any] = {}
    for key, value in raw.items():
        name = FLA_ALIASES.get(key, key)
        if name not in FIELDS:
            raise ValueError(f"nsa.{key} is not an NSA field (known: {', '.join(FIELDS + tuple(FLA_ALIASES))})")
        if name in fields:
            raise ValueError(f"nsa.{key}: {name} given twice (under its own and its fla-org name)")
        fields[name] = value
    cfg = NSAConfig(**fields)
    if hf.get("kv_lora_rank") is not None:
        raise ValueError("nsa with multi-head latent attention (kv_lora_rank) is not supported")
    cfg.check_context(int(hf.get("max_position_embeddings", 4096)))
    return cfg


FLA_ARCHITECTURE = "NSAForCausalLM"
FLA_MARK = "fla_nsa"  # set in the translated config: the loader renames fla-org's tensor names
# fla-org NSAConfig fields that change nothing a forward computes (training-time fusions, init,
# cache switches); every other field is either mapped below or refused
_FLA_INERT = {"architectures", "model_type", "initializer_range", "use_cache", "fuse_norm", "fuse_swiglu",
              "fuse_cross_entropy", "fuse_linear_cross_entropy", "use_l2warp", "pad_token_id", "torch_dtype",
              "transformers_version", "keys_to_ignore_at_inference", "auto_map"}
_FLA_MAPPED = {"hidden_size", "num_hidden_layers", "num_heads", "num_kv_heads", "head_dim", "qkv_bias", "block_size",
               "block_counts", "window_size", "rope_theta", "max_position_embeddings", "hidden_ratio",
               "intermediate_size", "hidden_act", "elementwise_affine", "norm_eps", "bos_token_id", "eos_token_id",
               "tie_word_embeddings", "vocab_size"}
_FLA_ACTS = {"swish": "silu", "silu": "silu"}


def fla_nsa_to_hf(fla: dict[str, Any], path: str = "") -> dict[str, Any]:
    """fla-org's NSAForCausalLM config.json -> the equivalent LlamaForCausalLM config with an
    `"nsa"` object: mean pooling over blocks of `block_size` (l = d = l'), top_n = `block_counts`
    with no initial block and the query's own block forced, window = `window_size`. Fields that
    would change the math and are not mapped are refused, naming them."""
    where = f" in {path}" if path else ""
    unknown = sorted(set(fla) - _FLA_INERT - _FLA_MAPPED)
    if unknown:
        raise ValueError(f"fla-org NSA config{where}: fields {unknown} are not mapped by cuttle (refused rather than ignored)")
    if fla.get("elementwise_affine", True) is not True:
        raise ValueError(f"fla-org NSA config{where}: elementwise_affine = {fla['elementwise_affine']!r}: "
                         "RMSNorm without weights is not supported")
    act = fla.get("hidden_act", "swish")
    if act not in _FLA_ACTS:
        raise ValueError(f"fla-org NSA config{where}: hidden_act = {act!r}: only swish (silu) MLPs are supported")
    for name in ("block_size", "block_counts"):
        if not isinstance(fla.get(name, 1), int):
            raise ValueError(f"fla-org NSA config{where}: {name} = {fla[name]!r}: must be an integer (per-token counts are "
                             "not supported)")
    hidden, heads = int(fla["hidden_size"]), int(fla["num_heads"])
    inter = fla.get("intermediate_size")
    if inter is None:  # fla's GatedMLP: 2/3 of hidden_ratio x hidden, rounded up to a multiple of 256
        inter = int(hidden * int(fla.get("hidden_ratio", 4)) * 2 / 3)
        inter = 256 * ((inter + 256 - 1) // 256)
    block = int(fla.get("block_size", 64))
    window = fla.get("window_size")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", FLA_MARK: True,
        "hidden_size": hidden, "num_hidden_layers": int(fla["num_hidden_layers"]), "num_attention_heads": heads,
        "num_key_value_heads": int(fla.get("num_kv_heads") or heads), "head_dim": int(fla.get("head_dim") or hidden // heads),
        "intermediate_size": int(inter), "hidden_act": _FLA_ACTS[act], "rms_norm_eps": float(fla.get("norm_eps", 1e-6)),
        "rope_theta": float(fla.get("rope_theta", 10000.0)),
        "max_position_embeddings": int(fla.get("max_position_embeddings", 2048)),
        "attention_bias": bool(fla.get("qkv_bias", False)), "tie_word_embeddings": bool(fla.get("tie_word_embeddings", False)),
        "vocab_size": int(fla["vocab_size"]), "bos_token_id": fla.get("bos_token_id"), "eos_token_id": fla.get("eos_token_id"),
        "nsa": {"compress_block": block, "compress_stride": block, "select_block": block,
                "top_n": int(fla.get("block_counts", 16)), "init_blocks": 0, "local_blocks": 1,
                "window": int(window or 0), "compress_fn": "mean"},
    }


_FLA_LAYER = re.compile(r"^model\.layers\.(\d+)\.(attn_norm|mlp_norm|attn)\.(.+)$")
_FLA_PARTS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "attn": "self_attn"}


def fla_tensor_name(name: str) -> str:
    """An fla-org NSA tensor name -> the Llama name the loader maps (`model.embeddings` ->
    `model.embed_tokens`, `attn_norm` / `mlp_norm` -> `input_layernorm` / `post_attention_layernorm`,
    `attn.*` -> `self_attn.*`; `g_proj` keeps its name, MLP and final norm names are Llama's)."""
    if name == "model.embeddings.weight":
        return "model.embed_tokens.weight"
    m = _FLA_LAYER.match(name)
    if m is None:
        return name
    return f"model.layers.{m.group(1)}.{_FLA_PARTS[m.group(2)]}.{m.group(3)}"


def fla_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in tensors:
        yield fla_tensor_name(name), t
