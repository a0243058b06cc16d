"""MXFP8 (OCP Microscaling v1.0) quantization: the torch reference every MX kernel is checked against.

Owns the number format: E4M3 elements in blocks of `block_size` (32) along the last (reduction)
dimension, one E8M0 shared scale per block, the two scale rules ("floor" = spec §6.3, "rceil" =
cuBLAS / SM100 `cvt.rp`), the spec's NaN/Inf and all-zero handling, and exact dequantization.
Must never import from `cuttle.engine`, and must stay free of Triton so it runs everywhere.

Bit-level rules (also in docs/moe.md):
  floor: X = 2^(floor(log2 amax) - 8)          rceil: X = 2^ceil(log2(fp32(amax / 448)))
  the unbiased exponent is clamped to [-127, 127]; E8M0 byte = exponent + 127
  a block holding NaN or Inf: scale byte 0xFF (NaN) and every element byte 0x7F (NaN)
  an all-zero block: amax = 0, scale byte 0x00 (2^-127), elements 0
  elements: V / X in fp32 (exact: X is a power of two), clamped to ±448, rounded to nearest-even
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

ScaleMode = Literal["floor", "rceil"]

E4M3_MAX = 448.0
E4M3_EMAX = 8  # floor(log2(448)): the spec's emax_elem for E4M3
E8M0_BIAS = 127
E8M0_NAN = 255
E4M3_NAN_BYTE = 0x7F
# Scale bytes up to this one dequantize through the fast bf16 bit path (2^(b-7) stays finite);
# block amax < 2^16, i.e. every real weight. Larger scales take the exact fp32 path.
_FAST_MAX_SCALE_BYTE = 134


@dataclass(slots=True)
class MXTensor:
    """An MXFP8 tensor: E4M3 `data` [..., K] and E8M0 `scale` [..., K // block_size]."""

    data: torch.Tensor
    scale: torch.Tensor
    block_size: int = 32

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mxfp8(self.data, self.scale, self.block_size, dtype)

    def __getitem__(self, index: int) -> "MXTensor":
        """One expert's slice of a stacked [E, N, K] weight."""
        return MXTensor(self.data[index], self.scale[index], self.block_size)


def scale_exponent(amax: torch.Tensor, scale_mode: ScaleMode) -> torch.Tensor:
    """Biased E8M0 byte (int32, before NaN handling) from a float32 block amax, exactly.

    Exponents come from the float32 bit pattern, not log2(), which rounds near powers of two.
    """
    bits = amax.view(torch.int32)
    exp_field = (bits >> 23) & 0xFF
    if scale_mode == "floor":
        # Subnormal amax (exp field 0) reads as -127, already below the clamp like its true floor.
        unbiased = exp_field - E8M0_BIAS - E4M3_EMAX
    elif scale_mode == "rceil":
        descale = amax / E4M3_MAX  # fp32 division, as the hardware rule computes it
        dbits = descale.view(torch.int32)
        dexp = (dbits >> 23) & 0xFF
        mant = dbits & 0x7FFFFF
        unbiased = torch.where(
            dexp == 0,
            # subnormal descale: ceil(log2) is -126 above 2^-127 and <= -127 at or below it
            torch.where(mant > 0x400000, -126, -127).to(torch.int32),
            dexp - E8M0_BIAS + (mant != 0).to(torch.int32),
        )
    else:
        raise ValueError(f"scale_mode must be 'floor' or 'rceil', got {scale_mode!r}")
    return unbiased.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS


def quantize_mxfp8(
    x: torch.Tensor, block_size: int = 32, scale_mode: ScaleMode = "floor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the last dim. Returns (data float8_e4m3fn [..., K], scales float8_e8m0fnu [..., K/bs])."""
    K = x.shape[-1]
    if K % block_size != 0:
        raise ValueError(f"last dim {K} is not a multiple of block_size {block_size}")
    # bf16 is scaled in bf16: x * 2^k is exact there (same exponent range as fp32), and half the bytes
    compute = x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.float32
    blocks = x.to(compute).reshape(*x.shape[:-1], K // block_size, block_size)
    amax = blocks.abs().amax(dim=-1).float()  # NaN and Inf propagate into amax
    bad = ~torch.isfinite(amax)
    biased = scale_exponent(amax.masked_fill(bad, 0.0), scale_mode)
    # 1/X = 2^(127 - biased) as fp32 bits; biased <= 247 for finite fp32 input, so this is normal.
    inv_scale = ((254 - biased) << 23).view(torch.float32).to(compute)
    data = (blocks * inv_scale.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    scales = biased.to(torch.uint8)
    if bool(bad.any()):
        data.view(torch.uint8).masked_fill_(bad.unsqueeze(-1), E4M3_NAN_BYTE)
        scales.masked_fill_(bad, E8M0_NAN)
    return data.reshape(x.shape), scales.view(torch.float8_e8m0fnu)


def scale_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 2^(b-127), exactly: byte 0 is the subnormal 2^-127, 0xFF is NaN."""
    b = scales.view(torch.uint8).to(torch.int32)
    bits = torch.where(b == 0, 0x400000, b << 23)
    bits = torch.where(b == E8M0_NAN, 0x7FC00000, bits)
    return bits.view(torch.float32)


def dequantize_mxfp8(
    data: torch.Tensor, scales: torch.Tensor, block_size: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Exact dequantization: every output is the correctly rounded `dtype` value of element * 2^(b-127)."""
    K = data.shape[-1]
    blocked = (*data.shape[:-1], K // block_size, block_size)
    if (
        dtype in (torch.bfloat16, torch.float32) and int(scales.view(torch.uint8).max()) <= _FAST_MAX_SCALE_BYTE
        # the bit path reads an E4M3 NaN byte as 480; the quantizer writes one only into NaN-scale
        # blocks, but bytes from elsewhere must still decode to NaN
        and not bool((data.view(torch.uint8) & 0x7F).eq_(0x7F).any())
    ):
        return _dequantize_bits(data, scales, blocked, dtype).reshape(data.shape)
    values = data.to(torch.float32).reshape(blocked) * scale_to_float32(scales).unsqueeze(-1)
    return values.reshape(data.shape).to(dtype)


def _dequantize_bits(
    data: torch.Tensor, scales: torch.Tensor, blocked: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """CPU-fast path (about 10x a plain fp8 cast): place the E4M3 bits into the target float's bits.

    Sign-extending the byte and shifting puts `s eeee mmm` into the sign / low exponent / mantissa
    fields (the mask clears the sign copies in between), which reads as element * 2^-120 (E4M3
    subnormals land on target subnormals, so no case split); the 2^120 is folded into the block
    scale, finite for bytes <= 134. A NaN element byte would read as 480: the caller sends data
    holding one to the fp32 path. One rounding of an exact product, hence equal to the fp32 path.
    Three in-place passes after the widening copy.
    """
    if dtype == torch.bfloat16:
        vals = data.view(torch.int8).to(torch.int16)
        vals.__ilshift__(4).__iand__(-0x7810)  # 0x87F0 as int16
        vals = vals.view(torch.bfloat16)
    else:
        vals = data.view(torch.int8).to(torch.int32)
        vals.__ilshift__(20).__iand__(-0x78100000)  # 0x87F00000 as int32
        vals = vals.view(torch.float32)
    b = scales.view(torch.uint8).to(torch.int32)
    folded = torch.where(b == E8M0_NAN, 0x7FC00000, (b + 120) << 23).view(torch.float32).to(dtype)
    return vals.reshape(blocked).mul_(folded.unsqueeze(-1))



class _FakeQuantizeSTE(torch.autograd.Function):
    """Forward: the exact MXFP8 round trip of w (quantized from `from_dtype`). Backward: the
    gradient unchanged (straight-through), so master weights train as if unquantized."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, from_dtype: torch.dtype, scale_mode: ScaleMode) -> torch.Tensor:  # type: ignore[override]
        data, scales = quantize_mxfp8(w.detach().to(from_dtype), 32, scale_mode)
        return dequantize_mxfp8(data, scales, 32, w.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return grad, None, None


def fake_quantize_ste(w: torch.Tensor, from_dtype: torch.dtype | None = None, scale_mode: ScaleMode = "floor") -> torch.Tensor:
    """Quantize-on-the-fly for training: the values an MXFP8 server computes with (w cast to
    `from_dtype`, the server's model dtype, then quantize_mxfp8 along the last dim), in w's dtype,
    with straight-through gradients. Bit-identical to dequantizing what the server quantized."""
    return _FakeQuantizeSTE.apply(w, from_dtype or w.dtype, scale_mode)
