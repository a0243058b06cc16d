"""MXFP8 quantizer: bit-exact against hand-computed OCP MX v1.0 vectors (floor and RCEIL rules),
exact dequantization, and bit-exact against torchao's MX reference where torchao imports."""
from __future__ import annotations

import pytest
import torch

from cuttle.moe.mxfp8 import dequantize_mxfp8, quantize_mxfp8, scale_to_float32

NAN = float("nan")
INF = float("inf")


def _block(values: list[float]) -> torch.Tensor:
    """One 32-element block: the given values, then zeros."""
    return torch.tensor(values + [0.0] * (32 - len(values)), dtype=torch.float32)


def _bytes(x: torch.Tensor, mode: str) -> tuple[list[int], int]:
    data, scales = quantize_mxfp8(x, 32, mode)  # type: ignore[arg-type]
    assert data.dtype == torch.float8_e4m3fn and scales.dtype == torch.float8_e8m0fnu
    return data.view(torch.uint8).tolist(), int(scales.view(torch.uint8))


# (values, expected scale byte, expected leading element bytes); trailing zeros encode as 0x00.
# E4M3: s eeee mmm, bias 7; subnormals m * 2^-9. E8M0 byte b means 2^(b - 127).
FLOOR_VECTORS = [
    # normals: amax 3 -> floor(log2 3) - 8 = -7 -> byte 120; x*128: 128, 256, 384, -64
    ([1.0, 2.0, 3.0, -0.5], 120, [0x70, 0x78, 0x7C, 0xE8]),
    # saturation: amax 500 -> 2^(8-8) = 1; 500 and 480 exceed 448 and clamp to 0x7E; -449 to 0xFE
    ([500.0, 480.0, -449.0, 448.0, 416.0], 127, [0x7E, 0x7E, 0xFE, 0x7E, 0x7D]),
    # floor overflow: amax 511 = (2-2^-9)*2^8 still gets scale 1 and saturates
    ([511.0, 1.0], 127, [0x7E, 0x38]),
    # subnormals under scale 2^-8 (amax 1): x*256 = 2^-7 -> m=4; 3*2^-9 -> m=3; 2^-6 -> min normal
    ([1.0, 2.0**-15, 3 * 2.0**-17, 2.0**-14], 119, [0x78, 0x04, 0x03, 0x08]),
    # round-to-nearest-even ties: 2^-10 -> 0; 1.5*2^-9 -> 2; 2.5*2^-9 -> 2; 1.0625 -> 1.0; 1.1875 -> 1.25
    ([1.1875, 2.0**-18, 3 * 2.0**-18, 5 * 2.0**-18, 1.0625], 119, [0x7A, 0x00, 0x02, 0x02, 0x78]),
    # all-zero block: amax 0 -> the minimum scale 2^-127, byte 0
    ([], 0, [0x00, 0x00]),
    # amax below the E8M0 range (fp32 subnormal 2^-130): exponent clamps to -127; x/2^-127 = 0.125
    ([2.0**-130], 0, [0x20]),
    # large: amax 2^100 -> byte 127 + 92 = 219; x/2^92 = 256
    ([2.0**100, -(2.0**99)], 219, [0x78, 0xF0]),
    # NaN or Inf anywhere: scale NaN (0xFF) and every element NaN (0x7F)
    ([1.0, NAN, 2.0], 255, [0x7F, 0x7F, 0x7F, 0x7F]),
    ([1.0, -INF], 255, [0x7F, 0x7F, 0x7F]),
]

RCEIL_VECTORS = [
    # 3/448 -> ceil(log2) = -7, byte 120: same as floor here
    ([1.0, 2.0, 3.0, -0.5], 120, [0x70, 0x78, 0x7C, 0xE8]),
    # 500/448 -> ceil(log2 1.116) = 1 -> byte 128: nothing saturates; 250 -> 256 (0x78), 224 -> 0x76
    ([500.0, 448.0], 128, [0x78, 0x76]),
    # amax exactly 448 -> descale 1 -> byte 127; 449 -> byte 128
    ([448.0, 1.0], 127, [0x7E, 0x38]),
    ([449.0], 128, [0x76]),
    # descale exactly 2^-127 (subnormal) -> byte 0; a hair more -> byte 1
    ([448.0 * 2.0**-127], 0, [0x7E]),
    ([(448.0 + 32.0) * 2.0**-127], 1, [0x77]),
    ([], 0, [0x00]),
    ([NAN], 255, [0x7F, 0x7F]),
]


@pytest.mark.parametrize("values,scale,head", FLOOR_VECTORS)
def test_floor_spec_vectors(values: list[float], scale: int, head: list[int]) -> None:
    data, got_scale = _bytes(_block(values), "floor")
    assert got_scale == scale
    assert data[: len(head)] == head
    if scale != 255:
        assert data[len(values):] == [0] * (32 - len(values))


@pytest.mark.parametrize("values,scale,head", RCEIL_VECTORS)
def test_rceil_spec_vectors(values: list[float], scale: int, head: list[int]) -> None:
    data, got_scale = _bytes(_block(values), "rceil")
    assert got_scale == scale
    assert data[: len(head)] == head


def test_blocks_are_independent_and_along_last_dim() -> None:
    x = torch.cat([_block([3.0]), _block([500.0]), _block([])]).reshape(1, 96).repeat(2, 1)
    data, scales = quantize_mxfp8(x)
    assert scales.shape == (2, 3) and data.shape == (2, 96)
    assert scales.view(torch.uint8).tolist() == [[120, 127, 0]] * 2


def test_scale_decoding_is_exact() -> None:
    got = scale_to_float32(torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8).view(torch.float8_e8m0fnu))
    assert got[:4].tolist() == [2.0**-127, 2.0**-126, 1.0, 2.0**127]
    assert torch.isnan(got[4])


@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_round_trip_is_exact(mode: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    # magnitudes from 2^-60 to 2^60 per row, so both dequantization paths (fast bits, generic) run
    x = torch.randn(16, 64) * torch.logspace(-60, 60, 16, base=2.0)[:, None]
    data, scales = quantize_mxfp8(x, 32, mode)  # type: ignore[arg-type]
    exact = data.to(torch.float64).reshape(16, 2, 32) * scale_to_float32(scales).double()[..., None]
    got = dequantize_mxfp8(data, scales, 32, dtype)
    assert torch.equal(got, exact.reshape(16, 64).to(dtype))


def test_nan_block_dequantizes_to_nan() -> None:
    data, scales = quantize_mxfp8(torch.cat([_block([1.0, NAN]), _block([2.0])]))
    out = dequantize_mxfp8(data, scales)
    assert torch.isnan(out[:32]).all() and out[32] == 2.0


def test_rejects_ragged_last_dim() -> None:
    with pytest.raises(ValueError):
        quantize_mxfp8(torch.ones(2, 48))


def _torchao():
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    except Exception as e:  # torchao absent, or built against another torch
        pytest.skip(f"torchao MX reference not importable here ({type(e).__name__}: {e}); "
                    "install with `pip install --no-deps torchao`")
    return to_mx, to_dtype, ScaleCalculationMode


@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bit_exact_vs_torchao(mode: str, dtype: torch.dtype) -> None:
    to_mx, to_dtype, ScaleCalculationMode = _torchao()
    torch.manual_seed(1)
    # finite random tensors over a wide range; torchao deviates from the spec only for scale byte 0
    # with nonzero data (it divides by 2^-126) and for Inf, which these never contain
    x = (torch.randn(96, 256) * torch.logspace(-30, 30, 96, base=2.0)[:, None]).to(dtype)
    data, scales = quantize_mxfp8(x, 32, mode)  # type: ignore[arg-type]
    ref_scales, ref_data = to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=getattr(ScaleCalculationMode, mode.upper()))
    assert torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8))
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
    for out_dtype in (torch.float32, torch.bfloat16):
        ref = to_dtype(ref_data, ref_scales, torch.float8_e4m3fn, 32, out_dtype)
        assert torch.equal(dequantize_mxfp8(data, scales, 32, out_dtype), ref)
