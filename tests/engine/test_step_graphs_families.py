"""Decode steps of the families whose layers had torch ops between the kernels replay as kernel
graphs now (engine/step_graphs.py), with the eager engine's tokens and logprobs bit for bit: a
shared expert's add and gate (Qwen2-MoE, GLM-4.5), OLMo's post-norm adds and whole-row q/k norms
(in place), MiniMax-M2's whole-row norms and sigmoid router, Granite's multipliers, Ministral 3's
query scaling past its first band, StarCoder2's LayerNorm and gelu MLP (native kernels),
multi-head latent attention (DeepSeek-V3 with its q bottleneck and interleaved rope, a
DeepSeek-V2-Lite-shaped full-rank q: `fused.mla_qkv`), and Mixtral (which replayed before). Tiny
random checkpoints, bf16 and fp32; and the MLA assembly against the torch code it replaces."""
from __future__ import annotations

import pytest
import torch

from cuttle.attention.native import kernels
from cuttle.engine import LLM, SamplingParams
from helpers import parity_prompts, write_tokenizer
from moe_families import family_model

pytestmark = pytest.mark.skipif(kernels().lib is None, reason="native CPU kernel library not built (graphs replay its kernels)")

SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
COMMON = dict(vocab_size=256, intermediate_size=192, num_hidden_layers=2, max_position_embeddings=512, rms_norm_eps=1e-6,
              eos_token_id=1, bos_token_id=None, pad_token_id=0, **SHAPE)


def _dense(name: str):
    import transformers

    if name == "olmo2":
        return transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**COMMON))
    if name == "olmo3":
        return transformers.Olmo3ForCausalLM(transformers.Olmo3Config(sliding_window=256, **COMMON))
    if name == "deepseek_v2_lite":  # full-rank q, no latent biases, V narrower than K (padded)
        return transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
            q_lora_rank=None, topk_method="greedy", kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64, first_k_dense_replace=1,
            **{**COMMON, "num_key_value_heads": 4}))
    if name == "starcoder2":
        return transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(sliding_window=None, **COMMON))
    if name == "granite":
        return transformers.GraniteForCausalLM(transformers.GraniteConfig(
            embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.05, logits_scaling=2.5, **COMMON))
    # Ministral 3: bands of 16 positions, so the prompts' decode steps are past several
    rope = {"type": "yarn", "rope_theta": 1e6, "factor": 32.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1, "max_position_embeddings": 512}
    return transformers.Ministral3ForCausalLM(transformers.Ministral3Config(rope_parameters=rope, **COMMON))


DENSE = ("olmo2", "olmo3", "granite", "ministral3", "starcoder2", "deepseek_v2_lite")
FAMILIES = [*DENSE, "qwen2_moe", "glm4_moe", "glm4_moe_air", "minimax_m2", "deepseek_v3", "mixtral"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    out = {}
    for name in FAMILIES:
        model = _dense(name) if name in DENSE else family_model(name)
        out[name] = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(out[name])
        write_tokenizer(out[name], 256)
    return out


def _run(path: str, dtype: str, eager: bool):
    llm = LLM(path, dtype=dtype, num_kv_blocks=64, enable_prefix_caching=False, enforce_eager=eager)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    outs = llm.generate(parity_prompts()[1:4], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in r.items()) for r in o.outputs[0].logprobs])
            for o in outs], llm


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_replays_kernel_graphs(paths, family: str, dtype: str) -> None:
    eager, _ = _run(paths[family], dtype, True)
    graphed, llm = _run(paths[family], dtype, False)
    assert llm.engine.runner.graphs.counters["graph_steps"] > 0, llm.engine.runner.graphs.counters
    assert graphed == eager


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave,q_lora", [(True, 24), (False, None)])
def test_mla_assembly_is_the_torch_code(dtype, interleave: bool, q_lora) -> None:
    """`fused.mla_qkv` (via MLAttention._cache_qkv_native) equals the torch code's q, k, v padded
    to the cache width, bit for bit."""
    from cuttle.engine.config import MLAConfig, ModelConfig
    from cuttle.engine.models.mla import MLAttention, _pad_to
    from cuttle.attention.rope import RotaryEmbedding

    mla = MLAConfig(q_lora_rank=q_lora, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                    rope_interleave=interleave)
    cfg = ModelConfig(architecture="DeepseekV3ForCausalLM", vocab_size=64, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=4,
                      head_dim=24, rotary_dim=8, intermediate_size=64, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                      max_position_embeddings=128, tie_word_embeddings=False, qk_norm=False, attention_bias=False, moe_layers=[],
                      moe_intermediate_size=0, shared_expert_intermediate_size=0, shared_expert_gated=False, mla=mla,
                      eos_token_ids=[], bos_token_id=None, hf_config={})
    attn = MLAttention(cfg, dtype)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(7, 64, generator=g).to(dtype)
    rope = RotaryEmbedding(8, 128, 10000.0, None, torch.device("cpu"))
    cos, sin = (t[torch.arange(3, 10)][:, None, :] for t in rope.cast_tables(dtype))
    with torch.no_grad():
        got = attn._cache_qkv_native(x, cos, sin)
        want = [_pad_to(t, 24) for t in attn._qkv(x, cos, sin)]
    assert got is not None
    for a, b in zip(got, want):
        assert torch.equal(a, b)
