"""MXFP8 CPU kernel (attention/csrc/mxfp8_gemm.c), issue 18 acceptance 2: dequantization bit-exact
against cuttle.moe.mxfp8's reference (every element byte, every scale byte, fp32 and bf16), the
GEMM against float64 on the dequantized weights within fp32 accumulation error (decode and tile
loops, fp32/bf16 activations, bias, ragged N), K not a multiple of 32 refused. Every case runs on
the bf16-dot decode loop (where the library has it: AVX512-BF16 + VBMI), the AVX2 path and the
scalar fallback."""
from __future__ import annotations

import pytest
import torch

from cuttle.attention.native import mxfp8 as mx
from cuttle.moe.mxfp8 import dequantize_mxfp8, quantize_mxfp8

pytestmark = pytest.mark.skipif(not mx.available(), reason="native CPU kernel library not built (no C compiler)")

F64 = torch.float64


@pytest.fixture(params=["bf16_dot", "avx2", "scalar"])
def path(request):
    if request.param != "scalar" and not mx.fast_path_available():
        pytest.skip("CPU lacks AVX2/FMA/F16C")
    if request.param == "bf16_dot" and not mx.bf16_dot_available():
        pytest.skip("library not built for AVX512-BF16 + AVX512-VBMI (this CPU lacks them)")
    fast = request.param != "scalar"
    assert mx.set_fast_path(fast) == fast
    assert mx.set_bf16_dot(request.param == "bf16_dot") == (request.param == "bf16_dot")
    yield request.param
    mx.set_fast_path(True)
    mx.set_bf16_dot(True)


def _expect_path(path: str, x: torch.Tensor, scale: torch.Tensor | None = None) -> str:
    """The loop `mx.linear` takes for x (and the weight's scales) under the fixture's `path`."""
    M, K = x.shape
    bf16_dot = path == "bf16_dot" and x.dtype == torch.bfloat16 and K % 64 == 0
    if bf16_dot and M <= mx.DECODE_BF16_MAX_ROWS:
        return "bf16_dot"  # the bf16-dot decode loop takes up to 12 rows (passes of 8)
    if M > 8:
        # the bf16 tile dequantizes to bf16 for scale bytes 64..246 (mxfp8_gemm.c, BF16_SAFE_*)
        safe = scale is None or bool(((scale.view(torch.uint8) >= 64) & (scale.view(torch.uint8) <= 246)).all())
        return "bf16_tile" if bf16_dot and safe else "tile"
    if path == "bf16_dot" and not bf16_dot:
        path = "avx2"  # the bf16-dot loop takes bf16 x with K a multiple of 64 only
    if path == "avx2":
        return "avx2_placed"  # up to 8 x rows (batch-invariant switch off): the placed-bits loop
    return path


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, every NaN mapped to one value (payloads are not part of the format)."""
    b = t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).clone()
    b[torch.isnan(t)] = -1
    return b


def _all_bytes() -> tuple[torch.Tensor, torch.Tensor]:
    """Every E4M3 byte under every E8M0 byte: 256 rows (one per scale byte) of 256 elements (8 blocks)."""
    data = torch.arange(256, dtype=torch.uint8).repeat(256, 1)
    scale = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 8)
    return data.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_every_byte_bit_exact(path: str, dtype: torch.dtype) -> None:
    data, scale = _all_bytes()
    got, ref = mx.dequantize(data, scale, dtype), dequantize_mxfp8(data, scale, 32, dtype)
    assert torch.equal(_bits(got), _bits(ref))
    # the reference's own two paths agree (bit path for scale bytes <= 134, fp32 path above)
    low = (slice(0, 135), slice(None))
    no_nan = (data.view(torch.uint8)[low] & 0x7F) != 0x7F
    assert torch.equal(_bits(got[low])[no_nan], _bits(dequantize_mxfp8(data[low], scale[low][:, :], 32, dtype))[no_nan])


@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_quantized_weights_bit_exact(path: str, mode: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 37, 320, generator=g) * torch.logspace(-30, 30, 37)[None, :, None]
    data, scale = quantize_mxfp8(w, 32, mode)
    assert torch.equal(_bits(mx.dequantize(data, scale, dtype)), _bits(dequantize_mxfp8(data, scale, 32, dtype)))


def _gemm_case(M: int, N: int, K: int, x_dtype: torch.dtype, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    data, scale = quantize_mxfp8(w)
    x = torch.randn(M, K, generator=g).to(x_dtype)
    b = torch.randn(N, generator=g) if bias else None
    return x, data, scale, b


def _check_gemm(x, data, scale, b, y) -> None:
    wd = dequantize_mxfp8(data, scale, 32, F64)
    xd = x.to(F64)
    ref = xd @ wd.T + (b.to(F64) if b is not None else 0)
    K = x.shape[1]
    # fp32 accumulation: |error| <= gamma_K * sum |x||w| (+ the bias add and the final rounding)
    gamma = (K + 2) * 2.0**-24 / (1 - (K + 2) * 2.0**-24)
    bound = gamma * (xd.abs() @ wd.abs().T + (b.to(F64).abs() if b is not None else 0))
    if y.dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2.0**-8  # the output's own rounding
    err = (y.to(F64) - ref).abs()
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item():.3g}"


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 17, 33, 70])  # decode loops up to 8 / 12, tile loops above
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_gemm_within_fp32_accumulation_error(path: str, M: int, x_dtype: torch.dtype) -> None:
    for N, K, bias in ((37, 96, True), (16, 1024, False), (5, 32, True), (7, 192, True), (130, 128, True)):
        x, data, scale, b = _gemm_case(M, N, K, x_dtype, bias, seed=M * 100 + N)
        for out in (None, torch.empty(M, N)):  # y in x's dtype, and fp32 (no output rounding)
            _check_gemm(x, data, scale, b, mx.linear(x, data, scale, b, out=out))
            assert mx.last_linear_path() == _expect_path(path, x, scale)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 6, 12, 20])
@pytest.mark.parametrize("scale_bytes,x_scale", [((0, 1, 2, 10), 2.0**60), ((200, 246, 247, 254), 2.0**-30),
                                                 ((63, 64, 245, 246), 1.0), ((64, 65, 245, 246), 1.0)])  # the bf16 tile's edges
def test_gemm_extreme_block_scales(path: str, M: int, scale_bytes: tuple[int, ...], x_scale: float,
                                   x_dtype: torch.dtype) -> None:
    """Raw bytes with the smallest scales (2^-127: subnormal fp32 weights) and the largest (bytes
    above 246 take the factor split in two), x scaled so every product stays a normal fp32."""
    g = torch.Generator().manual_seed(M)
    N, K = 9, 64
    data = torch.randint(0, 0x30, (N, K), generator=g, dtype=torch.uint8) | (torch.randint(0, 2, (N, K), generator=g, dtype=torch.uint8) << 7)
    scale = torch.tensor(scale_bytes, dtype=torch.uint8).repeat(N // len(scale_bytes) + 1)[:N, None].repeat(1, K // 32)
    data, scale = data.view(torch.float8_e4m3fn), scale.contiguous().view(torch.float8_e8m0fnu)
    x = (torch.randn(M, K, generator=g) * x_scale).to(x_dtype)
    _check_gemm(x, data, scale, None, mx.linear(x, data, scale, out=torch.empty(M, N)))
    assert mx.last_linear_path() == _expect_path(path, x, scale)


def test_bf16_dot_every_element_byte(path: str) -> None:
    """Every E4M3 byte (the NaN byte 0x7F / 0xFF excepted) against every bf16 x lane position, so
    the byte lookups, the sign and the word order of the bf16-dot loop are each checked."""
    data = torch.arange(256, dtype=torch.uint8)
    data = data[(data & 0x7F) != 0x7F]
    K = 256
    data = torch.cat([data, data[: K - data.numel()]]).reshape(1, K)
    data = torch.cat([data, data.roll(1, 1), data.roll(37, 1)])  # each byte at three positions
    scale = torch.tensor([[127, 120, 130, 127, 127, 1, 127, 200]], dtype=torch.uint8).repeat(3, 1)
    data, scale = data.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu)
    g = torch.Generator().manual_seed(5)
    for trial in range(4):
        x = torch.zeros(1, K, dtype=torch.bfloat16)
        x[0, torch.randint(0, K, (1,), generator=g)] = 1.0  # one lane: y is exactly that weight
        if trial == 3:
            x = torch.randn(1, K, generator=g).bfloat16()
        y = mx.linear(x, data, scale, out=torch.empty(1, 3))
        assert mx.last_linear_path() == _expect_path(path, x)
        _check_gemm(x, data, scale, None, y)
        if trial < 3:  # a single product: exact
            assert torch.equal(y.double(), x.double() @ dequantize_mxfp8(data, scale, 32, F64).T)


@pytest.fixture
def gfni():
    """The bf16-dot loop with its GFNI decode on (yielded: a function to switch it)."""
    if not mx.bf16_dot_available() or not mx.set_gfni_decode(True):
        pytest.skip("library not built for AVX512-BF16 + VBMI + GFNI (this CPU lacks them)")
    mx.set_fast_path(True)
    mx.set_bf16_dot(True)
    yield mx.set_gfni_decode
    mx.set_gfni_decode(True)


def test_gfni_decode_every_normal_byte(gfni) -> None:
    """Chunks whose bytes all have a non-zero exponent field are decoded by bit arithmetic at
    element * 256 (mxfp8.h, mx_decode64_bf16_x256) with factors 2^(b - 135): each such byte at
    several lanes, under scale bytes that make the factor a denormal (0 .. 8) or not, must give the
    exact single product, as the table path does."""
    data = torch.arange(256, dtype=torch.uint8)
    data = data[((data & 0x78) != 0) & ((data & 0x7F) != 0x7F)]  # 238 normal bytes
    K = 256
    row = torch.cat([data, data[: K - data.numel()]])
    data = torch.stack([row, row.roll(1), row.roll(37), row.roll(64)])
    scale = torch.tensor([[127, 0, 8, 9, 1, 200, 246, 130]], dtype=torch.uint8).repeat(4, 1)
    data, scale = data.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu)
    ref = dequantize_mxfp8(data, scale, 32, F64)
    for lane in (0, 5, 31, 32, 63, 64, 100, 191, 255):
        x = torch.zeros(1, K, dtype=torch.bfloat16)
        x[0, lane] = 1.0
        y = mx.linear(x, data, scale, out=torch.empty(1, 4))
        assert mx.last_linear_path() == "bf16_dot"
        assert torch.equal(y.double(), x.double() @ ref.T), lane


@pytest.mark.parametrize("M", [1, 2, 5, 8, 12, 13, 40])
def test_gfni_and_table_decode_give_the_same_bits(gfni, M: int) -> None:
    """Quantized weights (some chunks holding a zero or subnormal element, which fall back to the
    table, most not), ragged N (the batch-1 loop's groups of 16 rows, the tile loop's panels of
    64): the GFNI decode and the table lookups give bit-identical outputs, both within fp32
    accumulation error, on the decode loop (M <= 12) and the bf16 tile loop (more rows)."""
    g = torch.Generator().manual_seed(M)
    N, K = 150, 512
    w = torch.randn(N, K, generator=g) * 0.05
    w[3, 70] = 0.0
    w[7, 200] = w[7, 192:224].abs().max() * 2.0**-12  # a subnormal element
    data, scale = quantize_mxfp8(w)
    assert ((data.view(torch.uint8) & 0x78) == 0).any()
    x = torch.randn(M, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g)
    outs = []
    for on in (True, False):
        assert gfni(on) == on
        outs.append(mx.linear(x, data, scale, b, out=torch.empty(M, N)))
        assert mx.last_linear_path() == ("bf16_dot" if M <= 12 else "bf16_tile")
        _check_gemm(x, data, scale, b, outs[-1])
    assert torch.equal(outs[0], outs[1])


@pytest.fixture
def avx2_loops():
    """The AVX2 loops with the bf16-dot loop off (placed loops on), restored afterwards."""
    if not mx.fast_path_available():
        pytest.skip("CPU lacks AVX2/FMA/F16C")
    mx.set_fast_path(True)
    mx.set_bf16_dot(False)
    yield
    mx.set_placed_loops(True)
    mx.set_bf16_dot(True)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_placed_loop(avx2_loops: None, x_dtype: torch.dtype) -> None:
    """The AVX2 placed loop at 1..8 x rows (elements placed as fp32 bits, block sums times 2^(b - 7 - k)
    with x scaled by 2^k): rows mixing scale bytes it takes (<= 134) and ones it hands to
    mx_dequant_block (135..254), zero and subnormal elements, ragged N; within fp32 accumulation
    error as the M-row loop is; not taken under the batch-invariant switch, where one row gives the
    bits it gets among others."""
    from cuttle.attention.native import invariance

    g = torch.Generator().manual_seed(11)
    N, K = 45, 320
    w = torch.randn(N, K, generator=g) * 0.05
    w[:, 64:96] *= 2.0**40  # scale bytes above 134 in every row's third block
    w[2, 10] = 0.0
    w[5, 33] = w[5, 32:64].abs().max() * 2.0**-12  # a subnormal element
    data, scale = quantize_mxfp8(w)
    sb = scale.view(torch.uint8)
    assert (sb[:, 2] > 134).all() and (sb[:, 0] <= 134).all()
    assert ((data.view(torch.uint8) & 0x78) == 0).any()
    x = torch.randn(8, K, generator=g).to(x_dtype)
    b = torch.randn(N, generator=g)
    for M in (1, 2, 3, 4, 5, 8):
        y = mx.linear(x[:M], data, scale, b, out=torch.empty(M, N))
        assert mx.last_linear_path() == "avx2_placed"
        _check_gemm(x[:M], data, scale, b, y)
    # without the 2^40 block (which swamps the rest) the two loops' summation orders show
    plain = quantize_mxfp8(torch.randn(N, K, generator=g) * 0.05)
    placed = mx.linear(x[:3], *plain, b, out=torch.empty(3, N))
    assert mx.set_placed_loops(False) is False
    rows = mx.linear(x[:1], data, scale, b, out=torch.empty(1, N))
    assert mx.last_linear_path() == "avx2"
    _check_gemm(x[:1], data, scale, b, rows)
    three_rows = mx.linear(x[:3], *plain, b, out=torch.empty(3, N))
    assert mx.last_linear_path() == "avx2"
    _check_gemm(x[:3], *plain, b, three_rows)
    assert not torch.equal(placed, three_rows)  # the placed loop ran: another summation order
    assert mx.set_placed_loops(True) is True
    with invariance.batch_invariant():
        one = mx.linear(x[:1], data, scale, b, out=torch.empty(1, N))
        assert mx.last_linear_path() == "avx2"
        among = mx.linear(x[:3], data, scale, b, out=torch.empty(3, N))
    assert torch.equal(one, among[:1]) and torch.equal(one, rows)


def test_placed_loop_scales_x_exactly(avx2_loops: None) -> None:
    """The placed loop scales x by 2^k (k from max |x|, clamped to 0..119) so that its products with
    the placed elements (2^-129 .. 2^-111) stay normal fp32: a term 2^-90 below max |x| comes out
    exact, x near fp32's top (k = 0) and far down (k = 119) within fp32 accumulation error, zero x
    gives zeros, inf / NaN in x give what the M-row loop gives, and a NaN in one row does not
    decide k for the others."""
    g = torch.Generator().manual_seed(5)
    N, K = 9, 128
    w = torch.randn(N, K, generator=g)
    w[:, 0] = 0.0
    w[3, 70] = w[3, 64:96].abs().max() * 2.0**-12  # a subnormal element times a tiny x
    data, scale = quantize_mxfp8(w)
    wq = dequantize_mxfp8(data, scale, 32, F64)
    x = torch.zeros(2, K)
    x[:, 0] = 1.0  # max |x| = 1 (k = 100), against zero weights
    x[0, 70] = 2.0**-90
    x[1, 70] = -(2.0**-95)
    y = mx.linear(x, data, scale, out=torch.empty(2, N))
    assert mx.last_linear_path() == "avx2_placed"
    assert torch.equal(y.to(F64), x.to(F64) @ wq.T)  # one nonzero term a row: exact
    for top in (2.0**120, 2.0**40, 2.0**-100):  # k = 0 (clamped), ~58, 119 (clamped)
        xs = torch.randn(3, K, generator=g) * top
        _check_gemm(xs, data, scale, None, mx.linear(xs, data, scale, out=torch.empty(3, N)))
        assert mx.last_linear_path() == "avx2_placed"
    assert torch.equal(mx.linear(torch.zeros(2, K), data, scale, out=torch.empty(2, N)), torch.zeros(2, N))
    bad = torch.randn(3, K, generator=g)
    bad[0, 5], bad[2, 40] = float("inf"), float("nan")
    got = mx.linear(bad, data, scale, out=torch.empty(3, N))
    assert mx.set_placed_loops(False) is False
    want = mx.linear(bad, data, scale, out=torch.empty(3, N))
    assert got.isnan().any() and got.isinf().any()
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-5, atol=1e-5)
    # a NaN in one row leaves k to the others: a row near fp32's top beside it stays finite
    assert mx.set_placed_loops(True) is True
    mixed = torch.randn(3, K, generator=g)
    mixed[0] *= 2.0**120
    mixed[1, 5] = float("nan")
    y = mx.linear(mixed, data, scale, out=torch.empty(3, N))
    assert mx.last_linear_path() == "avx2_placed"
    _check_gemm(mixed[0::2], data, scale, None, y[0::2])
    assert y[1].isnan().all()


def test_gemm_strided_x_and_out_buffer(path: str) -> None:
    x, data, scale, b = _gemm_case(3, 40, 128, torch.float32, True, seed=3)
    wide = torch.zeros(3, 200)
    wide[:, 50:178] = x
    out = torch.empty(3, 40, dtype=torch.bfloat16)
    y = mx.linear(wide[:, 50:178], data, scale, b, out=out)
    assert y is out
    _check_gemm(x, data, scale, b, y)


def test_nan_scale_block_gives_nan_rows() -> None:
    w = torch.randn(4, 64)
    w[1, 40] = float("nan")
    data, scale = quantize_mxfp8(w)
    y = mx.linear(torch.ones(2, 64), data, scale)
    assert torch.isnan(y[:, 1]).all() and torch.isfinite(y[:, [0, 2, 3]]).all()


def test_k_not_multiple_of_32_is_refused() -> None:
    data = torch.zeros(4, 48, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.zeros(4, 1, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match="K = 48 is not a multiple of the block size 32"):
        mx.linear(torch.zeros(1, 48), data, scale)
    with pytest.raises(ValueError, match="K = 48"):
        mx.dequantize(data, scale)


def test_bad_arguments_name_the_field() -> None:
    data, scale = quantize_mxfp8(torch.randn(8, 64))
    with pytest.raises(ValueError, match=r"x has shape \(1, 32\)"):
        mx.linear(torch.zeros(1, 32), data, scale)
    with pytest.raises(ValueError, match="scale has shape"):
        mx.linear(torch.zeros(1, 64), data, scale[:, :1].contiguous())
    with pytest.raises(ValueError, match="bias has shape"):
        mx.linear(torch.zeros(1, 64), data, scale, torch.zeros(7))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        mx.linear(torch.zeros(1, 64), data.view(torch.uint8), scale)


def test_nan_element_bytes_outside_nan_blocks_are_refused() -> None:
    data, scale = quantize_mxfp8(torch.randn(2, 64))
    mx.check_nan_elements(data, scale)  # what the quantizer writes passes
    bad = data.clone()
    bad.view(torch.uint8)[0, 3] = 0x7F
    with pytest.raises(ValueError, match="NaN bytes in blocks with a finite scale"):
        mx.check_nan_elements(bad, scale)
    assert torch.isnan(mx.dequantize(bad, scale)[0, 3])  # the dequantize kernel decodes it as NaN
