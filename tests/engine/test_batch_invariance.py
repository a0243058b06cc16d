"""Batch-invariant engines (`EngineConfig.batch_invariant`, docs/architecture.md "Batch
invariance"): a request's greedy tokens and top logprobs are bit-identical whether it runs alone,
beside other requests (one of them long), prefilled in chunks of 64 beside them (alone its
300-token prompt is one chunk, which the default engine sends through SDPA), preempted and
recomputed, or on a prefix-cache hit. fp32 and bf16; Qwen3-MoE, dense Qwen3, Qwen2-MoE (shared
expert), DeepSeek-V3 (MLA, sigmoid routing), GLM-4.5 (partial rotary), gpt-oss (sinks, biased experts);
MXFP8 weights; NSA and training-free top-k. Controls: the same runs without the switch differ in fp32 (the fp32 GEMMs),
and in bf16 for the long prompt (SDPA vs the native rows). Tiny random checkpoints (no download)."""
from __future__ import annotations

import os
import random

import pytest

from cuttle.attention.native import kernels
from cuttle.engine import LLM, SamplingParams

from helpers import make_checkpoint, write_tokenizer
from moe_families import family_model, randomize_
from sparse_helpers import make_nsa_checkpoint

pytestmark = pytest.mark.skipif(kernels().lib is None, reason="native CPU kernel library not built")

GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True)
_rng = random.Random(7)
LONG = [_rng.randrange(3, 256) for _ in range(300)]  # > the default engine's native-chunk limit (256)
OTHERS = [[_rng.randrange(3, 256) for _ in range(n)] for n in (40, 280, 9, 130, 71)]
# head_dim 64: the attention kernels' vectorized bf16 paths (16 takes the generic loop)
SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    out = {}
    for name, arch in (("moe", "qwen3_moe"), ("dense", "qwen3")):
        out[name] = str(tmp_path_factory.mktemp(name))
        make_checkpoint(out[name], arch, **SHAPE)
    out["nsa"] = str(tmp_path_factory.mktemp("nsa"))
    make_nsa_checkpoint(out["nsa"], hidden_size=128, head_dim=64)
    for family in ("qwen2_moe", "deepseek_v3", "glm4_moe", "minimax_m2"):  # a shared expert's sigmoid gate; MLA and sigmoid routing; partial rotary
        out[family] = str(tmp_path_factory.mktemp(family))
        family_model(family).save_pretrained(out[family])
        write_tokenizer(out[family], 256)
    # a sliding window of 70 keys, well inside the long request: its rows start inside a block
    import transformers

    out["mistral"] = str(tmp_path_factory.mktemp("mistral"))
    cfg = transformers.MistralConfig(vocab_size=256, intermediate_size=192, num_hidden_layers=2, max_position_embeddings=512,
                                     sliding_window=70, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=None, **SHAPE)
    transformers.MistralForCausalLM(cfg).save_pretrained(out["mistral"])
    write_tokenizer(out["mistral"], 256)
    # post-norm layers (OLMo 2), Granite's multipliers, Ministral 3's query scaling past 96 positions
    common = dict(vocab_size=256, intermediate_size=192, num_hidden_layers=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  eos_token_id=1, bos_token_id=None, pad_token_id=0, **SHAPE)
    rope = {"type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 96, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1, "max_position_embeddings": 512}
    # gpt-oss: attention sinks, a 70-key window on alternate layers, biased experts with the clamped SwiGLU
    oss = transformers.GptOssConfig(num_local_experts=8, num_experts_per_tok=2, sliding_window=70, swiglu_limit=1.0,
                                    **{**common, "intermediate_size": 64})
    out["gpt_oss"] = str(tmp_path_factory.mktemp("gpt_oss"))
    oss_model = randomize_(transformers.GptOssForCausalLM(oss).float(), 0.1, seed=3)
    for layer in oss_model.model.layers:
        layer.self_attn.sinks.data.normal_(0.5, 1.0)
    oss_model.save_pretrained(out["gpt_oss"])
    write_tokenizer(out["gpt_oss"], 256)
    # StarCoder2: LayerNorm with biases and the gelu MLP (native kernels, one formula per row / element)
    sc2 = transformers.Starcoder2Config(sliding_window=None, **{**common, "num_key_value_heads": 2})
    for name, model in (("starcoder2", transformers.Starcoder2ForCausalLM(sc2)),
                        ("olmo2", transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**common))),
                        ("granite", transformers.GraniteForCausalLM(transformers.GraniteConfig(
                            embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.05, logits_scaling=2.5, **common))),
                        ("ministral3", transformers.Ministral3ForCausalLM(transformers.Ministral3Config(rope_parameters=rope, **common)))):
        out[name] = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(out[name])
        write_tokenizer(out[name], 256)
    return out


def _result(llm: LLM, prompts: list[list[int]], which: int) -> tuple[list[int], list[list[tuple[int, float]]]]:
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)[which].outputs[0]
    return list(out.token_ids), [sorted((t, lp.logprob) for t, lp in row.items()) for row in out.logprobs]


def _runs(path: str, **opts) -> dict[str, tuple]:
    """The long request alone, and in every other situation (key: which)."""
    alone = LLM(model=path, enable_prefix_caching=False, **opts)
    got = {"alone": _result(alone, [LONG], 0), "beside others": _result(alone, OTHERS + [LONG], len(OTHERS))}
    # 64-token chunks beside the others in a 22-block pool (the long request alone needs 20): they
    # preempt each other and recompute, then a prefix-cache hit
    small = LLM(model=path, enable_prefix_caching=True, max_num_batched_tokens=64, num_kv_blocks=22, **opts)
    got["chunked, preempted"] = _result(small, OTHERS + [LONG], len(OTHERS))
    assert small.stats()["preemptions"] > 0
    cached = small.stats()["cached_tokens"]
    got["prefix-cache hit"] = _result(small, [LONG], 0)
    assert small.stats()["cached_tokens"] - cached >= 256
    return got


CASES = {
    "MoE fp32": ("moe", dict(dtype="float32")),
    "MoE bf16": ("moe", dict(dtype="bfloat16")),
    "MoE bf16, MXFP8 linears + experts + lm_head": ("moe", dict(dtype="bfloat16", quantization="mxfp8", quantize_lm_head=True)),
    "dense fp32, top-k": ("dense", dict(dtype="float32", sparse_attention="topk:budget=64,block=16,dense_layers=1")),
    "NSA bf16": ("nsa", dict(dtype="bfloat16")),
    "NSA fp32": ("nsa", dict(dtype="float32")),
    "Qwen2-MoE (shared expert) fp32": ("qwen2_moe", dict(dtype="float32")),
    "DeepSeek-V3 (MLA) fp32": ("deepseek_v3", dict(dtype="float32")),
    "DeepSeek-V3 (MLA) bf16": ("deepseek_v3", dict(dtype="bfloat16")),
    "GLM-4.5 (partial rotary, q/k norms) bf16": ("glm4_moe", dict(dtype="bfloat16")),
    "MiniMax-M2 (whole-row q/k norms, sigmoid routing) bf16": ("minimax_m2", dict(dtype="bfloat16")),
    "Mistral (sliding window 70 of 300 tokens) bf16": ("mistral", dict(dtype="bfloat16")),
    "OLMo 2 (post-norm, whole-row q/k norms) bf16": ("olmo2", dict(dtype="bfloat16")),
    "Granite (multipliers) bf16": ("granite", dict(dtype="bfloat16")),
    "Ministral 3 (query scaling past 96 positions) bf16": ("ministral3", dict(dtype="bfloat16")),
    "gpt-oss (sinks, window 70, biased clamped experts) bf16": ("gpt_oss", dict(dtype="bfloat16")),
    "gpt-oss fp32": ("gpt_oss", dict(dtype="float32")),
    "StarCoder2 (LayerNorm, gelu MLP) bf16": ("starcoder2", dict(dtype="bfloat16")),
    "StarCoder2 fp32": ("starcoder2", dict(dtype="float32")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_request_is_bit_identical_in_every_situation(paths, case: str) -> None:
    model, opts = CASES[case]
    got = _runs(paths[model], batch_invariant=True, **opts)
    want = got.pop("alone")
    for situation, result in got.items():
        assert result == want, f"{case}: {situation} differs from the request alone"


def test_seeded_sampling_and_thread_count(paths) -> None:
    """Seeded samples (temperature 1, top_p 0.9) alone vs beside others, and one vs two threads."""
    import torch

    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=16, logprobs=2, ignore_eos=True)

    def sampled(llm: LLM, prompts: list[list[int]]) -> tuple:
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)[-1].outputs[0]
        return list(out.token_ids), [sorted((t, lp.logprob) for t, lp in row.items()) for row in out.logprobs]

    llm = LLM(model=paths["moe"], dtype="float32", batch_invariant=True, enable_prefix_caching=False)
    want = sampled(llm, [LONG])
    assert sampled(llm, OTHERS + [LONG]) == want
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert sampled(llm, OTHERS + [LONG]) == want
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("model", ["nsa", "deepseek_v3"])
def test_update_weights_refreshes_the_derived_copies(paths, model: str, tmp_path) -> None:
    """NSA's transposed phi heads and MLA's packed projections are kept beside their parameters:
    after `update_weights` from another checkpoint the engine gives that checkpoint's bits."""
    from safetensors.torch import load_file

    other = str(tmp_path / "other")
    if model == "nsa":
        make_nsa_checkpoint(other, seed=5, hidden_size=128, head_dim=64)
    else:
        randomize_(family_model("deepseek_v3"), 0.15, seed=12).save_pretrained(other)
        write_tokenizer(other, 256)
    for dtype in ("float32", "bfloat16"):
        kw = dict(dtype=dtype, batch_invariant=True, enable_prefix_caching=False)
        llm = LLM(model=paths[model], **kw)
        _result(llm, [LONG], 0)  # the derived copies made and used
        llm.update_weights(load_file(os.path.join(other, "model.safetensors")).items())
        assert _result(llm, OTHERS + [LONG], len(OTHERS)) == _result(LLM(model=other, **kw), [LONG], 0), dtype


def test_avx2_paths(paths, monkeypatch) -> None:
    """What a CPU without AVX512-BF16 runs, forced here: bf16 linears on the widening GEMM
    (w16_gemm.c) and bf16 experts on the panel tiles, through the engine with the switch. (At this
    model size bf16 rounding hides most summation-order differences, so this checks the wiring;
    the kernel tests, with fp32 outputs, are the ones that see the orders: reverting either
    kernel's switch fails them, not this.)"""
    import dataclasses

    from cuttle.attention import native
    from cuttle.attention.native import moe as native_moe
    from cuttle.engine.models.moe_quant import moe_layers

    ks = native.kernels()
    if not ks.lib.w16_gemm_available():
        pytest.skip("the kernel library has no AVX2 + FMA build (w16_gemm.c compiled out)")
    monkeypatch.setattr(native, "_current", dataclasses.replace(ks, packed_gemm=False, w16_gemm=True))
    dot = native_moe.dot_in_use()
    native_moe.set_bf16_dot(False)
    try:
        probe = LLM(model=paths["moe"], dtype="bfloat16", batch_invariant=True)
        assert {layer.packed.fmt for layer in moe_layers(probe.engine.runner.model).values()} == {native_moe.W_BF16}
        got = _runs(paths["moe"], batch_invariant=True, dtype="bfloat16")
    finally:
        native_moe.set_bf16_dot(dot)
    want = got.pop("alone")
    for situation, result in got.items():
        assert result == want, f"AVX2 paths: {situation} differs from the request alone"


def test_host_tier_swaps_and_reloads_bit_identically(paths) -> None:
    """With a host tier, preemption swaps KV out and back (and prefix hits may read it in place):
    still the bits of the request alone."""
    got = _runs(paths["moe"], batch_invariant=True, dtype="bfloat16", num_host_kv_blocks=64)
    want = got.pop("alone")
    for situation, result in got.items():
        assert result == want, f"host tier: {situation} differs from the request alone"


@pytest.mark.parametrize("positions", ["shared", "concat"])
def test_squid_documents_are_bit_identical_in_every_situation(paths, positions: str) -> None:
    """A request over a prefix and two documents: alone, beside other requests (its documents
    computed in the same steps as their prefills), and with one document computed earlier by
    another request in other company (a cache hit) and the other now, in chunks of 64."""
    rng = random.Random(3)
    docs = [[rng.randrange(3, 256) for _ in range(n)] for n in (90, 170)]
    request = {"prefix": [5, 6, 7, 8], "documents": docs, "prompt": LONG[:40]}
    kw = dict(batch_invariant=True, dtype="float32", squid_positions=positions)

    def generate(llm: LLM, prompts: list) -> tuple:
        out = llm.generate(prompts, GREEDY, use_tqdm=False)[-1].outputs[0]
        return list(out.token_ids), [sorted((t, lp.logprob) for t, lp in row.items()) for row in out.logprobs]

    others = [{"prompt_token_ids": p} for p in OTHERS]
    want = generate(LLM(model=paths["moe"], **kw), [request])
    assert generate(LLM(model=paths["moe"], **kw), others + [request]) == want, "beside others"
    llm = LLM(model=paths["moe"], max_num_batched_tokens=64, **kw)
    generate(llm, others[:2] + [{"prefix": [5, 6, 7, 8], "documents": docs[:1], "prompt": [9, 10, 11]}])
    hits = llm.stats()["documents_hit"]
    assert generate(llm, others[2:] + [request]) == want, "a cached document, chunks of 64"
    assert llm.stats()["documents_hit"] > hits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_without_the_switch_it_differs(paths, dtype: str) -> None:
    """The control: the default engine gives the long request other logprobs in some situation
    (so the test above checks something)."""
    got = _runs(paths["moe"], dtype=dtype)
    want = got.pop("alone")
    assert any(result != want for result in got.values())


def test_unsupported_configurations_are_refused(paths) -> None:
    with pytest.raises(ValueError, match=r"batch_invariant=True: dtype float16"):
        LLM(model=paths["dense"], dtype="float16", batch_invariant=True)
    with pytest.raises(ValueError, match=r"batch_invariant must be True or False"):
        LLM(model=paths["dense"], batch_invariant="yes")


def test_refused_when_the_experts_run_on_torch(paths, monkeypatch) -> None:
    from cuttle.moe.layer import FusedMoE

    monkeypatch.setattr(FusedMoE, "pack_", lambda self: False)  # as with CUTTLE_MOE_NATIVE=0
    with pytest.raises(ValueError, match=r"batch_invariant=True: the routed experts of layer 0 run on torch"):
        LLM(model=paths["moe"], dtype="float32", batch_invariant=True)


def test_serve_flag_reaches_the_engine_and_rl_info(paths, monkeypatch) -> None:
    from cuttle.engine import cli

    seen = {}

    class FakeServer:  # stands in for uvicorn's: ask the app, then return
        def __init__(self, config, on_first_signal):
            self.app = config.app

        def run(self):
            from fastapi.testclient import TestClient

            seen["info"] = TestClient(self.app).get("/v1/rl/info").json()

    monkeypatch.setattr(cli, "_server", FakeServer)
    cli.main(["serve", paths["dense"], "--dtype", "float32", "--num-kv-blocks", "32", "--batch-invariant"])
    assert seen["info"]["batch_invariant"] is True
