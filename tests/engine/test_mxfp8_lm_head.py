"""The lm_head in MXFP8 (`quantize_lm_head`, with `quantization="mxfp8"`) and the training /
scoring path (`CausalLM.forward_masked`) of an MXFP8 model (issue 18).

Oracles: the logits are the torch reference "dequantize the stored bytes, then F.linear" (fp32
accumulation-order rounding apart); the bytes are `quantize_mxfp8` of the checkpoint's lm_head, or
of the embedding for a tied one, also after `update_weights` (HF and engine names); the whole
engine equals the plain fp32 engine on a checkpoint holding the MXFP8 round trip of every covered
weight. forward_masked on an MXFP8 model equals forward_masked of the plain model on that
round-tripped checkpoint, and lets gradients through to its input.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from cuttle.attention.native import mxfp8 as native_mx
from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import EngineConfig, ModelConfig
from cuttle.engine.models import load_model
from cuttle.engine.models.linear_quant import MXLinearWeight
from cuttle.moe.mxfp8 import quantize_mxfp8
from helpers import make_checkpoint, parity_prompts
from mxfp8_helpers import close_outputs, fake_quantize_checkpoint

VOCAB = 1003  # not a multiple of the decode loop's 4 rows: the tail rows are exercised
PROMPTS = [parity_prompts()[i] for i in (0, 3, 5)]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mx_lm_head")
    out = {k: str(root / k) for k in ("untied", "tied", "tied_other", "untied_other", "fake")}
    make_checkpoint(out["untied"], "qwen3_moe", seed=5, vocab_size=VOCAB)
    make_checkpoint(out["untied_other"], "qwen3_moe", seed=6, vocab_size=VOCAB)
    make_checkpoint(out["tied"], "qwen3_moe", seed=7, vocab_size=VOCAB, tie_word_embeddings=True)
    make_checkpoint(out["tied_other"], "qwen3_moe", seed=8, vocab_size=VOCAB, tie_word_embeddings=True)
    fake_quantize_checkpoint(out["untied"], out["fake"], lm_head=True)
    return out


def _hf(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def _assert_quantized_from(w: MXLinearWeight, src: torch.Tensor) -> None:
    d, s = quantize_mxfp8(src.float())
    assert torch.equal(w.data.view(torch.uint8), d.view(torch.uint8))
    assert torch.equal(w.scale.view(torch.uint8), s.view(torch.uint8))


def _assert_logits_are_reference(model) -> None:
    w = model.lm_head
    assert isinstance(w, MXLinearWeight)
    torch.manual_seed(0)
    for m in (1, 3, 6, 9):  # decode loop (M <= 8, in passes of 4) and tile loop
        h = torch.randn(m, model.cfg.hidden_size)
        want = F.linear(h.double(), w.dequantize(torch.float64))
        got = model.compute_logits(h).double()
        # fp32 sums of K = 64 products: error well below 1e-5 of the row's magnitude
        bound = 1e-5 * (h.double().abs() @ w.dequantize(torch.float64).abs().t()) + 1e-6
        assert bool(((got - want).abs() <= bound).all()), float((got - want).abs().max())


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_bytes_and_logits(paths, tied):
    path = paths["tied" if tied else "untied"]
    model = load_model(path, ModelConfig.from_pretrained(path), torch.float32, torch.device("cpu"),
                       quantization="mxfp8", quantize_lm_head=True)
    hf = _hf(path)
    _assert_quantized_from(model.lm_head, hf["model.embed_tokens.weight" if tied else "lm_head.weight"])
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert "lm_head" not in names and "embed" in names
    if tied:  # the lookup keeps the embedding itself, in the model dtype
        assert torch.equal(model.embed, hf["model.embed_tokens.weight"])
    _assert_logits_are_reference(model)


def test_without_the_option_the_lm_head_stays(paths):
    path = paths["untied"]
    model = load_model(path, ModelConfig.from_pretrained(path), torch.float32, torch.device("cpu"), quantization="mxfp8")
    assert isinstance(model.lm_head, torch.nn.Parameter)


@pytest.mark.skipif(not native_mx.available(), reason="native CPU kernel library not built")
def test_engine_equals_dequantize_then_matmul(paths):
    kw = dict(dtype="float32", num_kv_blocks=64, logprobs_mode="raw", max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    quant = LLM(paths["untied"], quantization="mxfp8", quantize_lm_head=True, **kw).generate(PROMPTS, params, use_tqdm=False)
    plain = LLM(paths["fake"], **kw).generate(PROMPTS, params, use_tqdm=False)
    close_outputs(quant, plain, 2e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_update_weights_requantizes_the_lm_head(paths, tied):
    path, other = (paths["tied"], paths["tied_other"]) if tied else (paths["untied"], paths["untied_other"])
    llm = LLM(path, dtype="float32", num_kv_blocks=64, quantization="mxfp8", quantize_lm_head=True)
    model = llm.engine.runner.model
    new = _hf(other)
    # engine names for the embedding / lm_head (a trainer on this model code), HF names for the rest
    head = new["model.embed_tokens.weight" if tied else "lm_head.weight"]
    engine_named = [("embed", new["model.embed_tokens.weight"])] + ([] if tied else [("lm_head", head)])
    hf = [(n, t) for n, t in new.items() if n not in ("model.embed_tokens.weight", "lm_head.weight")]
    llm.update_weights(engine_named + hf)
    _assert_quantized_from(model.lm_head, head)
    if tied:
        assert model.lm_head.tied_key == (model.embed._version, model.embed.data_ptr())  # refreshed at update, not at the next step
    _assert_logits_are_reference(model)
    # and back through the HF names
    old = _hf(path)
    llm.update_weights(list(old.items()))
    _assert_quantized_from(model.lm_head, old["model.embed_tokens.weight" if tied else "lm_head.weight"])
    if tied:  # a tied model's engine name `lm_head` is its embedding
        llm.update_weights([("lm_head", new["model.embed_tokens.weight"])])
        assert torch.equal(model.embed, new["model.embed_tokens.weight"])
        _assert_quantized_from(model.lm_head, new["model.embed_tokens.weight"])


def test_refused_combinations(paths, capsys):
    path = paths["untied"]
    msg = "quantize_lm_head=True needs quantization='mxfp8'"
    with pytest.raises(ValueError, match=msg):
        EngineConfig(model=path, quantize_lm_head=True)
    with pytest.raises(ValueError, match=msg):
        EngineConfig(model=path, moe_quant="mxfp8", quantize_lm_head=True)
    with pytest.raises(ValueError, match=msg):
        load_model(path, ModelConfig.from_pretrained(path), torch.float32, torch.device("cpu"), quantize_lm_head=True)
    from cuttle.engine.cli import main

    with pytest.raises(SystemExit) as e:  # the CLI says it in one line, naming the flag
        main(["serve", path, "--quantize-lm-head"])
    assert e.value.code == 2 and "cuttle serve: --quantize-lm-head=True needs quantization='mxfp8'" in capsys.readouterr().err


def test_forward_masked_on_an_mxfp8_model(paths):
    """The trainer's / squid's scoring path runs on an MXFP8 model (it raised a TypeError): the torch
    reference of every MXFP8 weight (linears, experts, lm_head) under autograd."""
    cfg = ModelConfig.from_pretrained(paths["untied"])
    quant = load_model(paths["untied"], cfg, torch.float32, torch.device("cpu"), quantization="mxfp8", quantize_lm_head=True)
    plain = load_model(paths["fake"], cfg, torch.float32, torch.device("cpu"))
    torch.manual_seed(1)
    ids = torch.randint(2, VOCAB, (2, 12))
    pos = torch.arange(12).repeat(2, 1)
    doc = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    got = quant.compute_logits(quant.forward_packed(ids, pos, doc).reshape(-1, cfg.hidden_size))
    want = plain.compute_logits(plain.forward_packed(ids, pos, doc).reshape(-1, cfg.hidden_size))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # under autograd: gradients reach the (high-precision) embedding through every MXFP8 layer
    quant.embed.requires_grad_(True)
    with torch.enable_grad():
        mask = torch.ones(12, 12, dtype=torch.bool).tril().expand(2, 12, 12)
        loss = quant.compute_logits(quant.forward_masked(ids, pos, mask).reshape(-1, cfg.hidden_size)).logsumexp(-1).sum()
        loss.backward()
    assert quant.embed.grad is not None and bool(quant.embed.grad[ids.unique()].abs().sum(-1).gt(0).all())
