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
