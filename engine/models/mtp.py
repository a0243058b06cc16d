"""The multi-token-prediction (MTP) module DeepSeek-V3 and GLM-4.5 checkpoints carry after their
decoder layers (`num_nextn_predict_layers`, tensors under `model.layers.{num_hidden_layers}.`),
as the draft of speculative decoding (`speculative_config={"method": "mtp"}`, engine/mtp_proposer.py).

At position i it reads the target model's final hidden state h_i (normed, what the lm_head reads)
and the embedding of the token after it, t_{i+1}, and predicts t_{i+2}:

    x = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)])     (the embedding zeroed at position 0)
    x = decoder layer (attention over the MTP entries of positions <= i, then its MLP / MoE)
    logits = shared_head.head(shared_head.norm(x))

as vLLM's `deepseek_mtp` computes it. The decoder layer is the model's own `DecoderLayer` at index
num_hidden_layers (so its experts pack and quantize as the others do); its K/V lives in the
engine's paged pool as one layer more, under the sequence's own block table. This module owns the
parts around that layer: the two norms, the projection, its embedding and its head.
"""
from __future__ import annotations

import torch
from torch import nn

from cuttle.attention.backend import AttentionBackend
from cuttle.attention.metadata import AttentionMetadata
from cuttle.attention.native import rows
from cuttle.engine.config import ModelConfig
from cuttle.engine.models.layers import RMSNorm, empty_param
from cuttle.engine.models.linear_quant import linear

# the tensors of an MTP layer that are not its decoder layer's: HF name after `model.layers.N.` ->
# this module's parameter
MTP_TENSORS = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj",
               "shared_head.norm.weight": "head_norm.weight", "shared_head.head.weight": "head",
               "embed_tokens.weight": "embed"}


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.layer_norm or cfg.post_norm or cfg.embedding_multiplier != 1.0 or cfg.logits_scaling != 1.0:
            raise ValueError(f"multi-token prediction is supported for DeepSeek-V3 / GLM-4.5 layouts, not {cfg.architecture}")
        H = cfg.hidden_size
        self.layer_index = cfg.num_layers  # the decoder layer it wraps: CausalLM.layers[num_layers]
        self.embed = empty_param(cfg.vocab_size, H, dtype=dtype)
        self.enorm = RMSNorm(H, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(H, cfg.rms_norm_eps, dtype)
        self.eh_proj = empty_param(H, 2 * H, dtype=dtype)
        self.head_norm = RMSNorm(H, cfg.rms_norm_eps, dtype)
        self.head = empty_param(cfg.vocab_size, H, dtype=dtype)

    def forward(self, layer: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, kv_cache: tuple[torch.Tensor, ...], meta: AttentionMetadata,
                backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of (t_{i+1} ids, positions i, target hidden h_i [T, H]) through the MTP layer, its
        K/V written at the rows' slots; returns (the layer's output x, head_norm(x)) [T, H]."""
        e = rows.gather(self.embed, input_ids)
        if bool((positions == 0).any()):
            e = e.masked_fill((positions == 0)[:, None], 0.0)
        x = linear(torch.cat((self.enorm(e), self.hnorm(hidden.to(e.dtype))), dim=-1), self.eh_proj)
        x, delta = layer(x, cos, sin, kv_cache, meta, backend, None)
        return self.head_norm.add(x, delta)  # (x + delta, its norm: one fused kernel, the same sums)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return rows.to_float(linear(normed, self.head))
