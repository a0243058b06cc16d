"""FP8 block-scaled checkpoints (the Qwen3-*-FP8 / DeepSeek-V3 layout: float8_e4m3fn weights, one
`weight_scale_inv` per block), dequantized at load: the engine's greedy tokens and logprobs match
transformers loading the same directory (its own FP8 dequantization, fp32) on tiny random Qwen3 and
Qwen3-MoE checkpoints written here; the layout's errors are refused naming the tensor or field."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import ModelConfig
from cuttle.engine.models.fp8_checkpoint import dequantize_block_fp8
from helpers import assert_scored_by_transformers, make_checkpoint

TOL = 1e-4
BLOCK = (32, 32)  # real checkpoints use 128x128; the tiny shapes need smaller blocks to have several
QC = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(BLOCK)}


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """What the FP8 quantizers do: per block, scale = amax / 448 and W8 = W / scale (edge blocks padded)."""
    r, c = w.shape
    br, bc = -(-r // block[0]), -(-c // block[1])
    padded = torch.zeros(br * block[0], bc * block[1])
    padded[:r, :c] = w.float()
    blocks = padded.view(br, block[0], bc, block[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    w8 = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(br * block[0], bc * block[1])
    return w8[:r, :c].contiguous(), scale


def write_fp8_checkpoint(path: str, arch: str, qc: dict = QC) -> None:
    """A tiny random checkpoint rewritten in the FP8 block layout: every projection of the decoder
    (attention, dense and expert MLPs) quantized; embeddings, norms, router and lm_head kept."""
    make_checkpoint(path, arch, seed=7, intermediate_size=96)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith("_proj.weight"):
            out[name], out[name + "_scale_inv"] = quantize_block_fp8(t, tuple(qc["weight_block_size"]))
        else:
            out[name] = t
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.fixture(scope="module")
def fp8_qwen3(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("fp8_qwen3"))
    write_fp8_checkpoint(path, "qwen3")
    return path


def _transformers_dequantized(path: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.dtype == torch.float32  # transformers dequantized it (no GPU: its FP8 path dequantizes)
    return model


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_fp8_logits_match_transformers_dequantized(tmp_path, fp8_qwen3, arch):
    if arch == "qwen3":
        path = fp8_qwen3
    else:
        path = str(tmp_path)
        write_fp8_checkpoint(path, arch)
    ref = _transformers_dequantized(path)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (4, 23, 41)]
    llm = LLM(path, dtype="float32", attention_backend="torch", num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    for prompt, o in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert_scored_by_transformers(ref, prompt, o, TOL)


def test_fp8_weights_are_the_dequantized_ones(fp8_qwen3):
    """The engine holds W8 * S, not the raw FP8 codes nor the scales dropped (which once loaded as
    garbage): one weight checked against the formula, and it differs from the unscaled codes."""
    llm = LLM(fp8_qwen3, dtype="float32", num_kv_blocks=16)
    model = llm.engine.runner.model
    tensors = load_file(os.path.join(fp8_qwen3, "model.safetensors"))
    w8, s = tensors["model.layers.1.mlp.down_proj.weight"], tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    want = w8.float() * s.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
    assert torch.equal(model.layers[1].mlp.down_weight, want)
    assert not torch.equal(want, w8.float())
    assert ModelConfig.from_pretrained(fp8_qwen3).fp8_quant.block == BLOCK


def test_dequantize_crops_partial_edge_blocks():
    """Shapes that are not multiples of the block (the quantizer padded the edge blocks)."""
    torch.manual_seed(0)
    w = torch.randn(2, 70, 50)  # a stacked (expert) weight, 3 x 4 blocks of 32 x 16
    w8, s = zip(*(quantize_block_fp8(w[e], (32, 16)) for e in range(2)))
    w8, s = torch.stack(w8), torch.stack(s)
    got = dequantize_block_fp8(w8, s, (32, 16))
    for e in range(2):
        for i in range(70):
            for j in range(0, 50, 7):
                assert got[e, i, j].item() == (w8[e, i, j].float() * s[e, i // 32, j // 16]).item()  # fp32 product
    assert (got - w).abs().max().item() < 0.07 * w.abs().max().item()  # e4m3: 3 mantissa bits
    with pytest.raises(ValueError, match=r"scale grid \(2, 3, 3\) does not fit weight \(2, 70, 50\)"):
        dequantize_block_fp8(w8, s[:, :, :3], (32, 16))


def _edit(src: str, dst: str, tensors=None, qc=None) -> str:
    os.makedirs(dst)
    for f in os.listdir(src):
        with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
            b.write(a.read())
    if tensors is not None:
        t = load_file(os.path.join(dst, "model.safetensors"))
        tensors(t)
        save_file(t, os.path.join(dst, "model.safetensors"))
    if qc is not None:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        cfg["quantization_config"] = qc
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    return dst


Q = "model.layers.0.self_attn.q_proj.weight"
CASES = {
    "missing_scale": (lambda t: t.pop(Q + "_scale_inv"), None, r"have no weight_scale_inv: \['model.layers.0.self_attn.q_proj.weight'\]"),
    "orphan_scale": (lambda t: t.update({Q: t[Q].float()}), None, r"weight_scale_inv tensors .* have no FP8 weight beside them: \['model.layers.0.self_attn.q_proj.weight_scale_inv'\]"),
    "wrong_grid": (lambda t: t.update({Q + "_scale_inv": t[Q + "_scale_inv"][:1]}), None, r"tensor 'model.layers.0.self_attn.q_proj.weight': scale grid \(1, 2\)"),
    "fp8_scale": (lambda t: t.update({Q + "_scale_inv": t[Q + "_scale_inv"].to(torch.float8_e4m3fn)}), None, r"q_proj.weight_scale_inv.*float8_e4m3fn; FP8 block scales are"),
    "e5m2_weight": (lambda t: t.update({Q: t[Q].float().to(torch.float8_e5m2)}), None, r"q_proj.weight.*float8_e5m2"),
    "ignored_module_is_fp8": (None, {**QC, "modules_to_not_convert": ["lm_head", "q_proj"]}, r"q_proj.weight.*is FP8, but quantization_config lists 'q_proj' as not converted"),
    "static_activations": (None, {**QC, "activation_scheme": "static"}, r"quantization_config.activation_scheme 'static'.*supported: dynamic"),
    "per_tensor": (None, {k: v for k, v in QC.items() if k != "weight_block_size"}, r"quantization_config.weight_block_size.*two positive integers.*per-tensor"),
    "bad_block": (None, {**QC, "weight_block_size": [128, 0]}, r"quantization_config.weight_block_size"),
    "e5m2_fmt": (None, {**QC, "fmt": "e5m2"}, r"quantization_config.fmt 'e5m2'"),
    "unknown_field": (None, {**QC, "kv_cache_scheme": "fp8"}, r"quantization_config fields \['kv_cache_scheme'\]"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_layout_errors_are_refused(fp8_qwen3, tmp_path, case):
    tensors, qc, match = CASES[case]
    path = _edit(fp8_qwen3, str(tmp_path / case), tensors, qc)
    with pytest.raises(ValueError, match=match):
        LLM(path, dtype="float32", num_kv_blocks=16)


def test_not_converted_modules_load_full_precision(fp8_qwen3, tmp_path):
    """`modules_to_not_convert` naming modules that are indeed full precision (lm_head) loads."""
    path = _edit(fp8_qwen3, str(tmp_path / "ignored"), qc={**QC, "modules_to_not_convert": ["lm_head"], "scale_fmt": "ue8m0"})
    assert ModelConfig.from_pretrained(path).fp8_quant.ignored == ("lm_head",)
    out = LLM(path, dtype="float32", num_kv_blocks=16).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
