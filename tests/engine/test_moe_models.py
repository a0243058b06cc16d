"""MoE model families in the engine, and MXFP8 experts (`moe_quant="mxfp8"`).

Each family transformers provides (Qwen2-MoE, Mixtral, DeepSeek-V3 with MLA) is checked token-exact
against it (greedy, float32, chunked prefill) on a tiny random checkpoint; the loader is checked
on transformers' in-memory (fused) names too. transformers scores the engine's whole greedy
sequence in one forward: its argmax at every generated position must be the engine's token, which
by induction is the same as its own greedy `generate` producing them (at a 48th of the cost). MXFP8 experts: bit-identical to `FusedMoE.quantize_`,
a pre-quantized checkpoint reloads to the same model, weight updates re-quantize, and greedy
agreement / |delta logprob| against bf16 experts on a tiny random Qwen3-MoE and on the embedded
default model (when it has been trained).
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import EngineConfig, ModelConfig
from cuttle.engine.default_model import DEFAULT_MODEL_DIR
from cuttle.engine.models import load_model, load_weights
from cuttle.engine.models.loader import checkpoint_files, iter_tensors
from cuttle.engine.models.moe_quant import moe_layers
from cuttle.engine.models.quantized_checkpoint import save_quantized_checkpoint
from cuttle.moe import FusedMoE
from cuttle.moe.checkpoint import is_quantized_checkpoint
from cuttle.moe.layer import QUANTIZED_NAMES
from helpers import NEW_TOKENS, make_checkpoint, parity_prompts, tiny_config, write_tokenizer
from moe_families import family_model, randomize_

TOL = 1e-4
PROMPTS = [parity_prompts()[i] for i in (0, 2, 3, 5, 7)]  # 3, 16, 17, 40 and 70 tokens

FAMILIES = ["qwen2_moe", "mixtral", "deepseek_v3", "deepseek_v3_full_q", "glm4_moe", "glm4_moe_air", "minimax_m2"]


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, dict[str, Any]]:
    out = {}
    for family in FAMILIES:
        path = str(tmp_path_factory.mktemp(family))
        model = family_model(family)
        model.save_pretrained(path)
        write_tokenizer(path, 256)
        out[family] = {"path": path, "model": model}
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_family_token_exact_vs_transformers(families, family):
    ref = families[family]
    llm = LLM(ref["path"], dtype="float32", attention_backend="torch", num_kv_blocks=64, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, o in zip(PROMPTS, outs):
        c = o.outputs[0]
        seq = prompt + c.token_ids
        with torch.no_grad():
            hf = ref["model"](torch.tensor([seq])).logits[0].float().log_softmax(-1)
        n = len(prompt)
        assert hf[n - 1 : -1].argmax(-1).tolist() == c.token_ids  # transformers' greedy choice, every step
        for step, tok in enumerate(c.token_ids):
            assert abs(c.logprobs[step][tok].logprob - hf[n - 1 + step, tok].item()) <= TOL
        for pos in range(1, n):
            assert abs(o.prompt_logprobs[pos][prompt[pos]].logprob - hf[pos - 1, prompt[pos]].item()) <= TOL
        assert len(set(c.token_ids)) > 3  # a varied continuation, not one token repeated
    assert llm.stats()["steps"] > NEW_TOKENS + 5  # prompts were prefilled in chunks over the cache


@pytest.mark.parametrize("family", FAMILIES)
def test_family_training_path_matches_transformers(families, family):
    """`forward_packed` (the trainer's path: dense attention, document mask) on two packed prompts."""
    ref = families[family]
    cfg = ModelConfig.from_pretrained(ref["path"])
    model = load_model(ref["path"], cfg, torch.float32, torch.device("cpu"))
    a, b = PROMPTS[1], PROMPTS[3]
    ids = torch.tensor([a + b])
    positions = torch.tensor([list(range(len(a))) + list(range(len(b)))])
    docs = torch.tensor([[0] * len(a) + [1] * len(b)])
    with torch.no_grad():
        got = model.compute_logits(model.forward_packed(ids, positions, docs))[0].log_softmax(-1)
        want = torch.cat([ref["model"](torch.tensor([p])).logits[0].float().log_softmax(-1) for p in (a, b)])
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_family_configs_pick_the_right_layers(families):
    qwen2 = ModelConfig.from_pretrained(families["qwen2_moe"]["path"])
    assert qwen2.moe_layers == [0, 2] and qwen2.shared_expert_gated and qwen2.attention_bias
    mixtral = ModelConfig.from_pretrained(families["mixtral"]["path"])
    assert mixtral.moe_layers == [0, 1, 2] and mixtral.shared_expert_intermediate_size == 0
    ds = ModelConfig.from_pretrained(families["deepseek_v3_full_q"]["path"])
    assert ds.moe_layers == [1, 2] and ds.shared_expert_intermediate_size == 64 and not ds.shared_expert_gated
    assert (ds.num_kv_heads, ds.head_dim, ds.rotary_dim) == (4, 32, 8)  # cache holds V (32) > q.k (24)
    glm = ModelConfig.from_pretrained(families["glm4_moe"]["path"])
    assert glm.moe_layers == [1, 2] and glm.shared_expert_intermediate_size == 32 and not glm.shared_expert_gated
    assert (glm.head_dim, glm.rotary_dim, glm.qk_norm, glm.attention_bias, glm.num_mtp_layers) == (24, 12, True, True, 1)
    air = ModelConfig.from_pretrained(families["glm4_moe_air"]["path"])
    assert air.moe_layers == [2] and air.shared_expert_intermediate_size == 64
    assert (air.head_dim, air.rotary_dim, air.qk_norm) == (16, 4, False)
    mm = ModelConfig.from_pretrained(families["minimax_m2"]["path"])
    assert mm.moe_layers == [0, 1, 2] and (mm.rotary_dim, mm.qk_norm, mm.qk_norm_whole, mm.moe_intermediate_size) == (4, True, True, 32)


def test_glm_checkpoint_skips_its_mtp_layer(families, tmp_path):
    """GLM-4.5 checkpoints carry their multi-token-prediction layer after the decoder's
    (`model.layers.{num_hidden_layers}.*`: eh_proj, enorm, hnorm, shared_head and a whole MoE
    layer); decoding does not use it, so a strict load skips it, and a layer past it is refused."""
    from safetensors.torch import load_file, save_file

    src = families["glm4_moe"]["path"]
    cfg = ModelConfig.from_pretrained(src)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in tensors.items() if k.startswith("model.layers.2.")}
    mtp.update({"model.layers.3.eh_proj.weight": torch.zeros(64, 128), "model.layers.3.enorm.weight": torch.ones(64),
                "model.layers.3.hnorm.weight": torch.ones(64), "model.layers.3.shared_head.norm.weight": torch.ones(64),
                "model.layers.3.shared_head.head.weight": torch.zeros(256, 64)})
    path = str(tmp_path / "with_mtp")
    os.makedirs(path)
    for name in os.listdir(src):
        if name != "model.safetensors":
            os.symlink(os.path.join(src, name), os.path.join(path, name))
    save_file({**tensors, **mtp}, os.path.join(path, "model.safetensors"))
    plain = load_model(src, cfg, torch.float32, torch.device("cpu"))
    with_mtp = load_model(path, cfg, torch.float32, torch.device("cpu"))
    for (name, a), b in zip(plain.named_parameters(), with_mtp.parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="layer 4 but the config has 3 layers"):
        load_weights(with_mtp, [("model.layers.4.enorm.weight", torch.ones(64))], strict=True)


def test_minimax_linear_attention_layers_are_refused(families):
    import json as _json

    with open(os.path.join(families["minimax_m2"]["path"], "config.json")) as f:
        hf = _json.load(f)
    assert ModelConfig.from_hf({**hf, "attn_type_list": [1, 1, 1]}).qk_norm_whole
    with pytest.raises(ValueError, match="attn_type_list .* linear-attention layers"):
        ModelConfig.from_hf({**hf, "attn_type_list": [0, 1, 1]})


def test_partial_rotary_is_glm_only(tmp_path):
    """transformers rotates whole heads for the other families: a partial_rotary_factor there is
    refused by name rather than served as no checkpoint of theirs was trained; a bad factor is
    refused for GLM too."""
    base = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 4, "intermediate_size": 64}
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 in config is not supported for Qwen3ForCausalLM"):
        ModelConfig.from_hf({**base, "partial_rotary_factor": 0.5})
    assert ModelConfig.from_hf({**base, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 1.0}}).rotary_dim == 8
    glm = {**base, "architectures": ["Glm4MoeForCausalLM"], "n_routed_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 16}
    assert ModelConfig.from_hf(glm).rotary_dim == 4  # the config class's default: half of head_dim 8
    for bad in (0, 1.5, "half", True):
        with pytest.raises(ValueError, match="partial_rotary_factor must be a number in"):
            ModelConfig.from_hf({**glm, "partial_rotary_factor": bad})
    with pytest.raises(ValueError, match="rotates 1 of head_dim 8 dims"):
        ModelConfig.from_hf({**glm, "partial_rotary_factor": 0.125})


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_in_memory_names_load_the_same_model(families, family):
    """A trainer holding the transformers model sends its in-memory names (fused experts, Mixtral's
    `mlp.gate`): they must fill every parameter to exactly what the checkpoint gave."""
    ref = families[family]
    cfg = ModelConfig.from_pretrained(ref["path"])
    from_disk = load_model(ref["path"], cfg, torch.float32, torch.device("cpu"))
    named = [*ref["model"].named_parameters(), *ref["model"].named_buffers()]
    fresh = load_model(ref["path"], cfg, torch.float32, torch.device("cpu"))
    for p in fresh.parameters():
        p.data.zero_()
    unused = load_weights(fresh, named, strict=True)
    assert all("rotary_emb" in n for n in unused)
    disk = dict(from_disk.named_parameters())
    for name, p in fresh.named_parameters():
        assert torch.equal(p, disk[name]), name
    if family.startswith(("deepseek", "glm4", "minimax")):
        assert fresh.layers[-1].mlp.e_score_correction_bias.abs().sum() > 0


# ---- MXFP8 experts ---------------------------------------------------------------------------

def _mx_buffers(model) -> dict[str, torch.Tensor]:
    """Every MXFP8 layer's expert bytes by buffer name (an engine's layers hold them packed: unpacked copies)."""
    out: dict[str, torch.Tensor] = {}
    for i, layer in moe_layers(model).items():
        if layer.quant == "mxfp8":
            w13, w2 = layer.expert_weights()
            for field, t in zip(QUANTIZED_NAMES, (w13.data, w13.scale, w2.data, w2.scale)):
                out[f"layers.{i}.mlp.{field}"] = t.view(torch.uint8)
    assert out, "no MXFP8 expert layer"
    return out


@pytest.fixture(scope="module")
def qwen3_moe_path(tmp_path_factory) -> str:
    """Tiny random Qwen3-MoE (hidden 64, 8 experts of width 32, top-2): MXFP8-compatible shapes."""
    import transformers

    path = str(tmp_path_factory.mktemp("qwen3_moe_mx"))
    model = randomize_(transformers.Qwen3MoeForCausalLM(tiny_config("qwen3_moe")).float().eval(), 0.1, seed=5)
    model.save_pretrained(path)
    write_tokenizer(path, 256)
    return path


def test_quantize_at_load_equals_fused_moe_quantize(qwen3_moe_path):
    cfg = ModelConfig.from_pretrained(qwen3_moe_path)
    cpu = torch.device("cpu")
    plain = load_model(qwen3_moe_path, cfg, torch.bfloat16, cpu)
    bf16_bytes = sum(layer.mlp.expert_weight_bytes() for layer in plain.layers)
    for layer in plain.layers:
        layer.mlp.quantize_("mxfp8")
    quant = load_model(qwen3_moe_path, cfg, torch.bfloat16, cpu, moe_quant="mxfp8")
    assert all(isinstance(layer.mlp, FusedMoE) and layer.mlp.quant == "mxfp8" for layer in quant.layers)
    assert not any(n.endswith((".w13", ".w2")) for n, _ in quant.named_parameters())
    want = _mx_buffers(plain)
    got = _mx_buffers(quant)
    assert set(got) == set(want) and len(got) == 4 * cfg.num_layers
    for name in want:
        assert torch.equal(got[name], want[name]), name
    mx_bytes = sum(layer.mlp.expert_weight_bytes() for layer in quant.layers)
    assert mx_bytes / bf16_bytes == 8.25 / 16


def test_moe_quant_errors(qwen3_moe_path, tmp_path):
    with pytest.raises(ValueError, match="moe_quant"):
        EngineConfig(model=qwen3_moe_path, moe_quant="int4")
    dense = str(tmp_path / "dense")
    make_checkpoint(dense, "qwen3", seed=1)
    with pytest.raises(ValueError, match="no MoE layers"):
        LLM(dense, moe_quant="mxfp8")


def teacher_forced(ref: LLM, test: LLM, prompts: list[list[int]], n: int) -> tuple[float, float, float]:
    """Greedy agreement of `test` on `ref`'s greedy continuations, the same where `ref`'s choice
    wins by >= 0.1 nats, and the mean |delta logprob| of `ref`'s tokens.

    Scored teacher-forced (the reference tokens are fed as `test`'s prompt): one early
    disagreement would otherwise make every later token incomparable."""
    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
    outs = ref.generate(prompts, greedy, use_tqdm=False)
    full = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
    scored = test.generate(full, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=1), use_tqdm=False)
    same, clear, deltas = [], [], []
    for p, o, s in zip(prompts, outs, scored):
        c = o.outputs[0]
        for j, tok in enumerate(c.token_ids):
            got = s.prompt_logprobs[len(p) + j][tok]
            top2 = sorted((lp.logprob for lp in c.logprobs[j].values()), reverse=True)[:2]
            same.append(got.rank == 1)
            clear.append(top2[0] - top2[1] >= 0.1)
            deltas.append(abs(got.logprob - c.logprobs[j][tok].logprob))
    decisive = [s for s, c in zip(same, clear) if c]
    return sum(same) / len(same), sum(decisive) / max(1, len(decisive)), sum(deltas) / len(deltas)


def test_mxfp8_engine_tracks_bf16_engine(qwen3_moe_path):
    kw = dict(dtype="bfloat16", num_kv_blocks=128, logprobs_mode="raw")
    bf16 = LLM(qwen3_moe_path, **kw)
    mx = LLM(qwen3_moe_path, moe_quant="mxfp8", **kw)
    fp32 = LLM(qwen3_moe_path, **{**kw, "dtype": "float32"})
    agreement, decisive, mean_delta = teacher_forced(bf16, mx, parity_prompts(), NEW_TOKENS)
    _, _, bf16_delta = teacher_forced(fp32, bf16, parity_prompts(), NEW_TOKENS)
    print(f"\ntiny random Qwen3-MoE, MXFP8 vs bf16 experts: agreement {agreement:.3f} "
          f"({decisive:.3f} where bf16 wins by >= 0.1 nats), mean |dlogprob| {mean_delta:.4f} "
          f"(bf16 vs fp32 engine: {bf16_delta:.4f})")
    # A random model's next-token margins are tiny (many < 0.1 nats, where MXFP8's rounding flips
    # near-ties), so the overall bar is lower than on a trained model; decisive tokens must agree.
    assert agreement >= 0.92
    assert decisive >= 0.98
    # yardstick from the same run: MXFP8 experts move logprobs by the order of what running the
    # whole model in bf16 instead of fp32 does (measured 1.4-2.5x over seeds), and not by zero
    assert 0 < mean_delta < min(0.05, 4 * bf16_delta)


def test_prequantized_checkpoint_round_trip(qwen3_moe_path, tmp_path):
    kw = dict(dtype="bfloat16", num_kv_blocks=128, logprobs_mode="raw")
    at_load = LLM(qwen3_moe_path, moe_quant="mxfp8", **kw)
    out = str(tmp_path / "mx")
    save_quantized_checkpoint(at_load.engine.runner.model, qwen3_moe_path, out)
    from safetensors import safe_open

    headers = []
    for file in checkpoint_files(out):
        with safe_open(file, framework="pt") as f:
            headers.append(is_quantized_checkpoint(f.metadata()))
    assert sorted(headers) == [False, True]
    assert not any(".experts.0." in name for name, _ in iter_tensors(out))  # no bf16 experts on disk
    reloaded = LLM(out, **kw)  # no moe_quant: the header says the experts are MXFP8
    a, b = _mx_buffers(at_load.engine.runner.model), _mx_buffers(reloaded.engine.runner.model)
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    for x, y in zip(at_load.generate(PROMPTS, params, use_tqdm=False), reloaded.generate(PROMPTS, params, use_tqdm=False)):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].cumulative_logprob == y.outputs[0].cumulative_logprob


def test_weight_update_requantizes_experts(qwen3_moe_path, tmp_path):
    other = str(tmp_path / "other")
    hf_other = make_checkpoint(other, "qwen3_moe", seed=6)
    cfg = ModelConfig.from_pretrained(qwen3_moe_path)
    cpu = torch.device("cpu")
    model = load_model(qwen3_moe_path, cfg, torch.bfloat16, cpu, moe_quant="mxfp8")
    before = _mx_buffers(model)
    want = _mx_buffers(load_model(other, cfg, torch.bfloat16, cpu, moe_quant="mxfp8"))
    # HF per-expert names for layer 1 only: layer 0 must stay as it was
    load_weights(model, [(n, t) for n, t in iter_tensors(other) if n.startswith("model.layers.1.mlp.experts.")])
    now = _mx_buffers(model)
    for name in now:
        expected = want[name] if name.startswith("layers.1.") else before[name]
        assert torch.equal(now[name], expected), name
    # the engine's own stacked names (what a trainer on this model code holds), for layer 0
    bf16_other = load_model(other, cfg, torch.bfloat16, cpu)
    load_weights(model, [(f"layers.0.mlp.{w}", getattr(bf16_other.layers[0].mlp, w)) for w in ("w13", "w2")])
    # transformers' in-memory fused names for everything, strictly: the whole model is `other`'s
    load_weights(model, list(hf_other.named_parameters()), strict=True)
    now = _mx_buffers(model)
    assert all(torch.equal(now[n], want[n]) for n in now)


@pytest.mark.skipif(not os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, "config.json")),
                    reason="the embedded default model has not been trained yet")
def test_default_model_mxfp8_agreement():
    """Issue 4 acceptance 3 on the embedded model: >= 95% greedy agreement with bf16 experts."""
    kw = dict(dtype="bfloat16", num_kv_blocks=256, logprobs_mode="raw")
    bf16 = LLM(DEFAULT_MODEL_DIR, **kw)
    mx = LLM(DEFAULT_MODEL_DIR, moe_quant="mxfp8", **kw)
    tok = bf16.get_tokenizer()
    texts = ["import os\n\n\ndef ", "class Queue:\n    def __init__(self, maxsize=0):\n", '"""Utilities for ',
             "def _read_config(path):\n    with open(path) as f:\n", "    for key, value in sorted(items):\n",
             "if __name__ == '__main__':\n", "from collections import namedtuple\n\n", "    except OSError as exc:\n        "]
    agreement, decisive, mean_delta = teacher_forced(bf16, mx, [tok.encode(t) for t in texts], 64)
    print(f"\ndefault model, MXFP8 vs bf16 experts: agreement {agreement:.3f} "
          f"({decisive:.3f} where bf16 wins by >= 0.1 nats), mean |dlogprob| {mean_delta:.4f}")
    assert agreement >= 0.95
    assert 0 < mean_delta < 0.05
