"""Runs the cuttle.moe Triton kernels against their torch references and prints one JSON line per case.

Started by test_moe_triton.py in a subprocess. Without CUDA it switches on the Triton interpreter
(TRITON_INTERPRET=1) before triton is imported, so the setting never leaks into other tests; with
CUDA the kernels are compiled for the GPU (and bf16 is checked too). Shapes are tiny on purpose.
"""
from __future__ import annotations

import json
import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from cuttle.moe.align import align_tokens  # noqa: E402
from cuttle.moe.align_triton import align_tokens_triton  # noqa: E402
from cuttle.moe.experts_torch import fused_experts_torch  # noqa: E402
from cuttle.moe.experts_triton import fused_experts_triton  # noqa: E402
from cuttle.moe.grouped_gemm_triton import GemmConfig, moe_gemm  # noqa: E402
from cuttle.moe.mxfp8 import MXTensor, quantize_mxfp8  # noqa: E402
from cuttle.moe.mxfp8_triton import quantize_mxfp8_triton  # noqa: E402
from cuttle.moe.routing import RoutingConfig, route  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
# the interpreter's bf16 tl.dot multiplies raw uint16 bits, so bf16 runs on a GPU only
DTYPES = (torch.float32, torch.float16, torch.bfloat16) if CUDA else (torch.float32, torch.float16)
CONFIG = GemmConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2)


def emit(**row: object) -> None:
    print(json.dumps(row), flush=True)


def quantize_cases() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 96, generator=g) * torch.logspace(-40, 30, 40)[:, None]
    x[0, :5] = torch.tensor([float("nan"), 1.0, 2.0, 3.0, 4.0])
    x[1, 40] = float("inf")
    x[2, :32] = 0.0
    x[3, :32] = 2.0**-130  # fp32 subnormals: the scale clamps to 2^-127
    x[4, :32] = torch.arange(32) * 2.0**-12  # E4M3 subnormals and ties
    x[5, :32] = torch.linspace(-500.0, 500.0, 32)  # saturation under the floor rule
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for mode in ("floor", "rceil"):
            xd = x.to(dtype)
            data, scales = quantize_mxfp8(xd, 32, mode)
            got_data, got_scales = quantize_mxfp8_triton(xd.to(DEVICE), 32, mode)
            emit(kind="quantize", dtype=str(dtype), mode=mode,
                 data_exact=torch.equal(got_data.cpu().view(torch.uint8), data.view(torch.uint8)),
                 scale_exact=torch.equal(got_scales.cpu().view(torch.uint8), scales.view(torch.uint8)))


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref.double()).norm() / ref.double().norm())


def gemm_cases() -> None:
    g = torch.Generator().manual_seed(1)
    T, k, E, K, N = 9, 2, 4, 96, 80  # K and N not multiples of the blocks: masked edges
    a = torch.randn(T, K, generator=g)
    w = torch.randn(E, N, K, generator=g) * 0.1
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    aligned = align_tokens(ids.to(DEVICE), E, CONFIG.block_m)
    wq = MXTensor(*quantize_mxfp8(w))
    for dtype in DTYPES:
        ad = a.to(dtype)
        aq = MXTensor(*quantize_mxfp8(ad))
        variants = [("plain", ad, w.to(dtype), False), ("mx_weights", ad, wq, False), ("mx_both", aq, wq, False)]
        if dtype != torch.float32:
            variants.append(("mx_weights_dot_scaled", ad, wq, True))
        variants.append(("mx_both_dot_scaled", aq, wq, True))
        for name, a_op, w_op, dot_scaled in variants:
            a_ref = a_op.dequantize() if isinstance(a_op, MXTensor) else a_op.float()
            w_ref = w_op.dequantize() if isinstance(w_op, MXTensor) else w_op.float()
            rows = torch.arange(T * k) // k
            ref = torch.einsum("mk,mnk->mn", a_ref[rows].double(), w_ref[ids.reshape(-1)].double())
            ref = ref * weights.reshape(-1, 1).double()
            on_device = (MXTensor(a_op.data.to(DEVICE), a_op.scale.to(DEVICE)) if isinstance(a_op, MXTensor)
                         else a_op.to(DEVICE))
            w_dev = (MXTensor(w_op.data.to(DEVICE), w_op.scale.to(DEVICE)) if isinstance(w_op, MXTensor)
                     else w_op.to(DEVICE))
            out = moe_gemm(on_device, w_dev, aligned, k, dtype, weights=weights.reshape(-1).to(DEVICE),
                           config=CONFIG, dot_scaled=dot_scaled)
            emit(kind="gemm", dtype=str(dtype), variant=name, rel_err=_rel(out, ref), shape=list(out.shape))


def align_cases() -> None:
    """The one-program alignment against the torch version: every tensor equal."""
    g = torch.Generator().manual_seed(3)
    #          T, k, E, block: decode, GQA-size batches, E not a power of two, one expert, E = 256,
    #          no tokens, more assignments than one chunk, every token on one expert
    shapes = [(1, 8, 128, 16), (9, 2, 4, 16), (16, 8, 128, 16), (64, 4, 6, 32), (3, 1, 1, 16), (8, 8, 256, 16),
              (0, 2, 8, 16), (300, 8, 128, 64), (40, 2, 8, 16)]
    for T, k, E, bs in shapes:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
        if (T, k, E) == (40, 2, 8):
            ids[:, 0] = 5  # one expert takes every token
            ids[:, 1] = torch.where(ids[:, 1] == 5, 6, ids[:, 1])
        want = align_tokens(ids.to(DEVICE), E, bs)
        got = align_tokens_triton(ids.to(DEVICE), E, bs)
        same = all(torch.equal(getattr(got, f).cpu(), getattr(want, f).cpu())
                   for f in ("sorted_ids", "block_expert", "expert_offsets"))
        emit(kind="align", shape=[T, k, E, bs], equal=same and got.num_assignments == want.num_assignments)


def align_name_cases() -> None:
    """`align_for` refuses an alignment it does not know, naming the choices."""
    from cuttle.moe.experts_triton import align_for

    try:
        align_for(torch.zeros(2, 2, dtype=torch.long, device=DEVICE), 4, 16, "bogus")
        emit(kind="align_bad_name", error=None)
    except ValueError as e:
        emit(kind="align_bad_name", error=str(e))


def layer_cases() -> None:
    g = torch.Generator().manual_seed(2)
    T, H, I, E, k = 11, 64, 32, 6, 3
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.1
    w2 = torch.randn(E, H, I, generator=g) * 0.1
    weights, ids = route(torch.randn(T, E, generator=g), RoutingConfig(E, k))
    q13, q2 = MXTensor(*quantize_mxfp8(w13)), MXTensor(*quantize_mxfp8(w2))
    dev = lambda m: MXTensor(m.data.to(DEVICE), m.scale.to(DEVICE))  # noqa: E731
    for dtype in DTYPES:
        xd = x.to(dtype)
        # the expert path through each alignment
        for name, a13, a2, act, align in [("plain", w13.to(dtype), w2.to(dtype), None, "torch"),
                                          ("mx", q13, q2, None, "torch"), ("mx_act_rceil", q13, q2, "rceil", "torch"),
                                          ("plain_align_triton", w13.to(dtype), w2.to(dtype), None, "triton"),
                                          ("mx_align_triton", q13, q2, None, "triton")]:
            # same dtype as the kernel, so h is rounded to it before any MXFP8 rounding in both
            ref = fused_experts_torch(xd, a13, a2, weights, ids, act_quant=act)
            t13 = dev(a13) if isinstance(a13, MXTensor) else a13.to(DEVICE)
            t2 = dev(a2) if isinstance(a2, MXTensor) else a2.to(DEVICE)
            out = fused_experts_triton(xd.to(DEVICE), t13, t2, weights.to(DEVICE), ids.to(DEVICE), act_quant=act,
                                       config=CONFIG, align=align)
            emit(kind="layer", dtype=str(dtype), variant=name, rel_err=_rel(out.float(), ref.float()),
                 out_dtype=str(out.dtype))


if __name__ == "__main__":
    emit(kind="env", interpreted=os.environ.get("TRITON_INTERPRET") == "1", cuda=CUDA)
    quantize_cases()
    gemm_cases()
    align_cases()
    align_name_cases()
    layer_cases()
