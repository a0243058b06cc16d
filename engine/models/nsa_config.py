"""Reads a model's NSA option from its config.json (`ModelConfig.hf_config["nsa"]`).

An NSA model is one of the supported architectures whose config.json carries an `"nsa"` object;
every attention layer then runs natively sparse attention (`cuttle.attention.nsa`) with the
extra weights the loader names `self_attn.g_proj` (the gates: fla-org's name and layout, row
3*h + branch, branches compressed / selected / window) and `self_attn.compress_k`,
`self_attn.compress_v` (phi "linear": [kv_heads, l*head_dim, head_dim]). Field names are ours,
with fla-org's NSAConfig names accepted for the fields it has (`block_size` = select_block,
`block_counts` = top_n, `window_size` = window). Owns the parsing and the refusal of what cannot
work; never builds modules.
"""
from __future__ import annotations

from typing import Any

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
