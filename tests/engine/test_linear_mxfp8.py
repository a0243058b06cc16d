"""MXFP8 dense linears (`quantization="mxfp8"`, issue 18 point 2).

Oracle: the same checkpoint with every covered weight replaced by its MXFP8 round trip
(quantize_mxfp8 -> dequantize_mxfp8, done here in torch), served by the plain fp32 engine, i.e.
"dequantize, then matmul". The quantized engine (native MXFP8 GEMM, decode and tile loops) must
give the same greedy tokens and logprobs within accumulation-order rounding. Also: the bytes equal
quantize_mxfp8 of the HF tensors, no high-precision copy stays, weight updates re-quantize (HF and
engine names), bad values are refused naming the field.
"""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from cuttle.attention.native import mxfp8 as native_mx
from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import EngineConfig, ModelConfig
from cuttle.engine.models import load_model
from cuttle.engine.models.linear_quant import MXLinearWeight, quantized_linears, reference_linear
from cuttle.moe.mxfp8 import quantize_mxfp8
from helpers import make_checkpoint, parity_prompts
from mxfp8_helpers import close_outputs, fake_quantize_checkpoint

PROMPTS = [parity_prompts()[i] for i in (0, 3, 5, 7)]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mx_dense")
    out = {"plain": str(root / "plain"), "fake": str(root / "fake"), "other": str(root / "other")}
    make_checkpoint(out["plain"], "qwen3", seed=3)
    make_checkpoint(out["other"], "qwen3", seed=4)
    fake_quantize_checkpoint(out["plain"], out["fake"])
    return out


def _run(llm: LLM):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    return llm.generate(PROMPTS, params, use_tqdm=False)


@pytest.mark.skipif(not native_mx.available(), reason="native CPU kernel library not built")
def test_engine_equals_dequantize_then_matmul(paths):
    kw = dict(dtype="float32", num_kv_blocks=64, logprobs_mode="raw", max_num_batched_tokens=64)
    quant = LLM(paths["plain"], quantization="mxfp8", **kw)
    model = quant.engine.runner.model
    mx = quantized_linears(model)
    assert len(mx) == 4 * model.cfg.num_layers
    assert not any(n.endswith(("qkv_weight", "o_weight", "gate_up_weight", "down_weight")) for n, _ in model.named_parameters())
    # 4 prompts decode together (decode loop, M <= 8) after chunked prefills (tile loop, M > 8)
    close_outputs(_run(quant), _run(LLM(paths["fake"], **kw)), 2e-5)


def test_bytes_equal_quantize_of_the_checkpoint(paths):
    cfg = ModelConfig.from_pretrained(paths["plain"])
    model = load_model(paths["plain"], cfg, torch.float32, torch.device("cpu"), quantization="mxfp8")
    hf = load_file(os.path.join(paths["plain"], "model.safetensors"))
    mx = quantized_linears(model)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([hf[p + f"self_attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj")])
        gate_up = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        for name, w in (("attn.qkv_weight", qkv), ("attn.o_weight", hf[p + "self_attn.o_proj.weight"]),
                        ("mlp.gate_up_weight", gate_up), ("mlp.down_weight", hf[p + "mlp.down_proj.weight"])):
            d, s = quantize_mxfp8(w.float())
            got = mx[f"layers.{i}.{name}"]
            assert torch.equal(got.data.view(torch.uint8), d.view(torch.uint8)), name
            assert torch.equal(got.scale.view(torch.uint8), s.view(torch.uint8)), name
    # 8.25 bits a weight for the covered linears
    bf16_bytes = sum(2 * w.data.numel() for w in mx.values())
    assert sum(w.nbytes() for w in mx.values()) / bf16_bytes == 8.25 / 16


@pytest.mark.skipif(not native_mx.available(), reason="native CPU kernel library not built")
def test_native_linear_equals_reference_linear(paths):
    cfg = ModelConfig.from_pretrained(paths["plain"])
    model = load_model(paths["plain"], cfg, torch.float32, torch.device("cpu"), quantization="mxfp8")
    w = model.layers[0].mlp.down_weight
    assert isinstance(w, MXLinearWeight)
    from cuttle.engine.models.linear_quant import linear

    for m in (1, 3, 9):
        x = torch.randn(m, w.shape[1])
        torch.testing.assert_close(linear(x, w), reference_linear(x, w), rtol=1e-5, atol=1e-5)


def test_update_weights_requantizes(paths):
    kw = dict(dtype="float32", num_kv_blocks=64, logprobs_mode="raw")
    llm = LLM(paths["plain"], quantization="mxfp8", **kw)
    want = LLM(paths["other"], quantization="mxfp8", **kw)
    cfg = ModelConfig.from_pretrained(paths["other"])
    trainer_like = load_model(paths["other"], cfg, torch.float32, torch.device("cpu"))
    # engine names (a trainer on this model code) for layer 0, HF names for everything else
    engine_named = [(n, p.detach()) for n, p in trainer_like.named_parameters() if n.startswith("layers.0.")]
    hf = [(n, t) for n, t in load_file(os.path.join(paths["other"], "model.safetensors")).items()
          if not n.startswith("model.layers.0.")]
    llm.update_weights(engine_named + hf)
    a, b = quantized_linears(llm.engine.runner.model), quantized_linears(want.engine.runner.model)
    for n in b:
        assert torch.equal(a[n].data.view(torch.uint8), b[n].data.view(torch.uint8)), n
        assert torch.equal(a[n].scale.view(torch.uint8), b[n].scale.view(torch.uint8)), n
    for x, y in zip(_run(llm), _run(want)):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].cumulative_logprob == y.outputs[0].cumulative_logprob


def test_bad_quantization_is_refused(paths, tmp_path, capsys):
    with pytest.raises(ValueError, match="quantization must be None or one of mxfp8; got 'int4'"):
        EngineConfig(model=paths["plain"], quantization="int4")
    from cuttle.engine.cli import main

    with pytest.raises(SystemExit):
        main(["serve", paths["plain"], "--quantization", "fp8"])
    err = capsys.readouterr().err
    assert "--quantization: invalid choice: 'fp8'" in err and "mxfp8" in err
    odd = str(tmp_path / "odd")
    make_checkpoint(odd, "qwen3", seed=1, intermediate_size=48)
    with pytest.raises(ValueError, match="layers.0.mlp.down_weight has input dim 48, not a multiple of the MX block size 32"):
        load_model(odd, ModelConfig.from_pretrained(odd), torch.float32, torch.device("cpu"), quantization="mxfp8")
