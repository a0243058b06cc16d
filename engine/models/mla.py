"""DeepSeek multi-head latent attention (MLA) over the paged KV cache.

Owns MLA's projections: q (full rank, or through the q_lora_rank bottleneck with its norm), the
per-token compressed latent (kv_lora_rank) plus one rotary key shared by all heads, and kv_b_proj,
which decompresses the latent into per-head k_nope and v. The cache stores the *decompressed*
per-head K and V (every query head is a KV head), so any attention backend serves MLA unchanged;
V is zero-padded to the K width (or q/k to the V width) so one cache slot width fits both, and
the padding is sliced off the output. The rotary dims come first in q and k (the checkpoint's
order is nope then rope; q.k does not care), so a squid document moved by a rope delta is attended
by rotating the query's first rotary dims, as for every model. The inference projections take the
native linear kernels (`native.gemm.linear`: packed once, batch-invariant like every other linear
layer; the training path's 3-D rows fall back to `F.linear`), and at inference the rotations, cats
and pads that assemble q / k / v for the cache are one native call (`fused.mla_qkv`, the torch
code's bits), so an MLA decode step replays as a kernel graph (without latent biases, whose adds
stay torch). Caching the latent instead (absorbed MLA) is a later
optimisation this module must not be confused with: it never stores or attends over latents.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cuttle.attention.backend import AttentionBackend
from cuttle.attention.metadata import AttentionMetadata
from cuttle.attention.native import gemm
from cuttle.attention.native.fused import mla_qkv, narrow_rows
from cuttle.attention.rope import apply_rope, yarn_softmax_scale
from cuttle.engine.config import ModelConfig
from cuttle.engine.models.layers import RMSNorm, empty_param

# transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps
_LATENT_NORM_EPS = 1e-6


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): interleaved rotary pairs into the
    rotate-half layout. Applied to q and k alike, so dot products are unchanged."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _pad_to(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Zero-pad the head dim: zeros add nothing to q.k and yield output columns that are sliced off."""
    return x if x.shape[-1] == dim else F.pad(x, (0, dim - x.shape[-1]))


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer_id: int = 0):
        super().__init__()
        self.layer_id = layer_id  # told to the attention backend
        m = cfg.mla
        assert m is not None
        H = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.nope, self.rope, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.qk_dim = m.qk_head_dim
        self.kv_lora_rank = m.kv_lora_rank
        self.interleave = m.rope_interleave
        self.cache_dim = cfg.head_dim
        self.q_rows = m.q_lora_rank if m.q_lora_rank is not None else cfg.num_heads * self.qk_dim
        # q_a_proj (or q_proj) and kv_a_proj_with_mqa both read x: one matmul
        self.a_weight = empty_param(self.q_rows + m.kv_lora_rank + self.rope, H, dtype=dtype)
        bias = cfg.attention_bias
        self.q_a_bias = empty_param(self.q_rows, dtype=dtype) if bias and m.q_lora_rank is not None else None
        self.kv_a_bias = empty_param(m.kv_lora_rank + self.rope, dtype=dtype) if bias else None
        self.q_a_norm = RMSNorm(m.q_lora_rank, _LATENT_NORM_EPS, dtype) if m.q_lora_rank is not None else None
        self.q_b_weight = empty_param(cfg.num_heads * self.qk_dim, m.q_lora_rank, dtype=dtype) if m.q_lora_rank is not None else None
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, _LATENT_NORM_EPS, dtype)
        self.kv_b_weight = empty_param(cfg.num_heads * (self.nope + self.v_dim), m.kv_lora_rank, dtype=dtype)
        self.o_weight = empty_param(H, cfg.num_heads * self.v_dim, dtype=dtype)
        self.o_bias = empty_param(H, dtype=dtype) if bias else None
        # DeepSeek-V3 under YaRN with mscale_all_dim also scales the attention logits (transformers does)
        self.scale = self.qk_dim**-0.5 * yarn_softmax_scale(cfg.rope_scaling)

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, heads * qk_dim] (nope then rope dims, the checkpoint's order),
        the shared rotary key [T, rope] and the decompressed kv [T, heads * (nope + v_dim)]."""
        q, kv_a = gemm.linear(x, self.a_weight).split([self.q_rows, self.kv_lora_rank + self.rope], dim=-1)
        if self.kv_a_bias is not None:
            kv_a = kv_a + self.kv_a_bias
        if self.q_a_norm is not None:
            if self.q_a_bias is not None:
                q = q + self.q_a_bias
            q = gemm.linear(self.q_a_norm(q), self.q_b_weight)
        latent, k_rot = kv_a.split([self.kv_lora_rank, self.rope], dim=-1)
        return q, k_rot, gemm.linear(self.kv_a_norm(latent), self.kv_b_weight)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q, k [T, heads, qk_dim] (rotary dims first, NeoX halves), v [T, heads, v_dim]."""
        T = x.shape[0]
        q, k_rot, kv = self._projections(x)
        q_nope, q_rot = q.view(T, self.num_heads, self.qk_dim).split([self.nope, self.rope], dim=-1)
        k_nope, v = kv.view(T, self.num_heads, self.nope + self.v_dim).split([self.nope, self.v_dim], dim=-1)
        k_rot = k_rot.view(T, 1, self.rope)
        if self.interleave:
            q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)
        # rotary dims first (checkpoints put them last; q and k are permuted alike, so q.k is
        # unchanged): the backends rotate the first rotary dims of a query by -delta to attend a
        # squid document moved by a rope delta, as for every other model
        q = torch.cat((apply_rope(q_rot, cos, sin), q_nope), dim=-1)
        k = torch.cat((apply_rope(k_rot, cos, sin).expand(T, self.num_heads, self.rope), k_nope), dim=-1)
        return q, k, v

    def _cache_qkv_native(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """`_qkv` padded to the cache width, its rotations, cats and pads in one native call
        (`fused.mla_qkv`), so an MLA decode step is native calls only (kernel graphs); None where
        that does not apply (latent biases, autograd, no kernel library): the torch code then."""
        if self.kv_a_bias is not None or self.q_a_bias is not None:
            return None
        q, k_rot, kv = self._projections(x)
        return mla_qkv(q, k_rot, kv, cos, sin, self.num_heads, self.nope, self.rope, self.v_dim, self.cache_dim, self.interleave)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        qkv = self._cache_qkv_native(x, cos, sin)
        q, k, v = qkv if qkv is not None else (_pad_to(t, self.cache_dim) for t in self._qkv(x, cos, sin))
        o = backend.forward(self.layer_id, q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)[0]
        if self.cache_dim != self.v_dim:  # the padding's output columns dropped (one native copy on CPU)
            o = narrow_rows(o.reshape(-1, self.cache_dim), self.v_dim)
        return gemm.linear(o.reshape(-1, self.num_heads * self.v_dim), self.o_weight, self.o_bias)

    def forward_dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Training path: x [B, S, hidden], mask [B, 1, S, S] (True = may attend); no KV cache."""
        B, S, _ = x.shape
        q, k, v = (t.view(B, S, self.num_heads, -1).transpose(1, 2) for t in self._qkv(x.reshape(B * S, -1), cos, sin))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return F.linear(o.transpose(1, 2).reshape(B, S, self.num_heads * self.v_dim), self.o_weight, self.o_bias)
