"""RoPE scaling from real checkpoints' configs (YaRN with its attention factor, linear, Llama-3),
checked against transformers in float32: the cos/sin tables bit for bit, and the engine's greedy
tokens and logprobs on tiny random Qwen3 / Llama / DeepSeek-V3 checkpoints, at positions well past
the original context the scaling extends. Rope types cuttle does not implement are refused by name.
"""
from __future__ import annotations

import random

import pytest
import torch

from cuttle.attention.rope import RotaryEmbedding
from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import ModelConfig
from helpers import assert_scored_by_transformers, write_tokenizer

TOL = 1e-4
ORIGINAL = 32  # original_max_position_embeddings of every scaled config below
NEW_TOKENS = 24
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
               eos_token_id=1, bos_token_id=None)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
SCALINGS = {
    "yarn": YARN,
    "yarn_betas_untruncated": {**YARN, "factor": 8.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn_mscale": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.7},
    "yarn_attention_factor": {**YARN, "attention_factor": 1.3},
    "linear": {"rope_type": "linear", "factor": 3.0},
    "linear_legacy_key": {"type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
}


def _model(arch: str, scaling: dict, seed: int = 3):
    import transformers

    if arch == "qwen3":
        cfg, cls = transformers.Qwen3Config(head_dim=16, rope_scaling=dict(scaling), **_COMMON), transformers.Qwen3ForCausalLM
    elif arch == "llama":
        cfg, cls = transformers.LlamaConfig(head_dim=16, rope_scaling=dict(scaling), **_COMMON), transformers.LlamaForCausalLM
    elif arch == "deepseek_v3":  # MLA: YaRN's mscale_all_dim also scales the softmax
        common = {**_COMMON, "num_key_value_heads": 4, "intermediate_size": 96, "num_hidden_layers": 3}
        cfg = transformers.DeepseekV3Config(
            moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
            first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, rope_scaling=dict(scaling), **common)
        cls = transformers.DeepseekV3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
    return model


@pytest.mark.parametrize("name", list(SCALINGS))
def test_tables_equal_transformers(name):
    """cos/sin (attention factor included) at every position, bit for bit, for each scaling variant."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    model = _model("qwen3", SCALINGS[name])
    hf = model.config
    ref = Qwen3RotaryEmbedding(hf)
    cfg = ModelConfig.from_hf({**hf.to_dict(), "architectures": ["Qwen3ForCausalLM"]})
    ours = RotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, torch.device("cpu"))
    cos, sin = ref(torch.zeros(1, 1, 16), torch.arange(cfg.max_position_embeddings)[None])
    assert torch.equal(cos[0, :, :8], ours.cos) and torch.equal(sin[0, :, :8], ours.sin)
    assert ours.attention_factor == ref.attention_scaling
    if name.startswith("yarn"):
        assert ours.attention_factor > 1.0  # the factor is really exercised


def _check_engine(tmp_path, arch: str, scaling: dict, rope_in_config_as: str = "rope_parameters") -> None:
    model = _model(arch, scaling)
    path = str(tmp_path)
    model.save_pretrained(path)
    write_tokenizer(path, 256)
    if rope_in_config_as == "rope_scaling":  # the key real (pre-transformers-5) checkpoints carry
        import json
        import os

        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = dict(scaling)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
    assert ModelConfig.from_pretrained(path).rope_scaling is not None
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 90, 150)]  # up to ~5x the original context
    llm = LLM(path, dtype="float32", attention_backend="torch", num_kv_blocks=64, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    for prompt, o in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert_scored_by_transformers(model, prompt, o, TOL)
        assert len(set(o.outputs[0].token_ids)) > 3


@pytest.mark.parametrize("arch,name", [("qwen3", "yarn"), ("qwen3", "yarn_mscale"), ("llama", "linear"), ("llama", "llama3")])
def test_engine_token_exact_vs_transformers(tmp_path, arch, name):
    _check_engine(tmp_path, arch, SCALINGS[name])


def test_engine_reads_rope_scaling_key(tmp_path):
    """A config.json with `rope_scaling` and a top-level `rope_theta`, as Qwen3 / Qwen2.5 ship them."""
    _check_engine(tmp_path, "qwen3", SCALINGS["yarn_betas_untruncated"], rope_in_config_as="rope_scaling")


def test_deepseek_yarn_softmax_mscale(tmp_path):
    """DeepSeek-V3 (MLA): YaRN with mscale / mscale_all_dim, whose square also scales the logits."""
    _check_engine(tmp_path, "deepseek_v3", {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})


def _hf_config(rope_scaling) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "num_attention_heads": 2,
            "num_hidden_layers": 1, "max_position_embeddings": 128, "rope_scaling": rope_scaling}


@pytest.mark.parametrize("kind", ["dynamic", "ntk"])
def test_unsupported_rope_type_is_refused_by_name(kind):
    with pytest.raises(ValueError, match=f"rope_scaling.rope_type '{kind}'.*supported: default, linear, llama3, yarn, longrope"):
        ModelConfig.from_hf(_hf_config({"rope_type": kind, "factor": 2.0}))


@pytest.mark.parametrize("scaling,field", [
    ({"rope_type": "linear"}, "factor"),
    ({"rope_type": "linear", "factor": 0}, "factor"),
    ({"rope_type": "yarn", "factor": float("nan")}, "factor"),
    ({"rope_type": "yarn", "factor": 2.0, "beta_fast": -1}, "beta_fast"),
    ({"rope_type": "yarn", "factor": 2.0, "attention_factor": "big"}, "attention_factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}, "high_freq_factor"),
])
def test_bad_rope_fields_are_refused_by_name(scaling, field):
    with pytest.raises(ValueError, match=f"rope_scaling.{field}"):
        ModelConfig.from_hf(_hf_config(scaling))


def test_yarn_defaults_filled_as_transformers_does():
    """No original length: max_position_embeddings (so factor implied = 1 is explicit here); no factor
    but both lengths (DeepSeek-style): factor = their ratio; a top-level original length wins."""
    cfg = ModelConfig.from_hf({**_hf_config({"rope_type": "yarn", "original_max_position_embeddings": 32})})
    assert cfg.rope_scaling["factor"] == 4.0 and cfg.rope_scaling["beta_fast"] == 32 and cfg.rope_scaling["truncate"] is True
    cfg = ModelConfig.from_hf({**_hf_config({"rope_type": "yarn", "factor": 2.0}), "original_max_position_embeddings": 16})
    assert cfg.rope_scaling["original_max_position_embeddings"] == 16
    assert ModelConfig.from_hf(_hf_config({"rope_type": "default"})).rope_scaling is None


@pytest.mark.parametrize("name", ["yarn", "yarn_mscale", "linear", "llama3"])
def test_delta_rotation_composes(name):
    """A query rotated at p, then by the delta tables of d (how the backends attend keys moved by
    d), equals the query rotated at p - d: YaRN's attention factor rides on both alike."""
    cfg = ModelConfig.from_hf(_hf_config(SCALINGS[name]) | {"head_dim": 16, "max_position_embeddings": 512})
    rope = RotaryEmbedding(16, 512, cfg.rope_theta, cfg.rope_scaling, torch.device("cpu"))
    from cuttle.attention.rope import apply_rope, rotate_partial

    torch.manual_seed(0)
    q = torch.randn(6, 2, 16)
    p = torch.tensor([40, 90, 200, 300, 411, 500])
    d = [3, 17, 64, 100, 333, 499]
    cos, sin = rope.tables(p, torch.float32)
    moved = rotate_partial(apply_rope(q, cos, sin), *(t[:, None, :] for t in rope.delta_tables(d)))
    cos2, sin2 = rope.tables(p - torch.tensor(d), torch.float32)
    torch.testing.assert_close(moved, apply_rope(q, cos2, sin2), rtol=0, atol=2e-5)


def test_scaled_context_reaches_past_max_position_embeddings(tmp_path):
    """A Qwen3 config with YaRN added by hand (as Qwen3's model cards say: max_position_embeddings
    left at the original length) serves original x factor positions, as vLLM derives it; the
    positions past max_position_embeddings still match transformers, which has no table limit."""
    import json
    import os

    model = _model("qwen3", YARN)
    path = str(tmp_path)
    model.save_pretrained(path)
    write_tokenizer(path, 256)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = 64
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert ModelConfig.from_pretrained(path).max_position_embeddings == ORIGINAL * 4
    linear = ModelConfig.from_hf(_hf_config({"rope_type": "linear", "factor": 3.0}))
    assert linear.max_position_embeddings == 128 * 3
    assert ModelConfig.from_hf(_hf_config(SCALINGS["llama3"])).max_position_embeddings == 128
    llm = LLM(path, dtype="float32", attention_backend="torch", num_kv_blocks=16)
    assert llm.engine.max_model_len == 128
    prompt = [random.Random(9).randrange(3, 256) for _ in range(100)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    assert_scored_by_transformers(model, prompt, llm.generate([prompt], params, use_tqdm=False)[0], TOL)
