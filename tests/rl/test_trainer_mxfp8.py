"""Trainer and sampler in one format (issue 18 point 4): the reference trainer with
`moe_quant="mxfp8"` quantizes the routed experts on the fly (straight-through gradients), so its
logprobs equal an engine serving `moe_quant="mxfp8"` (acceptance 3: fp32 master, <= 1e-5, on the
embedded model), gradients reach the master weights unchanged, and pushed weights re-quantize
into the same bytes."""
from __future__ import annotations

import os

import pytest
import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.default_model import DEFAULT_MODEL_DIR
from cuttle.moe.mxfp8 import dequantize_mxfp8, fake_quantize_ste, quantize_mxfp8
from cuttle.rl import TrainBatch, compute_advantages, mismatch, sample_groups
from cuttle.rl.trainer import Trainer, TrainerConfig

HAVE_DEFAULT = os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, "config.json"))


def _groups(llm: LLM, prompts: list[list[int]]):
    groups = sample_groups(llm, prompts, 2, SamplingParams(temperature=1.0, seed=4, max_tokens=16, ignore_eos=True))
    for g in groups:
        for i, s in enumerate(g.samples):
            s.reward = float(i)
    return groups


def _mismatch(trainer: Trainer, groups) -> object:
    batch = TrainBatch.from_groups(groups, compute_advantages(groups, True))
    packed = batch.packed()
    return mismatch(trainer.score(batch), packed.rollout_logprobs[packed.loss_mask > 0])


@pytest.mark.skipif(not HAVE_DEFAULT, reason="the embedded default model has not been trained yet")
def test_trainer_logprobs_equal_engine_mxfp8_on_the_embedded_model():
    llm = LLM(DEFAULT_MODEL_DIR, dtype="float32", moe_quant="mxfp8", num_kv_blocks=128)
    texts = ["import os\n\n\ndef ", "class Queue:\n    def __init__(self, maxsize=0):\n", "    for key, value in sorted(items):\n"]
    prompts = [llm.get_tokenizer().encode(t) for t in texts]
    groups = _groups(llm, prompts)
    m = _mismatch(Trainer(DEFAULT_MODEL_DIR, TrainerConfig(moe_quant="mxfp8")), groups)
    assert m.num_tokens == 3 * 2 * 16
    assert m.max_abs <= 1e-5, m
    # the same trainer without the quantization scores a different policy: the check can fail
    plain = _mismatch(Trainer(DEFAULT_MODEL_DIR), groups)
    assert plain.mean_abs > 10 * max(m.mean_abs, 1e-7)


def test_straight_through_gradient_and_exact_forward():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(3, 8, 64, generator=g) * 0.1).requires_grad_()
    x = torch.randn(5, 64, generator=g)
    q = fake_quantize_ste(w, torch.bfloat16)
    want = dequantize_mxfp8(*quantize_mxfp8(w.detach().bfloat16()), 32, torch.float32)
    assert torch.equal(q.detach(), want)  # exactly what a bf16 engine quantizes and serves
    (x @ q[1].t()).square().sum().backward()
    wd = want.clone().requires_grad_()
    (x @ wd[1].t()).square().sum().backward()
    assert torch.equal(w.grad, wd.grad)  # straight through: the gradient w.r.t. the served weight


def test_step_and_push_keep_one_format(tmp_path):
    from helpers import make_checkpoint

    path = str(tmp_path / "moe")
    make_checkpoint(path, "qwen3_moe", seed=2)
    llm = LLM(path, dtype="float32", moe_quant="mxfp8", num_kv_blocks=128)
    groups = _groups(llm, [[5, 6, 7, 8], [9, 10, 11]])
    trainer = Trainer(path, TrainerConfig(moe_quant="mxfp8", lr=1e-3, max_tokens_per_row=256))
    stats = trainer.step(TrainBatch.from_groups(groups, compute_advantages(groups, True)))
    assert stats["mismatch_max_abs"] <= 1e-5  # scored before the update, in the engine's format
    names = dict(trainer.named_weights())
    assert "layers.0.mlp.w13" in names and not any("parametrizations" in n for n in names)
    trainer.push_weights(llm)
    w13 = llm.engine.runner.model.layers[0].mlp.expert_weights()[0]  # unpacked from the engine's packed panels
    d, s = quantize_mxfp8(names["layers.0.mlp.w13"])
    assert torch.equal(w13.data.view(torch.uint8), d.view(torch.uint8))
    assert torch.equal(w13.scale.view(torch.uint8), s.view(torch.uint8))
    # after the push the engine and the trainer score the new policy alike
    assert _mismatch(trainer, _groups(llm, [[5, 6, 7, 8]])).max_abs <= 1e-5


def test_bad_moe_quant_is_refused():
    with pytest.raises(ValueError, match="moe_quant must be None or one of mxfp8; got 'fp4'"):
        TrainerConfig(moe_quant="fp4")


# ---- every linear in MXFP8 (`quantization="mxfp8"`, with or without the lm_head) ---------------

def _engine_bytes(llm: LLM, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    from cuttle.engine.models.linear_quant import quantized_linears

    w = quantized_linears(llm.engine.runner.model)[name]
    w.refresh()  # a tied lm_head's copy follows the embedding
    return w.data.view(torch.uint8), w.scale.view(torch.uint8)


@pytest.mark.skipif(not HAVE_DEFAULT, reason="the embedded default model has not been trained yet")
@pytest.mark.parametrize("lm_head", [False, True])
def test_trainer_logprobs_equal_engine_with_every_linear_in_mxfp8(lm_head):
    """`quantization="mxfp8"` on the embedded model (attention projections, routed experts and,
    with `quantize_lm_head`, its tied lm_head's logits copy): the trainer mirrored from the engine
    scores what the engine sampled within fp32 accumulation rounding; a trainer quantizing only the
    experts (or only the linears without the lm_head) scores another policy."""
    llm = LLM(DEFAULT_MODEL_DIR, dtype="float32", quantization="mxfp8", quantize_lm_head=lm_head, num_kv_blocks=128)
    texts = ["import os\n\n\ndef ", "class Queue:\n    def __init__(self, maxsize=0):\n", "    for key, value in sorted(items):\n"]
    groups = _groups(llm, [llm.get_tokenizer().encode(t) for t in texts])
    config = TrainerConfig.for_sampler(llm)
    assert (config.quantization, config.quantize_lm_head, config.quant_dtype) == ("mxfp8", lm_head, "float32")
    m = _mismatch(Trainer(DEFAULT_MODEL_DIR, config), groups)
    assert m.num_tokens == 3 * 2 * 16
    assert m.max_abs <= 1e-5, m
    other = TrainerConfig(quantization="mxfp8", quantize_lm_head=not lm_head)
    for control in (TrainerConfig(moe_quant="mxfp8"), other):
        assert _mismatch(Trainer(DEFAULT_MODEL_DIR, control), groups).mean_abs > 10 * max(m.mean_abs, 1e-7)


@pytest.mark.skipif(not HAVE_DEFAULT, reason="the embedded default model has not been trained yet")
def test_tied_lm_head_trains_and_pushes_in_one_format():
    """A tied lm_head in MXFP8: the token lookup reads the embedding as is, the logits its MXFP8
    copy, in the engine and in the trainer; one master takes both gradients, is pushed under the
    engine's one name (`embed`), and the engine's copy follows it."""
    llm = LLM(DEFAULT_MODEL_DIR, dtype="float32", quantization="mxfp8", quantize_lm_head=True, num_kv_blocks=128)
    groups = _groups(llm, [llm.get_tokenizer().encode("def add(a, b):\n")])
    trainer = Trainer(DEFAULT_MODEL_DIR, TrainerConfig.for_sampler(llm, lr=1e-3, max_tokens_per_row=256))
    assert trainer.model.embed is trainer.model.parametrizations.lm_head.original
    before = trainer.model.embed.detach().clone()
    stats = trainer.step(TrainBatch.from_groups(groups, compute_advantages(groups, True)))
    assert stats["mismatch_max_abs"] <= 1e-5
    names = dict(trainer.named_weights())
    assert "embed" in names and "lm_head" not in names and not any("parametrizations" in n for n in names)
    assert not torch.equal(names["embed"], before)  # the master moved
    trainer.push_weights(llm)
    d, s = quantize_mxfp8(names["embed"])
    assert all(torch.equal(a, b.view(torch.uint8)) for a, b in zip(_engine_bytes(llm, "lm_head"), (d, s)))
    assert _mismatch(trainer, _groups(llm, [llm.get_tokenizer().encode("x = [")])).max_abs <= 1e-5


def test_dense_model_step_and_push_with_every_linear_in_mxfp8(tmp_path):
    """A dense model with an untied lm_head: the gradients reach every master through the round
    trip, the push re-quantizes into the bytes the trainer computed with, and both then score the
    new policy alike; a bf16 engine gets the bytes of the trainer's weights quantized from bf16."""
    from helpers import make_checkpoint

    path = str(tmp_path / "dense")
    make_checkpoint(path, "qwen3", seed=3)
    llm = LLM(path, dtype="float32", quantization="mxfp8", quantize_lm_head=True, num_kv_blocks=128)
    groups = _groups(llm, [[5, 6, 7, 8], [9, 10, 11]])
    trainer = Trainer(path, TrainerConfig.for_sampler(llm, lr=1e-3, max_tokens_per_row=256))
    before = {n: w.clone() for n, w in trainer.named_weights()}
    stats = trainer.step(TrainBatch.from_groups(groups, compute_advantages(groups, True)))
    assert stats["mismatch_max_abs"] <= 1e-5
    names = dict(trainer.named_weights())
    assert set(names) == set(before) and not any("parametrizations" in n for n in names)
    for n in ("lm_head", "layers.0.attn.qkv_weight", "layers.1.attn.o_weight", "layers.0.mlp.gate_up_weight", "layers.1.mlp.down_weight"):
        assert not torch.equal(names[n], before[n]), n  # straight through: every quantized master trained
    trainer.push_weights(llm)
    for n in ("lm_head", "layers.1.attn.qkv_weight", "layers.0.mlp.down_weight"):
        d, s = quantize_mxfp8(names[n])
        assert all(torch.equal(a, b.view(torch.uint8)) for a, b in zip(_engine_bytes(llm, n), (d, s))), n
    assert _mismatch(trainer, _groups(llm, [[5, 6, 7, 8]])).max_abs <= 1e-5
    # freezing goes by the engine's names, parametrized or not
    frozen = Trainer(path, TrainerConfig(quantization="mxfp8", quantize_lm_head=True), freeze=("lm_head", "layers.0.attn"))
    kept = {id(p) for p in frozen.params}
    assert id(frozen.model.parametrizations.lm_head.original) not in kept
    assert id(frozen.model.layers[0].attn.parametrizations.qkv_weight.original) not in kept
    assert id(frozen.model.layers[1].attn.parametrizations.qkv_weight.original) in kept
    # an engine in bf16: the fp32 masters are cast to bf16 and quantized, here and there alike
    bf16 = LLM(path, dtype="bfloat16", quantization="mxfp8", quantize_lm_head=True, num_kv_blocks=64)
    trainer.push_weights(bf16)
    mirrored = Trainer(path, TrainerConfig.for_sampler(bf16))
    assert mirrored.config.quant_dtype == "bfloat16"
    mirrored.model.load_state_dict(trainer.model.state_dict())
    for n, got in (("lm_head", mirrored.model.lm_head), ("layers.1.attn.o_weight", mirrored.model.layers[1].attn.o_weight)):
        d, s = _engine_bytes(bf16, n)
        assert torch.equal(got.detach(), dequantize_mxfp8(d.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu), 32, torch.float32)), n


def test_bad_quantization_fields_are_refused(tmp_path):
    with pytest.raises(ValueError, match="quantization must be None or one of mxfp8; got 'awq'"):
        TrainerConfig(quantization="awq")
    with pytest.raises(ValueError, match="quantize_lm_head=True needs quantization='mxfp8'"):
        TrainerConfig(quantize_lm_head=True)
    with pytest.raises(ValueError, match="quant_dtype must be one of"):
        TrainerConfig(quantization="mxfp8", quant_dtype="fp8")
    from helpers import make_checkpoint

    path = str(tmp_path / "odd")
    make_checkpoint(path, "qwen3", intermediate_size=48)  # down_proj's input dim 48: not whole MX blocks
    with pytest.raises(ValueError, match="down_weight has input dim 48, not a multiple of the MX block size 32"):
        Trainer(path, TrainerConfig(quantization="mxfp8"))
