"""The decoder-only transformer behind every supported architecture.

Llama-3, Mistral, Ministral 3, StarCoder2, Phi-3, Qwen2, Seed-OSS, Qwen3, Qwen3-MoE, Qwen2-MoE,
Mixtral, DeepSeek-V2 / V3, GLM-4.5, MiniMax-M2, OLMo 2 / 3, Granite, CWM and gpt-oss differ only in
switches read from `ModelConfig` (q/k RMSNorm per head or over all heads, attention bias, rope scaling,
partial rotary, LayerNorm and an ungated gelu MLP with biases, post-norm layers, Granite's
multipliers, Ministral 3's per-position query scaling, gpt-oss's attention sinks (`sink_scaled`,
applied to any backend's output by its log-sum-exp) and biased experts, routed-MoE MLPs on some layers, a shared
expert beside the routed ones, multi-head latent attention; sliding windows are the attention
backend's), so they share one definition. Projections are fused for speed (q|k|v in one matmul, gate|up in one); the loader
slices HF tensors into them. At a few rows (small-batch decode) they go through the native
weight-streaming kernel of `cuttle.attention.native.gemm.linear`, else `F.linear`. The small
ops between the projections (residual add + RMSNorm, q/k norm + RoPE, silu * up) go through the
fused CPU kernels of `cuttle.attention.native.fused` (bit-identical to the torch code they replace,
which runs on other devices and under autograd). The forward takes a flattened, unpadded batch
and the attention metadata; it never owns KV memory (the runner hands each layer its cache views).
A config.json with an `"nsa"` object makes every attention layer an `NSAAttention` (natively
sparse attention: `cuttle.attention.nsa`), whose inference path goes through the NSA backend and
whose training path through the same torch reference.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from cuttle.attention.backend import AttentionBackend
from cuttle.attention.metadata import AttentionMetadata
from cuttle.attention.native import rows
from cuttle.attention.native.gemm import derived
from cuttle.attention.native.fused import (add, gelu_tanh, qk_norm_rope, rms_norm, rms_norm_, scale, sigmoid, silu_mul,
                                           sink_scale)
from cuttle.attention.nsa import NSAConfig, compress, compress_windows, nsa_attend, nsa_attend_segments
from cuttle.attention.rope import RotaryEmbedding, apply_rope, rotate_partial
from cuttle.attention.topk import TopKConfig, parse_sparse_attention, topk_attend_chunked, topk_attend_segments
from cuttle.engine.config import ModelConfig
from cuttle.engine.lora import LoRAContext
from cuttle.engine.models.layers import LayerNorm, RMSNorm, empty_param
from cuttle.engine.models.linear_quant import dense_linear, linear  # native.gemm.linear, or the MXFP8 GEMM for quantized weights
from cuttle.engine.models.mla import MLAttention
from cuttle.engine.models.mtp import MTPHead
from cuttle.engine.models.nsa_config import nsa_config
from cuttle.moe import FusedMoE, RoutingConfig, SharedExpert
from cuttle.moe.routing import is_moe_layer
from cuttle.moe.experts_torch import ClampedSwiGLU


class Attention(nn.Module):
    lora: LoRAContext | None = None  # set by `CausalLM.enable_lora`: adapters' deltas on q|k|v and o

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer_id: int = 0):
        super().__init__()
        self.layer_id = layer_id  # told to the attention backend (per-layer caches hang on it)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_weight = empty_param(self.q_size + 2 * self.kv_size, cfg.hidden_size, dtype=dtype)
        self.qkv_bias = empty_param(self.q_size + 2 * self.kv_size, dtype=dtype) if cfg.attention_bias else None
        self.o_weight = empty_param(cfg.hidden_size, self.q_size, dtype=dtype)
        self.o_bias = empty_param(cfg.hidden_size, dtype=dtype) if cfg.proj_bias else None
        # per head (Qwen3, GLM-4.5), or over all the heads at once (MiniMax-M2)
        self.whole_qk_norm = cfg.qk_norm_whole
        self.q_norm = RMSNorm(self.q_size if cfg.qk_norm_whole else cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.kv_size if cfg.qk_norm_whole else cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.scale = cfg.attention_scale if cfg.attention_scale is not None else cfg.head_dim**-0.5
        self.q_scale: torch.Tensor | None = None  # this step's per-token query scaling [tokens, 1, 1] (Ministral 3), or None
        # gpt-oss: one learned logit per head that joins every row's softmax with a zero value
        self.sinks = empty_param(cfg.num_heads, dtype=dtype) if cfg.attention_sinks else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        qkv, qn, kn = self._whole_norms(self._project(x, self.qkv_weight, "qkv", self.qkv_bias))
        q, k, v = qk_norm_rope(
            qkv, self.num_heads, self.num_kv_heads, self.head_dim, qn.weight if qn is not None else None,
            kn.weight if kn is not None else None, qn.eps if qn is not None else 0.0, cos, sin,
        )
        if self.q_scale is not None:
            q = scale(q, self.q_scale)  # (one native call: the step stays a kernel graph)
        o, lse = backend.forward(self.layer_id, q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        if self.sinks is not None:
            o = sink_scaled(o, lse, self.sinks)
        return self._project(o.reshape(-1, self.q_size), self.o_weight, "o", self.o_bias)

    def _whole_norms(self, qkv: torch.Tensor) -> tuple[torch.Tensor, RMSNorm | None, RMSNorm | None]:
        """qkv and the per-head q/k norms the fused kernel is to apply: MiniMax-M2's norms over
        whole rows of q and of k are applied here first (two native row norms, in place on the
        projection's fresh rows), leaving the kernel only the rotation."""
        if not self.whole_qk_norm:
            return qkv, self.q_norm, self.k_norm
        qs, ks, qn, kn = self.q_size, self.kv_size, self.q_norm, self.k_norm
        if qkv.stride(1) == 1 and rms_norm_(qkv[:, :qs], qn.weight, qn.eps):
            if not rms_norm_(qkv[:, qs:qs + ks], kn.weight, kn.eps):
                raise AssertionError("rms_norm_ took q's columns but not k's")  # (same tensor, dtype and device)
            return qkv, None, None
        return torch.cat((rms_norm(qkv[:, :qs], qn.weight, qn.eps), rms_norm(qkv[:, qs:qs + ks], kn.weight, kn.eps),
                          qkv[:, qs + ks:]), dim=-1), None, None

    def _project(self, x: torch.Tensor, weight: torch.Tensor, proj: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        """An inference projection, plus the step's LoRA deltas on it (engine/lora.py)."""
        y = linear(x, weight, bias)
        return y if self.lora is None else self.lora.add(y, x, self.layer_id, proj)

    def _project_dense(self, x: torch.Tensor, weight: torch.Tensor, proj: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        """A training-path projection of x [B, S, in], plus the LoRA deltas (the RL trainer's
        adapter, rl/lora.py) by the same formula as inference."""
        y = dense_linear(x, weight, bias)
        if self.lora is not None:
            self.lora.add(y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]), self.layer_id, proj)
        return y

    def _qkv_dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Training-path projections of x [B, S, hidden]: q [B, S, H, D], k and v [B, S, Hkv, D]."""
        B, S, _ = x.shape
        qkv = self._project_dense(x, self.qkv_weight, "qkv", self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.whole_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(B * S, self.num_heads, self.head_dim)
        k = k.reshape(B * S, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.whole_qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, cos, sin)
        if self.q_scale is not None:
            q = q * self.q_scale
        q = q.view(B, S, self.num_heads, self.head_dim)
        k = apply_rope(k, cos, sin).view(B, S, self.num_kv_heads, self.head_dim)
        return q, k, v.reshape(B, S, self.num_kv_heads, self.head_dim)

    def forward_dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                      sparse: TopKConfig | None = None, segments: DenseSegments | None = None) -> torch.Tensor:
        """Training path: x [B, S, hidden], mask [B, 1, S, S] (True = may attend); no KV cache.
        `sparse`: this layer runs training-free top-k attention (`cuttle.attention.topk`), the rule
        the engine's `sparse_attention` serves: on plain causal rows, or with `segments` (squid's
        dense row, packed documents) each segment under the rule on its own keys, merged by the
        log-sum-exp, as the engine attends documents."""
        B, S, _ = x.shape
        if sparse is not None:
            if segments is None:
                causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
                if not bool((mask == causal).all()):
                    raise NotImplementedError("top-k sparse layers over anything but plain causal rows need the tokens' "
                                              "segments (forward_masked(..., segments=...)): the rule is per segment")
            q, k, v = self._qkv_dense(x, cos, sin)
            pos = torch.arange(S, device=x.device)
            if segments is None:
                rows = [topk_attend_chunked(q[b], k[b], v[b], pos, sparse, self.scale)[0] for b in range(B)]
            else:
                rows = [topk_attend_segments(q[b], k[b], v[b], mask[b].reshape(S, S), segments.ids[b], sparse, self.scale,
                                             None if segments.shifts is None else segments.shifts[b], segments.unshift)
                        for b in range(B)]
            return self._project_dense(torch.stack(rows).reshape(B, S, self.q_size), self.o_weight, "o", self.o_bias)
        q, k, v = (t.transpose(1, 2) for t in self._qkv_dense(x, cos, sin))
        if self.sinks is not None:
            o = _attend_with_sinks(q, k, v, mask, self.sinks, self.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return self._project_dense(o.transpose(1, 2).reshape(B, S, self.q_size), self.o_weight, "o", self.o_bias)


def sink_scaled(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink from attention without one: a sink logit s joins a row's softmax
    with a zero value, so its output is the backend's o times Z / (Z + e^s) = sigmoid(lse - s),
    where lse = log Z is the log-sum-exp the backend returns for the row's keys. One seam for
    every backend, squid's merged segments and the host tier included. o [T, H, D], lse [T, H];
    one native call on CPU (`fused.sink_scale`, in place), torch elsewhere."""
    return sink_scale(o, lse, sinks)


def _attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """Training-path attention with per-head sinks (gpt-oss), as transformers' eager path computes
    it: q [B, H, S, D], k / v [B, Hkv, S, D], mask [B, 1, S, S] (True: may attend) ->
    [B, H, S, D]; gradients reach the sinks."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def sparse_attention_for(spec: str | dict | TopKConfig | None, cfg: ModelConfig) -> TopKConfig | None:
    """The `sparse_attention` spec parsed (`topk.parse_sparse_attention`) and checked against the
    model: the models training-free top-k does not handle are refused (instead of computing
    something else). The engine, the training path and the RL trainer all ask here."""
    sparse = parse_sparse_attention(spec)
    if sparse is None:
        return None
    if nsa_config(cfg.hf_config) is not None:
        raise ValueError("sparse_attention is for dense checkpoints; this model is natively sparse (config.json's nsa)")
    if cfg.mla is not None:
        raise ValueError("sparse_attention with multi-head latent attention (kv_lora_rank) is not supported")
    if cfg.attention_sinks:
        raise ValueError("sparse_attention with attention sinks (gpt-oss) is not supported")
    if sparse.dense_layers >= cfg.num_layers:
        raise ValueError(f"sparse_attention.dense_layers = {sparse.dense_layers}: the model has {cfg.num_layers} layers, "
                         "so none would be sparse")
    return sparse


class DenseSegments(NamedTuple):
    """The training path's segments of each row (`CausalLM.forward_masked`): ids [B, S] int64,
    shifts [B, S] int64 or None, and the rotation by -shift (`CausalLM._unshift`)."""

    ids: torch.Tensor
    shifts: torch.Tensor | None
    unshift: Callable[[torch.Tensor, int], torch.Tensor]


_HEADS_T_ATTR = "_cuttle_heads_t"


def _transpose_heads(weight: torch.Tensor) -> list[torch.Tensor]:
    with torch.inference_mode(False):  # plain tensors (with a version counter) even when called from inference mode
        return [weight[i].detach().t().contiguous() for i in range(weight.shape[0])]


def _heads_transposed(weight: torch.Tensor) -> list[torch.Tensor]:
    """phi's weight [Hkv, l*D, D] as one contiguous [D, l*D] tensor per head (what a linear layer
    takes), kept on the weight (`gemm.derived`), so the packed GEMM's copies of them are made
    once, not per step."""
    return derived(weight, _HEADS_T_ATTR, _transpose_heads)


class NSAAttention(Attention):
    """Natively sparse attention (arXiv 2502.11089): the dense layer's projections plus per-head
    gates (sigmoid of a linear map of the layer input, fla-org's `g_proj` layout: row 3*h + branch)
    and phi's weights. Inference hands q/k/v, the gates and `compress_windows` to the backend's
    `forward_nsa` (paged raw + compressed caches); training runs `cuttle.attention.nsa.nsa_attend`,
    the same reference the backends are tested against."""

    def __init__(self, cfg: ModelConfig, nsa: NSAConfig, dtype: torch.dtype, layer_id: int = 0):
        super().__init__(cfg, dtype, layer_id)
        self.nsa = nsa
        self.g_weight = empty_param(3 * self.num_heads, cfg.hidden_size, dtype=dtype)
        self.ck_weight: nn.Parameter | None = None
        self.cv_weight: nn.Parameter | None = None
        if nsa.compress_fn == "linear":
            width = nsa.compress_block * self.head_dim
            self.ck_weight = empty_param(self.num_kv_heads, width, self.head_dim, dtype=dtype)
            self.cv_weight = empty_param(self.num_kv_heads, width, self.head_dim, dtype=dtype)

    def compress_windows(self, wk: torch.Tensor, wv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """phi over blocks of cached keys and values [E, Hkv, l, D] -> ([E, Hkv, D], [E, Hkv, D])."""
        return self._phi(wk, self.ck_weight), self._phi(wv, self.cv_weight)

    def _phi(self, windows: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """Inference phi: a linear phi runs as one linear layer per KV head (`linear`, the native
        GEMMs) rather than torch's batched matmul, whose summation order follows the number of
        entries E the step completes, i.e. the other sequences of the batch; the linear kernels
        give each entry the same result at every E (bf16; fp32 with the batch-invariant switch)."""
        if weight is None or windows.device.type != "cpu" or weight.dtype != windows.dtype or windows.shape[0] == 0:
            return compress_windows(windows, weight, self.nsa)
        e, h, l, dim = windows.shape
        flat = windows.reshape(e, h, l * dim)
        heads = _heads_transposed(weight)
        return torch.stack([linear(flat[:, i], heads[i]) for i in range(h)], dim=1)

    def forward(self, x, cos, sin, kv_cache, meta, backend) -> torch.Tensor:
        qkv, qn, kn = self._whole_norms(self._project(x, self.qkv_weight, "qkv", self.qkv_bias))
        q, k, v = qk_norm_rope(
            qkv, self.num_heads, self.num_kv_heads, self.head_dim, qn.weight if qn is not None else None,
            kn.weight if kn is not None else None, qn.eps if qn is not None else 0.0, cos, sin,
        )
        gates = sigmoid(linear(x, self.g_weight)).view(-1, self.num_heads, 3)  # fused: one formula per element, batch-invariant
        o = backend.forward_nsa(self.layer_id, q, k, v, gates, kv_cache, meta, self.scale, self.compress_windows)
        return self._project(o.reshape(-1, self.q_size), self.o_weight, "o")

    def forward_dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                      segments: DenseSegments | None = None) -> torch.Tensor:
        """Training path: x [B, S, hidden]. Without `segments` the rows must be plain causal (the
        mask [B, 1, S, S] the causal one). With `segments` (each token's segment: squid's dense
        row, packed documents) every segment is a part attended by NSA's rules on its own keys,
        merged by the log-sum-exp, as the engine attends squid documents (`nsa_attend_segments`;
        docs/nsa.md)."""
        B, S, _ = x.shape
        if segments is None:
            causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
            if not bool((mask == causal).all()):
                raise NotImplementedError("NSA layers over anything but plain causal rows need the tokens' segments "
                                          "(forward_masked(..., segments=...)): their rules are per segment")
        q, k, v = self._qkv_dense(x, cos, sin)
        gates = torch.sigmoid(F.linear(x, self.g_weight)).view(B, S, self.num_heads, 3)
        pos = torch.arange(S, device=x.device)
        rows = []
        for b in range(B):
            if segments is not None:
                rows.append(nsa_attend_segments(q[b], k[b], v[b], gates[b], mask[b].reshape(S, S), segments.ids[b],
                                                self._compress, self.nsa, self.scale,
                                                None if segments.shifts is None else segments.shifts[b], segments.unshift))
                continue
            ck, cv = self._compress(k[b], v[b])
            rows.append(nsa_attend(q[b], k[b], v[b], ck, cv, gates[b], pos, self.nsa, self.scale)[0])
        return self._project_dense(torch.stack(rows).reshape(B, S, self.q_size), self.o_weight, "o")

    def _compress(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every compressed entry of one sequence's (or segment's) keys and values [n, Hkv, D]."""
        return compress(k, self.ck_weight, self.nsa), compress(v, self.cv_weight, self.nsa)


class DenseMLP(nn.Module):
    lora: LoRAContext | None = None  # set by `CausalLM.enable_lora`: adapters' deltas on gate|up and down

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, layer_id: int = 0):
        super().__init__()
        self.inter = inter
        self.layer_id = layer_id
        self.gate_up_weight = empty_param(2 * inter, hidden, dtype=dtype)
        self.down_weight = empty_param(hidden, inter, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            return linear(silu_mul(linear(x, self.gate_up_weight)), self.down_weight)
        h = silu_mul(self.lora.add(linear(x, self.gate_up_weight), x, self.layer_id, "gate_up"))
        return self.lora.add(linear(h, self.down_weight), h, self.layer_id, "down")


class GeluMLP(nn.Module):
    """StarCoder2's MLP: c_fc (+ bias) -> gelu (tanh approximation) -> c_proj (+ bias), not gated."""

    def __init__(self, hidden: int, inter: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.fc_weight = empty_param(inter, hidden, dtype=dtype)
        self.fc_bias = empty_param(inter, dtype=dtype) if bias else None
        self.proj_weight = empty_param(hidden, inter, dtype=dtype)
        self.proj_bias = empty_param(hidden, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(gelu_tanh(linear(x, self.fc_weight, self.fc_bias)), self.proj_weight, self.proj_bias)


def _norm(cfg: ModelConfig, dtype: torch.dtype) -> RMSNorm | LayerNorm:
    return (LayerNorm if cfg.layer_norm else RMSNorm)(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, nsa: NSAConfig | None = None):
        super().__init__()
        self.post_norm = cfg.post_norm  # OLMo: the outputs are normed, not the inputs (`post_ff_norm` too)
        self.residual_multiplier = cfg.residual_multiplier  # Granite: each output scaled before its residual add
        self.input_norm = _norm(cfg, dtype) if not cfg.post_norm else None
        self.post_ff_norm = _norm(cfg, dtype) if cfg.post_norm else None
        self.attn: nn.Module
        if cfg.mla is not None:
            self.attn = MLAttention(cfg, dtype, layer_id)
        elif nsa is not None:
            self.attn = NSAAttention(cfg, nsa, dtype, layer_id)
        else:
            self.attn = Attention(cfg, dtype, layer_id)
        self.post_attn_norm = _norm(cfg, dtype)
        # `mlp` is the routed FusedMoE or the dense MLP; a shared expert sits beside the routed one
        self.shared: SharedExpert | None = None
        # (an MTP layer, past num_layers, by the same HF rule as the decoder's)
        moe = layer_id in cfg.moe_layers if layer_id < cfg.num_layers else bool(cfg.moe_layers) and is_moe_layer(cfg.hf_config, layer_id)
        if moe:
            routing = RoutingConfig.from_hf(cfg.hf_config)
            self.mlp: nn.Module = FusedMoE(cfg.hidden_size, cfg.moe_intermediate_size, routing, dtype, bias=cfg.moe_bias,
                                           activation=None if cfg.expert_activation is None else ClampedSwiGLU(*cfg.expert_activation))
            if cfg.shared_expert_intermediate_size:
                self.shared = SharedExpert(cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype, cfg.shared_expert_gated)
        elif cfg.gelu_mlp:
            self.mlp = GeluMLP(cfg.hidden_size, cfg.intermediate_size, cfg.proj_bias, dtype)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype, layer_id)

    def _ffn(self, h: torch.Tensor) -> torch.Tensor:
        # the adds and scalings between kernels are native calls too (`fused.add` / `scale`, torch's
        # bits), so a decode step of these families replays as a kernel graph
        y = self.mlp(h)
        y = y if self.shared is None else add(y, self.shared(h))
        return y if self.residual_multiplier == 1.0 else scale(y, self.residual_multiplier)

    def forward(self, x, cos, sin, kv_cache, meta, backend, delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer on the residual stream x, where `delta` (the previous layer's MLP output, or
        None) is still to be added; returns (x, this layer's MLP output, not yet added). Deferring
        each residual add into the norm that follows it lets one fused kernel do both; the sums
        and their rounding are the same as adding first. A post-norm layer (OLMo) norms the
        attention's output before adding it, and returns its MLP's output normed."""
        if self.post_norm:
            assert self.post_ff_norm is not None
            if delta is not None:
                x = add(x, delta)
            x = add(x, self.post_attn_norm(self.attn(x, cos, sin, kv_cache, meta, backend)))
            return x, self.post_ff_norm(self._ffn(x))
        if delta is None:
            h = self.input_norm(x)
        else:
            x, h = self.input_norm.add(x, delta)
        a = self.attn(h, cos, sin, kv_cache, meta, backend)
        if self.residual_multiplier != 1.0:
            a = scale(a, self.residual_multiplier)
        x, h = self.post_attn_norm.add(x, a)
        return x, self._ffn(h)

    def forward_dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                      sparse: TopKConfig | None = None, segments: DenseSegments | None = None) -> torch.Tensor:
        B, S, H = x.shape
        if self.post_norm:
            assert self.post_ff_norm is not None and sparse is None and not isinstance(self.attn, NSAAttention)
            x = x + self.post_attn_norm(self.attn.forward_dense(x, cos, sin, mask))
            return x + self.post_ff_norm(self._ffn(x.reshape(B * S, H))).view(B, S, H)
        h = self.input_norm(x)
        if isinstance(self.attn, NSAAttention):
            a = self.attn.forward_dense(h, cos, sin, mask, segments)
        else:
            a = self.attn.forward_dense(h, cos, sin, mask) if sparse is None else self.attn.forward_dense(h, cos, sin, mask, sparse,
                                                                                                         segments)
        x = x + (a if self.residual_multiplier == 1.0 else a * self.residual_multiplier)
        return x + self._ffn(self.post_attn_norm(x).reshape(B * S, H)).view(B, S, H)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, mtp: bool = False):
        """`mtp`: also build the checkpoint's first multi-token-prediction layer (engine/models/mtp.py),
        the draft of `speculative_config={"method": "mtp"}`: `layers[num_layers]` and `mtp`."""
        super().__init__()
        self.cfg = cfg
        self.nsa = nsa_config(cfg.hf_config)  # None: dense attention
        self.embed = empty_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        if mtp and cfg.num_mtp_layers < 1:
            raise ValueError(f"this {cfg.architecture} checkpoint has no multi-token-prediction layers "
                             "(config.json's num_nextn_predict_layers)")
        # the decoder's layers, then the MTP layer when asked (never run by the forwards below)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, self.nsa) for i in range(cfg.num_layers + int(mtp)))
        self.mtp = MTPHead(cfg, dtype) if mtp else None
        self.norm = _norm(cfg, dtype)
        self.lm_head = self.embed if cfg.tie_word_embeddings else empty_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.rope = RotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, device)
        self._query_scales: dict[torch.dtype, torch.Tensor] = {}
        if cfg.query_scaling is not None:  # Ministral 3: 1 + beta log(1 + band) per band of n positions
            beta, n = cfg.query_scaling
            bands = torch.arange(cfg.max_position_embeddings // n + 2, dtype=torch.float32)
            self._query_bands = (1 + beta * torch.log(1 + bands)).to(device)
            self._query_scale_table(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, ...]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Returns final hidden states [T, hidden] (logits are computed only for the rows needed).
        A layer's cache is (k, v), or (k, v, compressed k, compressed v) for an NSA model."""
        # F.embedding and the RoPE tables' rows, natively on CPU (one kernel call each)
        x = rows.gather(self.embed, input_ids)
        if self.cfg.embedding_multiplier != 1.0:  # Granite
            x = scale(x, self.cfg.embedding_multiplier)
        cos, sin = (rows.gather(t, positions)[:, None, :] for t in self.rope.cast_tables(x.dtype))
        self._scale_queries(positions, x.dtype)
        delta = None
        for layer, kv in zip(self.layers[: self.cfg.num_layers], kv_caches):
            x, delta = layer(x, cos, sin, kv, meta, backend, delta)
        if delta is None:
            return self.norm(x)
        return self.norm.add(x, delta)[1]

    def forward_mtp(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                    kv_cache: tuple[torch.Tensor, ...], meta: AttentionMetadata,
                    backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer (`mtp=True`) on rows (t_{i+1}, position i, the final hidden state h_i this
        forward returned for position i), its K/V in `kv_cache` (the pool's layer num_layers);
        returns (its output, that output normed for `mtp.compute_logits`)."""
        assert self.mtp is not None
        cos, sin = (rows.gather(t, positions)[:, None, :] for t in self.rope.cast_tables(self.embed.dtype))
        return self.mtp(self.layers[self.cfg.num_layers], input_ids, positions, hidden, cos, sin, kv_cache, meta, backend)

    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        """Training / scoring path with autograd: rows [B, S] packing several documents each.

        A token attends only to earlier tokens of its own document (`doc_ids` equal), and
        positions restart per document, so each document is computed exactly as if alone --
        the same numbers the paged engine produces for it. Returns hidden states [B, S, hidden].
        """
        S = input_ids.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool, device=input_ids.device).tril()
        return self.forward_masked(input_ids, positions, (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal,
                                   segments=doc_ids)

    def forward_masked(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                       sparse: TopKConfig | None = None, segments: torch.Tensor | None = None,
                       segment_shifts: torch.Tensor | None = None) -> torch.Tensor:
        """Training / scoring path with autograd under any attention layout: rows [B, S], their
        positions [B, S], and mask [B, S, S] (True: token i may attend to token j; every token must
        see at least one). Squid layouts (documents beside each other, a query seeing them all) are
        trained and scored through it. `sparse`: the layers from `sparse.dense_layers` on run
        training-free top-k attention, as the engine does under the same
        `sparse_attention`. `segments` [B, S] int64 (each token's segment: `SquidLayout.
        dense_segments`, packed documents' ids): NSA layers and top-k (`sparse`) layers need it
        for any row that is not plain causal, their rules being per segment; other layers read
        only the mask.
        `segment_shifts` [B, S] int64 (`SquidLayout.dense_segments`; None: all 0): how far each
        token's segment sits from the positions it was encoded at, so NSA and top-k layers attend
        it in that frame as the engine does (`attention/dense_segments.py`).
        Returns hidden states [B, S, hidden]."""
        x = F.embedding(input_ids, self.embed)
        if self.cfg.embedding_multiplier != 1.0:  # Granite
            x = x * self.cfg.embedding_multiplier
        cos, sin = self.rope.tables(positions.reshape(-1), x.dtype)
        self._scale_queries(positions.reshape(-1), x.dtype)
        sparse = sparse_attention_for(sparse, self.cfg)
        parts = None
        if segments is not None:
            shape = tuple(input_ids.shape)
            for name, t in (("segments", segments), ("segment_shifts", segment_shifts)):
                if t is not None and tuple(t.shape) != shape:
                    raise ValueError(f"{name} has shape {tuple(t.shape)}; it must be input_ids' {shape} (one id per token)")
            if mask.dim() != 3 or mask.shape[0] not in (1, shape[0]) or tuple(mask.shape[1:]) != (shape[1], shape[1]):
                raise ValueError(f"mask has shape {tuple(mask.shape)}; with segments it must be [B or 1, S, S] for input_ids {shape}")
            mask = mask.expand(shape[0], -1, -1)  # NSA layers read it row by row
            parts = DenseSegments(segments, segment_shifts, self._unshift)
        elif segment_shifts is not None:
            raise ValueError("segment_shifts needs segments")
        windowed = set(self.cfg.sliding_window_layers)
        if windowed:  # a sliding window's layers: keys within W positions of the query (the engine's rule)
            assert self.cfg.sliding_window is not None
            near = positions[:, :, None] - positions[:, None, :] < self.cfg.sliding_window
            window_mask = (mask & near)[:, None]
        for i, layer in enumerate(self.layers[: self.cfg.num_layers]):
            x = layer.forward_dense(x, cos, sin, window_mask if i in windowed else mask[:, None],
                                    sparse if sparse is not None and i >= sparse.dense_layers else None, parts)
        return self.norm(x)

    def _query_scale_table(self, dtype: torch.dtype) -> torch.Tensor:
        """Ministral 3's query scale of every position [max_position_embeddings, 1] in `dtype`
        (its band's fp32 value cast, as transformers computes it), made once per dtype: a
        step's scales are then one native row gather (kernel graphs), and torch's vectorized log
        cannot put a position's value in a scalar tail by the batch's size (batch invariance)."""
        table = self._query_scales.get(dtype)
        if table is None:
            n = self.cfg.query_scaling[1]
            bands = torch.arange(self.cfg.max_position_embeddings, device=self._query_bands.device) // n
            table = self._query_scales[dtype] = self._query_bands[bands].to(dtype)[:, None].contiguous()
        return table

    def _scale_queries(self, positions: torch.Tensor, dtype: torch.dtype) -> None:
        """Ministral 3's query scaling for this step's tokens (Llama 4's attention temperature:
        1 + beta log(1 + floor(p / n))), handed to every layer's attention as [tokens, 1, 1]
        (exactly 1 below n, where the multiply changes no bit)."""
        if self.cfg.query_scaling is None:
            return
        scale = rows.gather(self._query_scale_table(dtype), positions.reshape(-1)).view(-1, 1, 1)
        for layer in self.layers:
            layer.attn.q_scale = scale

    def _unshift(self, x: torch.Tensor, shift: int) -> torch.Tensor:
        """x [n, H, D] rotated by -shift positions (the engine's rotation of a moved segment's query)."""
        cos, sin = self.rope.delta_tables([shift])
        return rotate_partial(x, cos.to(x.device)[:, None, :].expand(x.shape[0], 1, -1),
                              sin.to(x.device)[:, None, :].expand(x.shape[0], 1, -1))

    def enable_lora(self, ctx: LoRAContext) -> None:
        """Let the attention projections and dense MLPs add the LoRA deltas `ctx` holds for a step
        (engine/lora.py); multi-head latent attention has no such seam and is refused there."""
        for layer in self.layers[: self.cfg.num_layers]:  # (the MTP layer drafts under the base weights)
            if isinstance(layer.attn, Attention):
                layer.attn.lora = ctx
            if isinstance(layer.mlp, DenseMLP):
                layer.mlp.lora = ctx

    def linear_weights(self) -> list[torch.Tensor]:
        """The weights the inference forward hands to `native.gemm.linear` (to pack them ahead)."""
        out: list[torch.Tensor] = [self.lm_head]
        if self.mtp is not None:
            out += [self.mtp.eh_proj, self.mtp.head]
        for layer in self.layers:
            if isinstance(layer.attn, Attention):
                out += [layer.attn.qkv_weight, layer.attn.o_weight]
            if isinstance(layer.attn, NSAAttention):
                out.append(layer.attn.g_weight)
            if isinstance(layer.attn, MLAttention):
                out += [layer.attn.a_weight, layer.attn.q_b_weight, layer.attn.kv_b_weight, layer.attn.o_weight]
            if isinstance(layer.mlp, DenseMLP):
                out += [layer.mlp.gate_up_weight, layer.mlp.down_weight]
            if isinstance(layer.mlp, GeluMLP):
                out += [layer.mlp.fc_weight, layer.mlp.proj_weight]
        return [w for w in out if isinstance(w, torch.Tensor)]  # MXFP8 weights (linear_quant) are not packed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = rows.to_float(linear(hidden, self.lm_head))
        return logits if self.cfg.logits_scaling == 1.0 else scale(logits, self.cfg.logits_scaling, divide=True)  # (Granite's)
