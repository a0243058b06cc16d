"""Triton grouped GEMM over expert-sorted tokens: C[a] = A[row(a)] @ W[expert(a)].T (x routing weight).

Owns one kernel (vLLM fused_moe style, see `cuttle.moe.align`) and its launcher. Each program
takes one BLOCK_M run of `sorted_ids` (one expert) and one BLOCK_N slice of the outputs, walks K,
and accumulates in fp32. Weights are plain (bf16/fp16/fp32) or MXFP8 (E4M3 data + E8M0 scales
per 32 along K); activations are plain or MXFP8 too. MXFP8 weights go to `tl.dot_scaled` on GPUs
from Ada on (sm89+: MX tensor cores on sm100+, Triton's emulation with hardware fp8 conversion on
Hopper and Ada, measured faster there than this kernel's own decode), and are dequantized in-kernel
to the activation dtype elsewhere (fp32 activations, older GPUs, the Triton interpreter on CPU). Rows of C are assignments `t * top_k + j`:
A's row is `assignment // a_row_div` (top_k for the first GEMM over tokens, 1 for the second).
Never imports `cuttle.engine`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cuttle.moe.align import AlignedTokens
from cuttle.moe.mxfp8 import MXTensor


@dataclass(slots=True, frozen=True)
class GemmConfig:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64  # a multiple of 32, the MX block
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _decode_e4m3(code):
    """E4M3 byte -> fp32 exactly, in integer ops (byte 0x7F decodes finite; its block scale is NaN)."""
    c = code.to(tl.int32)
    e = (c >> 3) & 0xF
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((c & 0x80) != 0, -v, v)


@triton.jit
def _decode_e8m0(s):
    """E8M0 byte -> fp32 2^(s-127): byte 0 is the subnormal 2^-127, byte 255 is NaN."""
    b = s.to(tl.int32)
    bits = tl.where(b == 0, 0x400000, b << 23)
    return tl.where(b == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    weight_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    N,
    K,
    num_valid,
    a_row_div,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    A_MX: tl.constexpr,
    B_MX: tl.constexpr,
    DOT_SCALED: tl.constexpr,
    A_FMT: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    GROUP: tl.constexpr = 32
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ids_ptr + offs_m)
    row_ok = assign < num_valid
    a_row = (assign // a_row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, BLOCK_K // GROUP)
    KG = K // GROUP
    b_rows = b_ptr + expert * stride_be + offs_n.to(tl.int64) * stride_bn
    bs_rows = b_scale_ptr + (expert * N + offs_n.to(tl.int64)) * KG
    as_rows = a_scale_ptr + a_row * KG
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        g_ok = (k0 // GROUP + offs_g) < KG
        a = tl.load(a_ptr + a_row[:, None] * stride_am + (k0 + offs_k)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(b_rows[None, :] + (k0 + offs_k)[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0)
        if B_MX:
            # [BLOCK_N, BLOCK_K // 32]: the layout dot_scaled wants for its rhs scale
            bs = tl.load(bs_rows[:, None] + (k0 // GROUP + offs_g)[None, :], mask=n_ok[:, None] & g_ok[None, :],
                         other=127)
        if A_MX:
            a_s = tl.load(as_rows[:, None] + (k0 // GROUP + offs_g)[None, :], mask=row_ok[:, None] & g_ok[None, :],
                          other=127)
        if DOT_SCALED:
            b8 = b.to(tl.float8e4nv, bitcast=True)
            if A_MX:
                acc = tl.dot_scaled(a.to(tl.float8e4nv, bitcast=True), a_s, "e4m3", b8, bs, "e4m3", acc)
            else:
                acc = tl.dot_scaled(a, None, A_FMT, b8, bs, "e4m3", acc)
        else:
            if A_MX:
                av = tl.reshape(_decode_e4m3(a), (BLOCK_M, BLOCK_K // GROUP, GROUP))
                av = tl.reshape(av * _decode_e8m0(a_s)[:, :, None], (BLOCK_M, BLOCK_K))
                a = av.to(c_ptr.dtype.element_ty)
            if B_MX:
                bv = tl.reshape(_decode_e4m3(b), (BLOCK_K // GROUP, GROUP, BLOCK_N))
                bv = bv * tl.trans(_decode_e8m0(bs))[:, None, :]
                b = tl.reshape(bv, (BLOCK_K, BLOCK_N)).to(a.dtype)
            if IEEE_FP32:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + assign, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + assign.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


_DOT_SCALED_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def has_mx_tensor_cores(device: torch.device) -> bool:
    """sm100+ (Blackwell) has tcgen05 MXFP8 MMAs; `tl.dot_scaled` elsewhere only emulates them."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10


def prefers_dot_scaled(device: torch.device) -> bool:
    """Whether MXFP8 weights take `tl.dot_scaled` by default: on sm100+ it runs on MX tensor cores;
    on sm89 / sm90 Triton emulates it (hardware fp8 -> bf16 conversion, then a bf16 dot), which on
    an H200 ran the Qwen3-30B-A3B expert layer 1.5-2.0x faster than the in-kernel decode
    (docs/gpu.md). Older GPUs have no fp8 conversion: the in-kernel decode."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def moe_gemm(
    a: torch.Tensor | MXTensor,
    w: torch.Tensor | MXTensor,
    aligned: AlignedTokens,
    a_row_div: int,
    out_dtype: torch.dtype,
    weights: torch.Tensor | None = None,
    config: GemmConfig = GemmConfig(),
    dot_scaled: bool | None = None,
) -> torch.Tensor:
    """C [num_assignments, N] with C[a] = A[a // a_row_div] @ w[expert of a].T (* weights.flat[a]).

    `a` [rows, K] plain or MXFP8; `w` [E, N, K] plain or MXFP8. `dot_scaled` None picks by GPU
    (`prefers_dot_scaled`; fp32 activations always take the in-kernel decode).
    `aligned.block_size` must equal `config.block_m`.
    """
    if aligned.block_size != config.block_m:
        raise ValueError(f"tokens aligned to {aligned.block_size}, kernel block_m is {config.block_m}")
    a_mx, b_mx = isinstance(a, MXTensor), isinstance(w, MXTensor)
    a_data = a.data.view(torch.uint8) if a_mx else a
    b_data = w.data.view(torch.uint8) if b_mx else w
    a_scale = a.scale.view(torch.uint8) if a_mx else a_data  # unused pointer when not MX
    b_scale = w.scale.view(torch.uint8) if b_mx else b_data
    E, N, K = w.shape
    a_fmt = "e4m3" if a_mx else _DOT_SCALED_FORMATS.get(a_data.dtype)
    if dot_scaled is None:
        dot_scaled = b_mx and a_fmt is not None and prefers_dot_scaled(a_data.device)
    if dot_scaled and not (b_mx and a_fmt is not None):
        raise ValueError("dot_scaled needs MXFP8 weights and MXFP8, bf16 or fp16 activations")
    if (a_mx or b_mx) and K % 32 != 0:
        raise ValueError(f"MXFP8 operands need K % 32 == 0, got K={K}")
    c = torch.empty(aligned.num_assignments, N, dtype=out_dtype, device=a_data.device)
    grid = (aligned.block_expert.numel() * triton.cdiv(N, config.block_n),)
    _moe_gemm_kernel[grid](
        a_data, a_scale, b_data, b_scale, c, weights if weights is not None else c,
        aligned.sorted_ids, aligned.block_expert, aligned.expert_offsets[-1:],
        N, K, aligned.num_assignments, a_row_div,
        a_data.stride(0), b_data.stride(0), b_data.stride(1), c.stride(0),
        A_MX=a_mx, B_MX=b_mx, DOT_SCALED=dot_scaled, A_FMT=a_fmt or "", MUL_WEIGHT=weights is not None,
        IEEE_FP32=(out_dtype if a_mx else a_data.dtype) == torch.float32,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return c
