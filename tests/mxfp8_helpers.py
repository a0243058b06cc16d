"""Shared by the MXFP8 engine tests: the "dequantize, then matmul" oracle checkpoint and the
comparison of two engines' greedy outputs and logprobs."""
from __future__ import annotations

import os

import torch
from safetensors.torch import load_file, save_file

from cuttle.moe.mxfp8 import dequantize_mxfp8, quantize_mxfp8

_COVERED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fake_quantize_checkpoint(src: str, dst: str, lm_head: bool = False) -> None:
    """Copy of `src` whose covered linears (and routed experts; `lm_head`: the untied lm_head too)
    hold their MXFP8 round trip (fp32)."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f.endswith(".safetensors"):
            tensors = load_file(os.path.join(src, f))
            for name, t in tensors.items():
                if name.endswith(".weight") and any(f".{p}." in name for p in _COVERED) or (lm_head and name == "lm_head.weight"):
                    tensors[name] = dequantize_mxfp8(*quantize_mxfp8(t.float()), 32, torch.float32).to(t.dtype)
            save_file(tensors, os.path.join(dst, f), metadata={"format": "pt"})
        elif not os.path.isdir(os.path.join(src, f)):
            with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
                b.write(a.read())


def close_outputs(a, b, tol: float) -> None:
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            for tok in lx:
                assert abs(lx[tok].logprob - ly[tok].logprob) <= tol
        for px, py in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            for tok in px:
                if tok in py:
                    assert abs(px[tok].logprob - py[tok].logprob) <= tol
