"""Triton MXFP8 quantize kernel: the same bits as `cuttle.moe.mxfp8.quantize_mxfp8`, on the GPU.

Owns only the kernel and its launcher; the number-format rules live in `mxfp8.py` and this file
reproduces them bit for bit (exponents from float bits, `div_rn` for RCEIL's amax / 448, explicit
clamp to ±448 before the round-to-nearest-even cast). Needs a GPU with FP8 conversions (sm89+),
or the Triton interpreter (TRITON_INTERPRET=1) on CPU. Never imports `cuttle.engine`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cuttle.moe.mxfp8 import ScaleMode


@triton.jit
def _encode_e4m3(y):
    """Round-to-nearest-even E4M3 bytes of |y| <= 448, in integer arithmetic.

    Not `y.to(tl.float8e4nv)`: the interpreter's cast rounds ties up and truncates subnormals, and
    this way the kernel also runs on GPUs without FP8 conversions.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.int32)
    mag = bits & 0x7FFFFFFF
    # normals: round the 23-bit mantissa to 3 bits (the carry may bump the exponent), rebias 127 -> 7
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # subnormals (|y| < 2^-6): k * 2^-9 with k = rne(|y| * 512); the fp32 add of 2^23 rounds to even
    k = ((tl.abs(y) * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    return tl.where(mag < 0x3C800000, k, normal) | sign


@triton.jit
def _quantize_mxfp8_kernel(
    x_ptr,
    data_ptr,
    scale_ptr,
    R,
    K,
    stride_x,
    RCEIL: tl.constexpr,
    BF16_BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < R) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0)
    if BF16_BITS:
        # bf16 arrives as int16 bits: widening by shift is exact, and the interpreter's bf16 cast
        # flushes subnormals
        x = (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    xb = tl.reshape(x.to(tl.float32), (BLOCK_R, BLOCK_K // GROUP, GROUP))
    ax = tl.abs(xb)
    # NaN or Inf anywhere in a block makes the whole block NaN (scale 0xFF, elements 0x7F)
    bad = tl.max(((xb != xb) | (ax == float("inf"))).to(tl.int32), axis=2) != 0
    amax = tl.where(bad, 0.0, tl.max(tl.where(xb != xb, 0.0, ax), axis=2))
    if RCEIL:
        dbits = tl.math.div_rn(amax, 448.0).to(tl.int32, bitcast=True)
        dexp = (dbits >> 23) & 0xFF
        mant = dbits & 0x7FFFFF
        sub = tl.where(mant > 0x400000, -126, -127)
        unbiased = tl.where(dexp == 0, sub, dexp - 127 + (mant != 0).to(tl.int32))
    else:
        unbiased = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 8
    biased = tl.minimum(tl.maximum(unbiased, -127), 127) + 127
    inv_scale = ((254 - biased) << 23).to(tl.float32, bitcast=True)
    y = xb * inv_scale[:, :, None]
    q = _encode_e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0))
    q = tl.where(bad[:, :, None], 0x7F, q).to(tl.uint8)
    tl.store(data_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], tl.reshape(q, (BLOCK_R, BLOCK_K)), mask=mask)
    scale = tl.where(bad, 255, biased).to(tl.uint8)
    nb = K // GROUP
    scols = tl.program_id(1) * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)
    smask = (rows[:, None] < R) & (scols[None, :] < nb)
    tl.store(scale_ptr + rows[:, None].to(tl.int64) * nb + scols[None, :], scale, mask=smask)


def quantize_mxfp8_triton(
    x: torch.Tensor, block_size: int = 32, scale_mode: ScaleMode = "floor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `quantize_mxfp8`: (float8_e4m3fn [..., K], float8_e8m0fnu [..., K // block_size])."""
    if scale_mode not in ("floor", "rceil"):
        raise ValueError(f"scale_mode must be 'floor' or 'rceil', got {scale_mode!r}")
    K = x.shape[-1]
    if K % block_size != 0:
        raise ValueError(f"last dim {K} is not a multiple of block_size {block_size}")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    R = x2.shape[0]
    bf16_bits = x2.dtype == torch.bfloat16
    if bf16_bits:
        x2 = x2.view(torch.int16)
    data = torch.empty(R, K, dtype=torch.uint8, device=x.device)
    scales = torch.empty(R, K // block_size, dtype=torch.uint8, device=x.device)
    block_k = block_size * max(1, min(4, 128 // block_size))
    block_r = 16
    grid = (triton.cdiv(R, block_r), triton.cdiv(K, block_k))
    _quantize_mxfp8_kernel[grid](
        x2, data, scales, R, K, x2.stride(0),
        RCEIL=scale_mode == "rceil", BF16_BITS=bf16_bits, GROUP=block_size, BLOCK_R=block_r, BLOCK_K=block_k,
    )
    return (
        data.view(torch.float8_e4m3fn).reshape(x.shape),
        scales.view(torch.float8_e8m0fnu).reshape(*x.shape[:-1], K // block_size),
    )
