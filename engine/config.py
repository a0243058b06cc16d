"""Engine and model configuration.

`ModelConfig` is read from a checkpoint's config.json and is the only place HF field names are
interpreted (including the variants across transformers versions and model families: which layers
are MoE, shared experts, DeepSeek's multi-head latent attention). Routing fields are interpreted by
`cuttle.moe.routing` from `hf_config`. `EngineConfig` holds the engine's knobs with their
validation. Neither owns memory or state.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from cuttle.attention.topk import parse_sparse_attention
from cuttle.engine.hf_cache import resolve_model
from cuttle.engine.spec_decode import SpecConfig
from cuttle.moe.routing import is_moe_layer

# architecture -> the HF model_type its routing rules are keyed by (filled in when config.json
# omits model_type, so routing never silently falls back to another family's defaults)
MODEL_TYPES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "Glm4MoeForCausalLM": "glm4_moe",
    "MistralForCausalLM": "mistral",
    "Starcoder2ForCausalLM": "starcoder2",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "SeedOssForCausalLM": "seed_oss",
    "Phi3ForCausalLM": "phi3",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    "GraniteForCausalLM": "granite",
    "CwmForCausalLM": "cwm",
    "Ministral3ForCausalLM": "ministral3",
    "GptOssForCausalLM": "gpt_oss",
}
# families whose layers norm the attention's and the MLP's outputs before adding them to the residual
# (no norm before either): OLMo 2 / 3
POST_NORM_ARCHITECTURES = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")
# families whose checkpoints name their MoE blocks `block_sparse_moe` with experts w1 / w3 / w2
BLOCK_SPARSE_MOE_ARCHITECTURES = ("MixtralForCausalLM", "MiniMaxM2ForCausalLM")
# families whose MoE layers are DeepSeek-V3's: sigmoid routing with an expert-choice bias, groups,
# ungated shared experts (`mlp.shared_experts`), dense layers before `first_k_dense_replace`, and
# multi-token-prediction layers after the decoder's in their checkpoints
# (DeepSeek-V2 shares the layout and multi-head latent attention, but routes by softmax: moe/routing.py)
DEEPSEEK_MOE_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "DeepseekV2ForCausalLM")
SUPPORTED_ARCHITECTURES = tuple(MODEL_TYPES)
MOE_QUANT_MODES = ("mxfp8",)
SCHEDULING_POLICIES = ("fcfs", "priority")  # EngineConfig.scheduling_policy (vLLM's --scheduling-policy)
QUANTIZATION_MODES = ("mxfp8",)  # EngineConfig.quantization (vLLM's --quantization): every linear

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class MLAConfig:
    """DeepSeek multi-head latent attention: q (optionally through a low-rank bottleneck) and one
    compressed latent + one shared rotary key per token, decompressed per head by kv_b_proj."""

    q_lora_rank: int | None  # None: a full-rank q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary dims stored as interleaved pairs (x0, x1), (x2, x3), ...

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # heads the KV cache stores (MLA: every query head, decompressed)
    head_dim: int  # width of one cached K/V head (MLA: max(qk_head_dim, v_head_dim), V zero-padded)
    rotary_dim: int  # dims RoPE rotates (MLA: qk_rope_head_dim; else head_dim)
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool
    moe_layers: list[int]  # indices of layers whose MLP is a routed MoE
    moe_intermediate_size: int
    shared_expert_intermediate_size: int  # 0: MoE layers have no shared expert
    shared_expert_gated: bool  # Qwen2-MoE: shared output x sigmoid(shared_expert_gate(x))
    mla: MLAConfig | None
    eos_token_ids: list[int]
    bos_token_id: int | None
    hf_config: dict[str, Any] = field(repr=False)
    num_mtp_layers: int = 0  # checkpoint layers after the decoder's (multi-token prediction): skipped at load
    sliding_window: int | None = None  # Mistral, Mixtral, StarCoder2, Phi-3, OLMo 3, CWM, Ministral 3, Qwen2: a token sees the last W positions
    sliding_window_layers: tuple[int, ...] = ()  # the layers that window (Qwen2's from max_window_layers on; the others all)
    layer_norm: bool = False  # StarCoder2: LayerNorm with bias where the others have RMSNorm
    gelu_mlp: bool = False  # StarCoder2: c_fc -> gelu(tanh) -> c_proj, not gated, instead of silu(gate) * up
    proj_bias: bool = False  # StarCoder2 (use_bias): biases on o_proj and the MLP's projections too
    qk_norm_whole: bool = False  # MiniMax-M2, OLMo 2 / 3: q and k RMSNormed over all their heads at once (weights [heads * head_dim])
    post_norm: bool = False  # OLMo 2 / 3: x + norm(attn(x)), then x + norm(mlp(x)); no norm before either
    # Granite's scalings: embeddings x embedding_multiplier, each residual add of an output x
    # residual_multiplier, attention scores x attention_multiplier (instead of 1/sqrt(head_dim)),
    # logits / logits_scaling (1.0 / None: none)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_scale: float | None = None
    logits_scaling: float = 1.0
    fp8_quant: Fp8BlockQuant | None = None  # FP8 block-scaled weights, dequantized at load (engine/models/fp8_checkpoint.py)
    # Ministral 3: Llama 4's attention temperature, queries at position p scaled by
    # 1 + beta log(1 + floor(p / n)) after RoPE ((beta, n); None: no scaling)
    query_scaling: tuple[float, int] | None = None
    # gpt-oss: a learned sink logit per attention head (softmax over the keys and the sink, whose
    # value is zero), biases on the router and the experts, the experts' clamped SwiGLU
    # ((alpha, limit): moe/experts_torch.py ClampedSwiGLU), and MXFP4 experts in the checkpoint
    # (dequantized exactly as they load: engine/models/mxfp4_checkpoint.py)
    attention_sinks: bool = False
    moe_bias: bool = False
    expert_activation: tuple[float, float] | None = None
    mxfp4_experts: bool = False

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"model directory {path!r} has no config.json")
        with open(cfg_path) as f:
            hf = json.load(f)
        return cls.from_hf(hf, path)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], path: str = "") -> "ModelConfig":
        # (imported here: engine/models imports this module)
        from cuttle.engine.models.multimodal_text import VISION_LANGUAGE_ARCHITECTURES, text_config_of

        archs = hf.get("architectures") or []
        if "NSAForCausalLM" in archs:  # fla-org's NSA model: read as the Llama + "nsa" config it is
            from cuttle.engine.models.nsa_config import fla_nsa_to_hf

            hf = fla_nsa_to_hf(hf, path)
            archs = hf["architectures"]
        if any(a in VISION_LANGUAGE_ARCHITECTURES for a in archs):  # Mistral Small 3.x: its text model, served alone
            hf = text_config_of(hf, path)
            archs = hf["architectures"]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs!r} in {path or 'config'}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}, "
                f"NSAForCausalLM (fla-org), {', '.join(VISION_LANGUAGE_ARCHITECTURES)} (its text model)"
            )
        hf = {"model_type": MODEL_TYPES[arch], **hf}
        _check_unsupported(hf, arch, path)
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        rope = _layer_rope(hf, arch, path)
        rope_theta = float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))
        rope_scaling = _rope_scaling(hf.get("rope_scaling") or rope, hf, path)
        num_layers = int(hf["num_hidden_layers"])
        num_experts = int(hf.get("num_experts") or hf.get("n_routed_experts") or hf.get("num_local_experts") or 0)
        moe_layers = [i for i in range(num_layers) if is_moe_layer(hf, i)] if num_experts > 0 else []
        gpt_oss = arch == "GptOssForCausalLM"
        moe_inter = int(hf.get("moe_intermediate_size")
                        or (hf.get("intermediate_size") if arch in BLOCK_SPARSE_MOE_ARCHITECTURES or gpt_oss else 0) or 0)
        shared_inter, shared_gated = 0, False
        if arch == "Qwen2MoeForCausalLM":
            shared_inter, shared_gated = int(hf.get("shared_expert_intermediate_size") or 0), True
        elif arch in DEEPSEEK_MOE_ARCHITECTURES:
            # transformers' DeepseekV3Config and Glm4MoeConfig default n_shared_experts to 1, DeepseekV2Config to 2
            shared_inter = moe_inter * int(hf.get("n_shared_experts", 2 if arch == "DeepseekV2ForCausalLM" else 1) or 0)
        mla = None
        if arch in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"):
            q_rank = hf.get("q_lora_rank", 1536 if arch == "DeepseekV2ForCausalLM" else None)
            mla = MLAConfig(
                q_lora_rank=None if q_rank is None else int(q_rank),
                kv_lora_rank=int(hf["kv_lora_rank"]),
                qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
                qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
                v_head_dim=int(hf["v_head_dim"]),
                rope_interleave=bool(hf.get("rope_interleave", True)),
            )
            # The cache holds decompressed K and V for every head, in one slot width.
            num_kv_heads, head_dim = num_heads, max(mla.qk_head_dim, mla.v_head_dim)
            rotary_dim = mla.qk_rope_head_dim
        else:
            num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
            head_dim = int(hf.get("head_dim") or hidden // num_heads)
            rotary_dim = _rotary_dim(hf, rope, arch, head_dim, path)
        starcoder2 = arch == "Starcoder2ForCausalLM"
        if arch == "Qwen2MoeForCausalLM":
            attention_bias = bool(hf.get("qkv_bias", True))
        elif starcoder2:
            attention_bias = bool(hf.get("use_bias", True))
        else:
            # (Seed-OSS: q/k/v biases, its class's default; its o_proj / MLP biases are refused below)
            attention_bias = bool(hf.get("attention_bias", arch in ("Qwen2ForCausalLM", "SeedOssForCausalLM")))
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            intermediate_size=int(hf.get("intermediate_size", 0)),
            rms_norm_eps=float(hf.get("norm_epsilon", 1e-5)) if starcoder2 else float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_scaled_max_positions(int(hf.get("max_position_embeddings", 4096)), rope_scaling),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", starcoder2)),  # Starcoder2Config ties by default
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MiniMaxM2ForCausalLM", *POST_NORM_ARCHITECTURES)
            or (arch == "Glm4MoeForCausalLM" and bool(hf.get("use_qk_norm", False))),
            attention_bias=attention_bias,
            moe_layers=moe_layers,
            moe_intermediate_size=moe_inter,
            shared_expert_intermediate_size=shared_inter,
            shared_expert_gated=shared_gated,
            mla=mla,
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            hf_config=hf,
            fp8_quant=fp8_block_quant(hf, path),
            # transformers' Glm4MoeConfig defaults to one such layer; DeepSeek-V3's configs state theirs
            num_mtp_layers=int(hf.get("num_nextn_predict_layers", int(arch == "Glm4MoeForCausalLM")) or 0)
            if arch in DEEPSEEK_MOE_ARCHITECTURES else 0,
            sliding_window=_sliding_window(hf, arch, path),
            sliding_window_layers=_sliding_window_layers(hf, arch, num_layers) if _sliding_window(hf, arch, path) else (),
            layer_norm=starcoder2,
            gelu_mlp=starcoder2,
            proj_bias=(starcoder2 or gpt_oss) and attention_bias,
            qk_norm_whole=arch in ("MiniMaxM2ForCausalLM", *POST_NORM_ARCHITECTURES),
            post_norm=arch in POST_NORM_ARCHITECTURES,
            **_granite_scalings(hf, arch, path),
            query_scaling=_query_scaling(rope, arch),
            attention_sinks=gpt_oss,
            moe_bias=gpt_oss,
            expert_activation=(float(hf.get("swiglu_alpha", 1.702)), float(hf.get("swiglu_limit", 7.0))) if gpt_oss else None,
            mxfp4_experts=_mxfp4_experts(hf, arch, path),
        )


def _sliding_window(hf: dict[str, Any], arch: str, path: str) -> int | None:
    """Mistral's, Mixtral's, StarCoder2's, Phi-3's, OLMo 3's, CWM's, gpt-oss's and Qwen2's `sliding_window` (None: every position is attended): a
    query at p attends p - W + 1 .. p in the layers `_sliding_window_layers` names. The torch
    attention backend serves it; with another, max_model_len is capped at W, where the window
    changes nothing (llm_engine.py)."""
    if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
        # Qwen2's window applies only with use_sliding_window (then to the layers from
        # max_window_layers on; all of them equal full attention within the window)
        w = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    else:
        w = (hf.get("sliding_window") if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Starcoder2ForCausalLM", "Phi3ForCausalLM",
                                                  "Olmo3ForCausalLM", "CwmForCausalLM", "Ministral3ForCausalLM", "GptOssForCausalLM")
             else None)
    if w is None:
        return None
    if isinstance(w, bool) or not isinstance(w, int) or w < 2:
        raise ValueError(f"sliding_window must be null or an integer >= 2 in {path or 'config'}, got {w!r}")
    return w


def _query_scaling(rope: dict[str, Any], arch: str) -> tuple[float, int] | None:
    """Ministral 3's `llama_4_scaling_beta` and the positions it counts in
    (`original_max_position_embeddings`), or None."""
    beta = rope.get("llama_4_scaling_beta")
    if arch != "Ministral3ForCausalLM" or not beta:
        return None
    return float(beta), int(rope["original_max_position_embeddings"])


def _granite_scalings(hf: dict[str, Any], arch: str, path: str) -> dict[str, Any]:
    """Granite's four multipliers (transformers' GraniteConfig fields, each 1.0 by default), as
    ModelConfig fields; other families have none."""
    if arch != "GraniteForCausalLM":
        return {}
    out: dict[str, Any] = {}
    for key, name in (("embedding_multiplier", "embedding_multiplier"), ("residual_multiplier", "residual_multiplier"),
                      ("attention_multiplier", "attention_scale"), ("logits_scaling", "logits_scaling")):
        v = hf.get(key, 1.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{key} must be a positive number in {path or 'config'}, got {v!r}")
        out[name] = float(v)
    return out


def _layer_rope(hf: dict[str, Any], arch: str, path: str) -> dict[str, Any]:
    """`rope_parameters` (transformers 5's field). OLMo 3 keys it by layer type; the decoder has one
    RoPE, so those must agree (they do in its configs' defaults); differing ones are refused."""
    rope = hf.get("rope_parameters") or {}
    per_type = {k: v for k, v in rope.items() if k in ("sliding_attention", "full_attention")}
    if not per_type:
        return rope
    first = next(iter(per_type.values()))
    if any(v != first for v in per_type.values()):
        raise ValueError(f"rope_parameters in {path or 'config'} differ between layer types ({per_type!r}); one RoPE for "
                         f"every layer is supported for {arch}")
    return first


def _sliding_window_layers(hf: dict[str, Any], arch: str, num_layers: int) -> tuple[int, ...]:
    """The layers a sliding window applies to: transformers' `layer_types` where the config gives
    them, else Qwen2's from max_window_layers on (its config class's rule), else all."""
    types = hf.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers or any(t not in ("sliding_attention", "full_attention") for t in types):
            raise ValueError(f"layer_types must list 'sliding_attention' / 'full_attention' for each of the {num_layers} layers, "
                             f"got {types!r}")
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
        first = hf.get("max_window_layers", 28)
        return tuple(range(min(int(first), num_layers), num_layers))
    return tuple(range(num_layers))


def _rotary_dim(hf: dict[str, Any], rope: dict[str, Any], arch: str, head_dim: int, path: str) -> int:
    """How many leading dims of each q/k head RoPE rotates (NeoX halves of that span, the rest
    passed through): head_dim x partial_rotary_factor, read top-level or from rope_parameters
    (transformers 5 moves it there). GLM-4.5 rotates half (its config class's default); the other
    families rotate whole heads in transformers, so a factor below 1 there is refused rather than
    computed as no checkpoint of theirs was trained."""
    where = path or "config"
    partial = ("Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM", "Phi3ForCausalLM")  # (Phi-4-mini rotates 3/4)
    if arch == "MiniMaxM2ForCausalLM" and hf.get("rotary_dim") is not None:  # MiniMax's own field (transformers derives the factor)
        rd = hf["rotary_dim"]
        if isinstance(rd, bool) or not isinstance(rd, int) or not 2 <= rd <= head_dim or rd % 2:
            raise ValueError(f"rotary_dim must be an even integer in [2, head_dim {head_dim}] in {where}, got {rd!r}")
        return rd
    default = 0.5 if arch == "Glm4MoeForCausalLM" else 1.0
    factor = next((f for f in (hf.get("partial_rotary_factor"), rope.get("partial_rotary_factor")) if f is not None), default)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ValueError(f"partial_rotary_factor must be a number in (0, 1] in {where}, got {factor!r}")
    if factor != 1 and arch not in partial:
        raise ValueError(f"partial_rotary_factor={factor} in {where} is not supported for {arch} (transformers rotates "
                         f"whole heads there); supported for {', '.join(partial)}")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise ValueError(f"partial_rotary_factor={factor} in {where} rotates {dim} of head_dim {head_dim} dims; it must be "
                         "an even number of at least 2")
    return dim


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def _scaled_max_positions(max_pos: int, scaling: dict[str, Any] | None) -> int:
    """The context a scaled RoPE reaches, as vLLM derives max_model_len: YaRN's original length x
    factor, linear's max_position_embeddings x factor (a checkpoint that already states the longer
    length keeps it); Llama-3's configs state their extended length themselves."""
    if scaling is None or scaling["rope_type"] == "llama3":
        return max_pos
    if scaling["rope_type"] == "longrope":  # served with its short factors: within the original length
        return min(max_pos, scaling["original_max_position_embeddings"])
    base = scaling["original_max_position_embeddings"] if scaling["rope_type"] == "yarn" else max_pos
    return max(max_pos, int(base * scaling["factor"]))


def _rope_scaling(raw: dict[str, Any] | None, hf: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The rope scaling as `cuttle.attention.rope` reads it: None for plain RoPE, else a dict with
    `rope_type` and every field its type uses filled in with transformers' defaults (so the tables
    never depend on a default guessed later), each checked; any other type is refused by name."""
    where = path or "config"
    if not raw:
        return None
    kind = str(raw.get("rope_type", raw.get("type", "default")))
    if kind == "su":  # Phi-3's first name for longrope
        kind = "longrope"
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type {kind!r} in {where} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if kind == "default":
        return None
    out = {k: v for k, v in raw.items() if k not in ("type", "rope_theta")}
    out["rope_type"] = kind
    max_pos = int(hf.get("max_position_embeddings", 4096))

    def number(name: str, low: float, default: Any = None, low_open: bool = False) -> None:
        value = out.get(name, default)
        if value is None:
            raise ValueError(f"rope_scaling.{name} is required for rope type {kind!r} in {where}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low or (low_open and value == low):
            raise ValueError(f"rope_scaling.{name} must be a finite number {'>' if low_open else '>='} {low} in {where}, got {value!r}")
        out[name] = value

    if kind == "longrope":
        _longrope(out, hf, max_pos, where)
        number("factor", 0.0, low_open=True)
        if out.get("attention_factor") is None:
            f, orig = out["factor"], out["original_max_position_embeddings"]
            out["attention_factor"] = 1.0 if f <= 1.0 else math.sqrt(1 + math.log(f) / math.log(orig))
        number("attention_factor", 0.0, low_open=True)
        return out
    if kind in ("llama3", "yarn"):
        # transformers prefers a top-level original_max_position_embeddings, then the dict's, then max_position_embeddings
        original = hf.get("original_max_position_embeddings") or out.get("original_max_position_embeddings") or max_pos
        out["original_max_position_embeddings"] = original
        number("original_max_position_embeddings", 1)
    if kind == "yarn" and out.get("factor") is None:
        out["factor"] = max_pos / out["original_max_position_embeddings"]  # DeepSeek-style: implied by the lengths
    number("factor", 0.0, low_open=True)
    if kind == "llama3":
        number("low_freq_factor", 0.0, 1.0, low_open=True)
        number("high_freq_factor", 0.0, 4.0, low_open=True)
        if out["high_freq_factor"] <= out["low_freq_factor"]:
            raise ValueError(f"rope_scaling.high_freq_factor must exceed low_freq_factor in {where}")
    if kind == "yarn":
        out["beta_fast"] = out.get("beta_fast") or 32  # transformers: a 0 or missing beta means the default
        out["beta_slow"] = out.get("beta_slow") or 1
        number("beta_fast", 0.0, low_open=True)
        number("beta_slow", 0.0, low_open=True)
        out["truncate"] = bool(out.get("truncate", True))
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            if out.get(name) is not None:
                number(name, 0.0)
    return out


def _longrope(out: dict[str, Any], hf: dict[str, Any], max_pos: int, where: str) -> None:
    """Phi-3 / Phi-4-mini's LongRoPE fields, as transformers reads them: per-dimension
    `short_factor`s (used while a sequence is within `original_max_position_embeddings`) and
    `long_factor`s (for a whole forward once a sequence passes it); `factor` defaults to
    max_position_embeddings / original, and the attention factor on cos / sin (filled in by the
    caller) to sqrt(1 + ln(factor) / ln(original)). Served with the short factors, within the
    original length (`ModelConfig.max_position_embeddings` is cut to it: the switch to the long
    factors re-rotates a whole sequence, which keys cached with the short ones cannot follow).
    The factor lists' lengths are checked against the rotary dimensions by `cuttle.attention.rope`."""
    original = hf.get("original_max_position_embeddings") or out.get("original_max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ValueError(f"rope type 'longrope' needs original_max_position_embeddings (a positive integer) in {where}, "
                         f"got {original!r}")
    out["original_max_position_embeddings"] = original
    for name in ("short_factor", "long_factor"):
        f = out.get(name)
        if (not isinstance(f, list) or not f
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0 for x in f)):
            raise ValueError(f"rope_scaling.{name} must be a list of positive numbers for rope type 'longrope' in {where}")
        out[name] = [float(x) for x in f]
    if out.get("factor") is None:
        out["factor"] = max_pos / original


def _check_unsupported(hf: dict[str, Any], arch: str, path: str) -> None:
    """Reject config features the decoder does not implement, rather than compute something else."""
    where = path or "config"
    act = hf.get("hidden_act", "gelu_pytorch_tanh" if arch == "Starcoder2ForCausalLM" else "silu")
    want = "gelu_pytorch_tanh" if arch == "Starcoder2ForCausalLM" else "silu"
    if act != want:
        raise ValueError(f"hidden_act {act!r} in {where} is not supported for {arch} (supported: {want})")
    for name, why in (("attention_out_bias", "an o_proj bias"), ("mlp_bias", "MLP biases")):
        if arch in ("SeedOssForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "CwmForCausalLM", "GraniteForCausalLM") and hf.get(name):
            raise ValueError(f"{name}: true in {where} ({why}) is not supported for {arch}")
    if arch == "LlamaForCausalLM" and hf.get("attention_bias") and not hf.get("fla_nsa"):
        # Llama's attention_bias puts a bias on o_proj too, which this decoder's Llama has not
        # (fla-org's NSA configs, translated to Llama's, mean q/k/v biases only: models/nsa_config.py)
        raise ValueError(f"attention_bias: true in {where} (q/k/v and o_proj biases) is not supported for {arch}")
    types = hf.get("attn_type_list")
    if arch == "MiniMaxM2ForCausalLM" and types is not None and any(t != 1 for t in types):
        # MiniMax's 0 is its linear ("lightning") attention, which this decoder does not have
        raise ValueError(f"attn_type_list in {where} has linear-attention layers (type 0); supported: full attention (1) only")
    # A quantized checkpoint loaded as if it were not one drops its scales and computes garbage.
    # cuttle's own MXFP8 expert checkpoints carry no quantization_config (their safetensors header
    # says so; see cuttle.moe.checkpoint); FP8 block-scaled ones are read by `fp8_block_quant`;
    # every other scheme named here is one we do not implement.
    qc = hf.get("quantization_config")
    if qc is not None:
        method = qc.get("quant_method", "unknown") if isinstance(qc, dict) else repr(qc)
        if method == "mxfp4" and arch == "GptOssForCausalLM":
            return  # read by _mxfp4_experts
        if method != "fp8":
            raise ValueError(
                f"quantization_config.quant_method {method!r} in {where} is not supported: cuttle loads unquantized "
                "checkpoints (bf16/fp16/fp32), FP8 block-scaled ones (quant_method 'fp8' with weight_block_size), gpt-oss's "
                "MXFP4 experts and its own MXFP8 expert checkpoints; refusing rather than loading the quantized weights "
                "without their scales"
            )


_MXFP4_KEYS = ("quant_method", "modules_to_not_convert")


def _mxfp4_experts(hf: dict[str, Any], arch: str, path: str) -> bool:
    """Whether config.json says the routed experts are stored in MXFP4 (gpt-oss's released
    checkpoints: `*_blocks` / `*_scales` beside the biases). Fields other than quant_method and
    modules_to_not_convert are refused; a `*_blocks` tensor of any module but the experts has no
    place in the model and is refused at load like any foreign tensor."""
    qc = hf.get("quantization_config")
    if arch != "GptOssForCausalLM" or not isinstance(qc, dict) or qc.get("quant_method") != "mxfp4":
        return False
    where = path or "config"
    unknown = sorted(k for k in qc if k not in _MXFP4_KEYS)
    if unknown:
        raise ValueError(f"quantization_config fields {unknown} in {where} are not supported for quant_method 'mxfp4' "
                         f"(known: {', '.join(_MXFP4_KEYS)})")
    return True


@dataclass(slots=True, frozen=True)
class Fp8BlockQuant:
    """An FP8 block-scaled checkpoint (Qwen3-*-FP8, DeepSeek-V3): each quantized linear weight is
    float8_e4m3fn beside a `weight_scale_inv` holding one fp32 multiplier per block of
    `block[0]` rows x `block[1]` columns; activations are quantized dynamically at run time by the
    original engines, so nothing else is stored. Modules in `ignored` keep full-precision weights."""

    block: tuple[int, int]
    ignored: tuple[str, ...]


# quantization_config keys of FP8 block checkpoints that change nothing in how the weights are read:
# scale_fmt "ue8m0" says how the scales were rounded (they are stored as values all the same);
# `dequantize` is transformers' own load-time switch
_FP8_INERT_KEYS = ("quant_method", "activation_scheme", "fmt", "weight_block_size", "modules_to_not_convert",
                   "ignored_layers", "scale_fmt", "dequantize")


def fp8_block_quant(hf: dict[str, Any], path: str = "") -> Fp8BlockQuant | None:
    """The FP8 block layout named by config.json's quantization_config, each field checked; None
    for an unquantized checkpoint. Static activation scales, the e5m2 format and per-tensor scales
    (no weight_block_size) are refused by field."""
    qc = hf.get("quantization_config")
    if qc is None or not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        return None
    where = path or "config"
    unknown = sorted(k for k in qc if k not in _FP8_INERT_KEYS)
    if unknown:
        raise ValueError(f"quantization_config fields {unknown} in {where} are not supported for quant_method 'fp8' (known: {', '.join(_FP8_INERT_KEYS)})")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme {scheme!r} in {where} is not supported (supported: dynamic)")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt {fmt!r} in {where} is not supported (supported: e4m3)")
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"quantization_config.scale_fmt {scale_fmt!r} in {where} is not supported (supported: ue8m0, or none)")
    block = qc.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise ValueError(
            f"quantization_config.weight_block_size in {where} must be two positive integers [rows, columns], got {block!r} "
            "(per-tensor FP8 scales are not supported)"
        )
    ignored: list[str] = []
    for key in ("modules_to_not_convert", "ignored_layers"):
        names = qc.get(key) or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"quantization_config.{key} in {where} must be a list of module names, got {names!r}")
        ignored += names
    return Fp8BlockQuant(block=(block[0], block[1]), ignored=tuple(ignored))


@dataclass(slots=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 4.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    # "fcfs": requests in arrival order; "priority": by each request's priority (lower first,
    # vLLM's order), then arrival; preemption takes the last of that order (engine/scheduler.py)
    scheduling_policy: str = "fcfs"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    device: str = "auto"
    seed: int = 0
    logprobs_mode: str = "processed"  # "processed": the distribution sampled from; "raw": the model's logits
    num_threads: int | None = None
    moe_quant: str | None = None  # "mxfp8": routed-expert weights quantized at load (docs/moe.md)
    quantization: str | None = None  # "mxfp8": attention / dense-MLP linears and routed experts quantized at load (docs/moe.md)
    quantize_lm_head: bool = False  # with quantization="mxfp8": the lm_head too (a tied one gets an MXFP8 copy; docs/moe.md)
    squid_positions: str | None = None  # squid documents: "shared" | "concat"; None: the model's config.json says, else "concat"
    max_documents: int = 64  # documents one request may carry
    # vLLM's: LLM.sleep / wake_up (and the server's /sleep, /wake_up) work only with this on, so that
    # no client of a server started without it can put it to sleep (engine/sleep_mode.py)
    enable_sleep_mode: bool = False
    # KV tiers under the device pool (docs/kv_tiers.md), all off by default. The host tier's size is
    # vLLM's `kv_offloading_size` (GiB); `num_host_kv_blocks` gives it in blocks instead (tests).
    # The disk tier (`kv_cache_dir`, bounded by `kv_cache_dir_gb`, LMCache's local-disk tier) sits
    # under the host tier and needs it.
    kv_offloading_size: float = 0.0
    num_host_kv_blocks: int | None = None
    kv_cache_dir: str | None = None
    kv_cache_dir_gb: float = 16.0
    # host-tier hits: "auto" lets the cost model choose copy-in or read in place (the attention
    # kernel reads the host blocks where they are); "never" always copies in; "always" reads in place
    kv_read_in_place: str = "auto"
    # training-free top-k attention for dense checkpoints (docs/nsa.md): None (dense), a spec string
    # "topk:budget=2048,block=64,dense_layers=2,summary=quest" or the same as a dict
    sparse_attention: str | dict[str, Any] | None = None
    # agent sessions (engine/session.py): open at once, and KV blocks their pins may hold
    # (None: half the pool, so the other requests always have the other half)
    max_sessions: int = 256
    max_session_kv_blocks: int | None = None
    # vLLM's shapes (docs/server.md, "vLLM compatibility"). `model` may be a Hugging Face repo id,
    # resolved here to its snapshot in the local HF cache (engine/hf_cache.py; never downloaded).
    revision: str | None = None  # of a repo id `model`: a branch or tag under refs/, or a commit
    tokenizer: str | None = None  # directory (or repo id) of tokenizer.json / tokenizer_config.json; None: the model's
    skip_tokenizer_init: bool = False  # token ids in, token ids out: no tokenizer loaded, output text None
    # KV pool = this fraction of the device's free memory (CPU: of MemAvailable) at start-up;
    # None: kv_cache_memory_gb. vLLM's fraction also covers the weights: cuttle's is the KV pool's alone.
    gpu_memory_utilization: float | None = None
    # vLLM's switch: True runs every step eagerly. Otherwise on CPU a decode step of up to
    # cpu_graph_max_batch sequences replays its recorded kernel calls (engine/step_graphs.py;
    # 0: never). No CUDA graphs, no torch.compile.
    enforce_eager: bool = False
    cpu_graph_max_batch: int = 8
    # besides those, up to this many larger decode batch sizes keep a graph once a size has run
    # step_graphs.HOT_STEPS decode steps (the least recently replayed is dropped to make room;
    # each holds its own buffers: ~1 MB a row on the 8-layer MoE preset, ~2 MB on the 28-layer 0.6B shape); 0: none
    cpu_graph_hot_batches: int = 4
    # sampling defaults: "auto" from the model's generation_config.json (a request's own values
    # win), "vllm" ignores that file, or a directory holding another generation_config.json
    generation_config: str = "auto"
    # every request's tokens and logprobs independent of the other requests of its steps, of how
    # its prompt is chunked and of preemption (vLLM's VLLM_BATCH_INVARIANT, SGLang's deterministic
    # inference): the CPU kernels that sum in an order set by the row count switch to one order
    # (attention/native/invariance.py); configurations that cannot give it are refused at start-up
    batch_invariant: bool = False
    # speculative decoding by n-gram prompt lookup (engine/spec_decode.py), vLLM's dict:
    # {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
    #  "disable_by_batch_size": 4}
    speculative_config: dict[str, Any] | None = None
    # LoRA adapters (engine/lora.py), vLLM's flags: requests name a PEFT adapter (LoRARequest, the
    # server's `model` field); at most `max_loras` adapters stay loaded (least recently used
    # dropped; reloaded from their directory on next use), each of rank <= `max_lora_rank`
    enable_lora: bool = False
    max_loras: int = 8
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        self.model = resolve_model(self.model, self.revision)
        if self.tokenizer is not None:
            self.tokenizer = resolve_model(self.tokenizer)
        if self.gpu_memory_utilization is not None and not (
            isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1
        ):
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory holding generation_config.json, got {self.generation_config!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if isinstance(self.cpu_graph_max_batch, bool) or not isinstance(self.cpu_graph_max_batch, int) or self.cpu_graph_max_batch < 0:
            raise ValueError(f"cpu_graph_max_batch must be an integer >= 0 (0: no kernel graphs), got {self.cpu_graph_max_batch!r}")
        if isinstance(self.cpu_graph_hot_batches, bool) or not isinstance(self.cpu_graph_hot_batches, int) or self.cpu_graph_hot_batches < 0:
            raise ValueError(f"cpu_graph_hot_batches must be an integer >= 0 (0: no graphs above cpu_graph_max_batch), "
                             f"got {self.cpu_graph_hot_batches!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}; got {self.scheduling_policy!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.logprobs_mode not in ("processed", "raw"):
            raise ValueError(f"logprobs_mode must be 'processed' or 'raw', got {self.logprobs_mode!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.squid_positions is not None and self.squid_positions not in ("shared", "concat"):
            raise ValueError(f"squid_positions must be None, 'shared' or 'concat'; got {self.squid_positions!r}")
        if self.max_documents < 0:
            raise ValueError(f"max_documents must be >= 0, got {self.max_documents}")
        if isinstance(self.kv_cache_memory_gb, bool) or not isinstance(self.kv_cache_memory_gb, (int, float)) or not (
                math.isfinite(self.kv_cache_memory_gb) and self.kv_cache_memory_gb > 0):
            # <= 0 started an engine of one block (max_model_len 16), nan / inf failed deep inside
            raise ValueError(f"kv_cache_memory_gb must be a finite number of GiB > 0, got {self.kv_cache_memory_gb!r}")
        if self.num_kv_blocks is not None and (isinstance(self.num_kv_blocks, bool) or not isinstance(self.num_kv_blocks, int)
                                               or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be an integer >= 1, got {self.num_kv_blocks!r}")
        if not (math.isfinite(self.kv_offloading_size) and self.kv_offloading_size >= 0):
            raise ValueError(f"kv_offloading_size must be a finite number of GiB >= 0 (0: no host tier), got {self.kv_offloading_size}")
        if self.num_host_kv_blocks is not None and self.num_host_kv_blocks < 1:
            raise ValueError(f"num_host_kv_blocks must be >= 1, got {self.num_host_kv_blocks}")
        if not (math.isfinite(self.kv_cache_dir_gb) and self.kv_cache_dir_gb > 0):
            raise ValueError(f"kv_cache_dir_gb must be a finite number of GiB > 0, got {self.kv_cache_dir_gb}")
        if self.kv_cache_dir is not None and not self.has_host_tier:
            raise ValueError("kv_cache_dir needs the host tier above it: set kv_offloading_size (GiB) or num_host_kv_blocks")
        if self.kv_cache_dir is not None and (not self.kv_cache_dir or (os.path.exists(self.kv_cache_dir) and not os.path.isdir(self.kv_cache_dir))):
            raise ValueError(f"kv_cache_dir must name a directory, got {self.kv_cache_dir!r}")
        if self.kv_read_in_place not in ("auto", "never", "always"):
            raise ValueError(f"kv_read_in_place must be 'auto', 'never' or 'always'; got {self.kv_read_in_place!r}")
        parse_sparse_attention(self.sparse_attention)  # a bad spec raises naming its field
        if self.max_sessions < 0:
            raise ValueError(f"max_sessions must be >= 0, got {self.max_sessions}")
        if self.max_session_kv_blocks is not None and self.max_session_kv_blocks < 0:
            raise ValueError(f"max_session_kv_blocks must be >= 0, got {self.max_session_kv_blocks}")
        if self.moe_quant is not None and self.moe_quant not in MOE_QUANT_MODES:
            raise ValueError(f"moe_quant must be None or one of {', '.join(MOE_QUANT_MODES)}; got {self.moe_quant!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be None or one of {', '.join(QUANTIZATION_MODES)}; got {self.quantization!r}")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head=True needs quantization='mxfp8' (the lm_head is quantized with the other linears)")
        SpecConfig.parse(self.speculative_config)  # a bad spec raises naming its field
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")

    @property
    def has_host_tier(self) -> bool:
        return self.kv_offloading_size > 0 or self.num_host_kv_blocks is not None

    def torch_dtype(self, model_config: ModelConfig, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if device.type == "cpu":
            return torch.bfloat16 if torch.backends.mkldnn.is_available() else torch.float32
        name = model_config.hf_config.get("torch_dtype") or model_config.hf_config.get("dtype") or "bfloat16"
        return DTYPES.get(name, torch.bfloat16)


# The one source of engine defaults: `LLM` and the CLI read theirs from here.
ENGINE_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(EngineConfig) if f.name != "model"}
