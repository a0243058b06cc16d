"""gpt-oss (GptOssForCausalLM, OpenAI's open-weight MoE models): attention sinks (a learned logit per
head in every softmax), sliding windows on alternate layers, YaRN, q/k/v and o_proj biases, a router
with a bias, experts with biases and a clamped SwiGLU, transformers' interleaved fused expert
layout, and the MXFP4 experts of the released checkpoints.

Checked token-exact against transformers (greedy, float32, chunked prefill, logprobs of every step
and of the prompt, past the window), the training path (gradients reach the sinks), HF names both
ways, an MXFP4 checkpoint against transformers' own dequantization, MXFP8 experts holding the MXFP4
values exactly, and the sink formula against the explicit softmax on every attention path."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import ModelConfig
from cuttle.engine.models import load_model
from cuttle.engine.models.gpt_oss_checkpoint import dequantize_mxfp4, mxfp4_tensors, to_engine, to_hf
from cuttle.engine.models.transformer import sink_scaled
from helpers import (assert_generates_as_transformers, assert_hf_names_round_trip, assert_packed_forward_is_transformers,
                     parity_prompts, save_checkpoint, write_tokenizer)
from moe_families import randomize_


def _config(**over):
    import transformers

    args = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=24,
                max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=1, pad_token_id=0,
                # a low clamp, so both sides of the SwiGLU's clamps are taken
                swiglu_limit=0.6,
                rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0})
    args.update(over)
    return transformers.GptOssConfig(**args)


def _model(cfg, seed: int = 5):
    import transformers

    model = randomize_(transformers.GptOssForCausalLM(cfg).float().eval(), 0.15, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.5, 1.0)  # sinks of the order of the scores: they take real weight
    return model


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gpt_oss"))
    model = _model(_config())
    return save_checkpoint(path, model)


def test_config_reads_gpt_oss(gpt_oss):
    path, _ = gpt_oss
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.attention_sinks and cfg.moe_bias and cfg.attention_bias and cfg.proj_bias
    assert cfg.expert_activation == (1.702, 0.6)
    assert (cfg.sliding_window, cfg.sliding_window_layers) == (24, (0, 2))
    assert cfg.moe_layers == [0, 1, 2, 3] and cfg.moe_intermediate_size == 64
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    assert not cfg.mxfp4_experts


def test_gpt_oss_token_exact_vs_transformers(gpt_oss):
    path, model = gpt_oss
    assert_generates_as_transformers(path, model, parity_prompts()[1:])  # up to 70 tokens: past the 24-token window


def test_gpt_oss_training_path_matches_transformers(gpt_oss):
    path, model = gpt_oss
    assert_packed_forward_is_transformers(path, model, [parity_prompts()[4], parity_prompts()[7]])


def test_gpt_oss_training_gradients_reach_sinks_and_biases(gpt_oss):
    """The trainer's forward differentiates through the sinks and the expert biases as
    transformers' does (same loss, same gradients)."""
    path, model = gpt_oss
    ours = load_model(path, ModelConfig.from_pretrained(path), torch.float32, torch.device("cpu"))
    doc = parity_prompts()[7]
    ids = torch.tensor([doc])
    for p in ours.parameters():
        p.requires_grad_(True)
    logits = ours.compute_logits(ours.forward_packed(ids, torch.arange(len(doc))[None], torch.zeros_like(ids))[0])
    loss = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:])
    loss.backward()
    model.zero_grad()
    want = torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:])
    want.backward()
    torch.testing.assert_close(loss, want, rtol=0, atol=1e-5)
    for i, layer in enumerate(ours.layers):
        theirs = model.model.layers[i]
        torch.testing.assert_close(layer.attn.sinks.grad, theirs.self_attn.sinks.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(layer.mlp.w13_bias.grad, to_engine("gate_up_proj_bias", theirs.mlp.experts.gate_up_proj_bias.grad),
                                   rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(layer.mlp.gate_bias.grad, theirs.mlp.router.bias.grad, rtol=1e-4, atol=1e-6)


def test_gpt_oss_hf_names_both_ways(gpt_oss):
    path, model = gpt_oss
    assert_hf_names_round_trip(path, model)


def test_expert_layout_round_trips():
    torch.manual_seed(0)
    for part, shape in (("gate_up_proj", (3, 8, 10)), ("gate_up_proj_bias", (3, 10)), ("down_proj", (3, 5, 8)),
                        ("down_proj_bias", (3, 8))):
        t = torch.randn(shape)
        assert torch.equal(to_hf(part, to_engine(part, t)), t), part
    # gate columns are the even ones: the engine's first I rows
    t = torch.arange(2 * 4 * 6, dtype=torch.float32).view(2, 4, 6)
    w13 = to_engine("gate_up_proj", t)
    assert torch.equal(w13[:, :3], t[:, :, 0::2].transpose(1, 2)) and torch.equal(w13[:, 3:], t[:, :, 1::2].transpose(1, 2))


def _quantize_mxfp4(w: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 codes and scales for a weight shaped w [E, out, in]: magnitudes up to 6 x 2^-4,
    near the model's N(0, 0.15) weights, so the model stays in a well-conditioned range."""
    E, out, inp = w.shape
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, out, inp // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(119, 124, (E, out, inp // 32), dtype=torch.uint8, generator=g)
    return blocks, scales


def test_mxfp4_dequantization_is_transformers(gpt_oss):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 40, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 40, 2), dtype=torch.uint8, generator=g)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, in, out]
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), theirs)
    with pytest.raises(ValueError, match="NaN"):
        dequantize_mxfp4(blocks, torch.full_like(scales, 255), "x")
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_mxfp4(blocks, scales[:, :, :1], "x")
    with pytest.raises(ValueError, match="lacks .*down_proj_scales"):
        list(mxfp4_tensors([("model.layers.0.mlp.experts.down_proj_blocks", blocks)]))


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(gpt_oss, tmp_path_factory):
    """The fixture's model with its experts replaced by MXFP4 blocks, saved as the released
    checkpoints are (config quantization_config mxfp4, *_blocks / *_scales), and a transformers
    model holding the dequantized experts (as transformers' own loader would)."""
    import transformers

    src, _ = gpt_oss
    path = str(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    dequantized = {}
    for i in range(4):
        for n, part in enumerate(("gate_up_proj", "down_proj")):
            name = f"model.layers.{i}.mlp.experts.{part}"
            w = tensors.pop(name).transpose(1, 2)  # [E, out, in]
            blocks, scales = _quantize_mxfp4(w, seed=10 * i + n)
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            dequantized[name] = dequantize_mxfp4(blocks, scales).float().transpose(1, 2).contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        hf = json.load(f)
    hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    write_tokenizer(path, 256)
    model = transformers.GptOssForCausalLM(_config()).float().eval()
    state = {k: v for k, v in tensors.items() if not k.endswith(("_blocks", "_scales"))}
    model.load_state_dict({**state, **dequantized}, strict=True)
    return path, model


def test_mxfp4_checkpoint_generates_as_transformers(gpt_oss_mxfp4):
    path, model = gpt_oss_mxfp4
    assert ModelConfig.from_pretrained(path).mxfp4_experts
    assert_generates_as_transformers(path, model, parity_prompts()[1:4])


def test_mxfp4_experts_requantize_to_mxfp8_exactly(gpt_oss_mxfp4):
    """`moe_quant="mxfp8"` on an MXFP4 checkpoint holds the same expert values: no rounding."""
    path, _ = gpt_oss_mxfp4
    cfg = ModelConfig.from_pretrained(path)
    plain = load_model(path, cfg, torch.float32, torch.device("cpu"))
    mx = load_model(path, cfg, torch.float32, torch.device("cpu"), moe_quant="mxfp8")
    for a, b in zip(plain.layers, mx.layers):
        w13, w2 = b.mlp.expert_weights()
        assert torch.equal(w13.dequantize(torch.float32), a.mlp.w13) and torch.equal(w2.dequantize(torch.float32), a.mlp.w2)


def test_mxfp4_quantization_config_fields_are_checked(gpt_oss_mxfp4):
    path, _ = gpt_oss_mxfp4
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    with pytest.raises(ValueError, match=r"fields \['group_size'\].*mxfp4"):
        ModelConfig.from_hf({**hf, "quantization_config": {**hf["quantization_config"], "group_size": 64}})
    llama = {**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False}
    with pytest.raises(ValueError, match="'mxfp4'.*not supported"):
        ModelConfig.from_hf(llama)


def test_gpt_oss_serves_mxfp8_and_bf16(gpt_oss):
    """bf16 and MXFP8 experts run end to end and track the fp32 model (greedy agreement on the
    first tokens, logprobs near)."""
    path, _ = gpt_oss
    prompts = parity_prompts()[1:4]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(path, dtype="float32", num_kv_blocks=64).generate(prompts, params, use_tqdm=False)]
    for kwargs in ({"dtype": "bfloat16"}, {"dtype": "float32", "moe_quant": "mxfp8"}):
        got = [o.outputs[0].token_ids for o in LLM(path, num_kv_blocks=64, **kwargs).generate(prompts, params, use_tqdm=False)]
        assert sum(a[:2] == b[:2] for a, b in zip(ref, got)) >= 2, kwargs


def test_sink_scaled_is_softmax_with_a_sink():
    """`sink_scaled` (the backend's o and lse, then one scale) equals the explicit softmax over
    the keys and the sink, in float64."""
    torch.manual_seed(0)
    T, H, N, D = 5, 3, 7, 8
    q, k, v = torch.randn(T, H, D, dtype=torch.float64), torch.randn(N, H, D, dtype=torch.float64), torch.randn(N, H, D, dtype=torch.float64)
    sinks = torch.randn(H, dtype=torch.float64) * 2
    scores = torch.einsum("thd,nhd->thn", q, k) * 0.3
    lse = torch.logsumexp(scores, -1)
    o = torch.einsum("thn,nhd->thd", scores.softmax(-1), v)
    full = torch.cat((scores, sinks.view(1, H, 1).expand(T, H, 1)), -1).softmax(-1)[..., :-1]
    want = torch.einsum("thn,nhd->thd", full, v)
    torch.testing.assert_close(sink_scaled(o, lse, sinks).double(), want, rtol=1e-6, atol=1e-7)



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_replay_kernel_graphs(tmp_path, dtype):
    """With the experts' epilogues and the sinks native, a gpt-oss decode step is native calls
    only: it replays a kernel graph (within the window), and gives the eager engine's tokens."""
    from cuttle.attention.native import kernels

    if kernels().lib is None:
        pytest.skip("the native CPU kernels are not built here (kernel graphs replay them)")
    path = str(tmp_path)
    _model(_config(sliding_window=256)).save_pretrained(path)
    write_tokenizer(path, 256)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    runs = {}
    for eager in (True, False):
        llm = LLM(path, dtype=dtype, num_kv_blocks=64, enforce_eager=eager, enable_prefix_caching=False)
        outs = llm.generate(parity_prompts()[1:4], params, use_tqdm=False)
        runs[eager] = [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in r.items()) for r in o.outputs[0].logprobs])
                       for o in outs]
        if not eager:
            assert llm.engine.runner.graphs.counters["graph_steps"] > 0
    assert runs[False] == runs[True]


def _sampled_batch(llm, seed: int):
    """A batch of the engine's samples (3 prompts x 2, 12 tokens each, rewards 0 and 1) and the
    behaviour logprobs of its trained tokens."""
    from cuttle.rl import TrainBatch, compute_advantages, sample_groups

    groups = sample_groups(llm, parity_prompts()[2:5], 2, SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True))
    for g in groups:
        for i, s in enumerate(g.samples):
            s.reward = float(i)
    batch = TrainBatch.from_groups(groups, compute_advantages(groups, True))
    packed = batch.packed()
    return batch, packed.rollout_logprobs[packed.loss_mask > 0]


@pytest.mark.parametrize("moe_quant", [None, "mxfp8"])
def test_trainer_scores_what_the_engine_samples(gpt_oss, moe_quant):
    """The RL trainer (torch expert path, autograd) scores the engine's samples (native expert
    epilogues, native sink scale) within 1e-5 in fp32, bf16 experts or MXFP8 ones quantized on
    the fly; a trainer without the quantization differs (the check can fail)."""
    from cuttle.rl import mismatch
    from cuttle.rl.trainer import Trainer, TrainerConfig

    path, _ = gpt_oss
    llm = LLM(path, dtype="float32", num_kv_blocks=64, moe_quant=moe_quant)
    batch, behaviour = _sampled_batch(llm, seed=3)
    trainer = Trainer(path, TrainerConfig(moe_quant=moe_quant, lr=1e-2))
    m = mismatch(trainer.score(batch), behaviour)
    assert m.num_tokens == 3 * 2 * 12 and m.max_abs <= 1e-5, m
    if moe_quant:
        plain = mismatch(Trainer(path).score(batch), behaviour)
        assert plain.mean_abs > 10 * max(m.mean_abs, 1e-7)
    # a step, its weights pushed into the engine (sinks, router and expert biases included): the
    # engine's next samples are scored alike by the trained policy
    trainer.step(batch)
    trainer.push_weights(llm)
    batch, behaviour = _sampled_batch(llm, seed=4)
    after = mismatch(trainer.score(batch), behaviour)
    assert after.max_abs <= 1e-5, after
    stale = mismatch(Trainer(path, TrainerConfig(moe_quant=moe_quant)).score(batch), behaviour)
    assert stale.mean_abs > 10 * max(after.mean_abs, 1e-7)  # the step moved the policy, and the engine with it
