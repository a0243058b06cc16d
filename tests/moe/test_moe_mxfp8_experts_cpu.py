"""MXFP8 routed experts on the native expert kernel (csrc/moe_experts.c's MXFP8 panels, decoded
with csrc/mxfp8.h) against the torch expert path on the same MXFP8 weights (dequantize, then
matmul): fp32 within accumulation rounding, bf16 within bf16 rounding, AVX2 and scalar routes;
experts with no token, one token and every token; after a re-quantization (weight update); the
layer takes the native path only where it applies."""
from __future__ import annotations

import pytest
import torch

from cuttle.attention.native import moe as native_moe
from cuttle.attention.native import mxfp8 as native_mx
from cuttle.moe import FusedMoE, RoutingConfig
from cuttle.moe.experts_native import supports_mxfp8
from cuttle.moe.experts_torch import fused_experts_torch
from cuttle.moe.routing import route, router_logits

pytestmark = pytest.mark.skipif(not native_mx.available(), reason="native CPU kernel library not built")


@pytest.fixture(params=["avx2", "scalar"])
def path(request):
    if request.param == "avx2" and not native_mx.fast_path_available():
        pytest.skip("CPU lacks AVX2/FMA/F16C")
    native_mx.set_fast_path(request.param == "avx2")
    yield request.param
    native_mx.set_fast_path(True)


def _native(x, w13, w2, weights, ids):
    return native_moe.experts_mxfp8(x, (w13.data, w13.scale), (w2.data, w2.scale), weights, ids)


def _layer(dtype: torch.dtype, E: int = 8, H: int = 64, I: int = 96, k: int = 2, seed: int = 0, edit=None) -> FusedMoE:
    """A Qwen3-MoE layer with random experts quantized to MXFP8 (`edit(layer)` first changes the
    weights in place)."""
    routing = RoutingConfig.from_hf({"model_type": "qwen3_moe", "num_experts": E, "num_experts_per_tok": k,
                                     "norm_topk_prob": True})
    layer = FusedMoE(H, I, routing, dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.gate_weight.copy_(torch.randn(E, H, generator=g))
        layer.w13.copy_(torch.randn(E, 2 * I, H, generator=g) * 0.1)
        layer.w2.copy_(torch.randn(E, H, I, generator=g) * 0.1)
        if edit is not None:
            edit(layer)
    layer.quantize_("mxfp8")
    return layer


def _both(layer: FusedMoE, x: torch.Tensor, ids: torch.Tensor | None = None):
    if ids is None:
        weights, ids = route(router_logits(x, layer.gate_weight, layer.routing), layer.routing)
    else:
        weights = torch.full(ids.shape, 1.0 / ids.shape[1])
    w13, w2 = layer.expert_weights()
    assert supports_mxfp8(x, layer.gate_weight, w13, w2)
    return _native(x, w13, w2, weights, ids), fused_experts_torch(x, w13, w2, weights, ids)


@pytest.mark.parametrize("T", [1, 3, 17])
def test_fp32_equals_torch_path(path: str, T: int) -> None:
    layer = _layer(torch.float32)
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(T))
    got, ref = _both(layer, x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_bf16_within_bf16_rounding(path: str) -> None:
    layer = _layer(torch.bfloat16)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    got, ref = _both(layer, x)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2 * 2.0**-8, atol=2e-3)


def test_no_token_one_token_every_token(path: str) -> None:
    layer = _layer(torch.float32, E=4)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(2))
    # expert 0: every token, expert 1: one token, experts 2 and 3: none
    ids = torch.tensor([[0, 1]] + [[0, 0]] * 5, dtype=torch.int64)
    got, ref = _both(layer, x, ids)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_one_row_tile(path: str) -> None:
    """An expert with one token takes the one-row MXFP8 tile (elements placed as fp32 bits, mxfp8.h)
    where the AVX2 route runs: blocks with scale bytes above 134 (the block-sum route inside it),
    zero and subnormal elements, fp32 within accumulation rounding of the torch path and of the
    M-row tile (mxfp8.set_placed_loops(False)); under the batch-invariant switch (no one-row tile)
    the bits it gets among other tokens."""
    from cuttle.attention.native import invariance

    def edit(layer: FusedMoE) -> None:
        layer.w13[:, :, 32:64] *= 2.0**40  # scale bytes > 134 in the second block of every w13 row
        layer.w2[1, :, 64:96] *= 2.0**-40
        layer.w13[0, 5, 3] = 0.0
        layer.w13[0, 6, 4] = layer.w13[0, 6, :32].abs().max() * 2.0**-12  # a subnormal element

    layer = _layer(torch.float32, E=4, edit=edit)
    w13, w2 = layer.expert_weights()
    assert (w13.scale.view(torch.uint8)[:, :, 1] > 134).all()
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(4))
    ids = torch.tensor([[0, 1]], dtype=torch.int64)
    weights = torch.tensor([[0.25, 0.75]])
    ref = fused_experts_torch(x, w13, w2, weights, ids)
    one = _native(x, w13, w2, weights, ids)
    torch.testing.assert_close(one, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    try:
        assert native_mx.set_placed_loops(False) is False
        rows = _native(x, w13, w2, weights, ids)
    finally:
        native_mx.set_placed_loops(True)
    torch.testing.assert_close(rows, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    if path == "avx2":
        assert not torch.equal(one, rows)  # the one-row tile ran: another summation order
    with invariance.batch_invariant():
        alone = _native(x, w13, w2, weights, ids)
        among = _native(torch.cat([x, torch.randn(3, 64)]), w13, w2, weights.repeat(4, 1), ids.repeat(4, 1))
    assert torch.equal(alone, among[:1])


@pytest.mark.parametrize("scale", [2.0**40, 2.0**-100, 0.0, "nan", "inf", "spread"])
def test_one_row_tile_scales_x(scale) -> None:
    """The one-row tile sums blocks of placed elements against x (and h) scaled by 2^k, k from the
    row's max |x| (mxfp8.h, mx_placed_shift): rows far from 1, zero, with a NaN or an inf, and with
    half the entries 2^-60 below the rest give what the M-row tile gives (fp32 within accumulation
    rounding; NaN and inf where it has them). The shift itself is checked exactly on the dense
    loop (test_moe_mxfp8_cpu.py, test_placed_loop_scales_x_exactly), which shares it."""
    if not native_mx.fast_path_available():
        pytest.skip("CPU lacks AVX2/FMA/F16C")
    layer = _layer(torch.float32, E=4)
    w13, w2 = layer.expert_weights()
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(5))
    if scale == "nan":
        x[0, 7] = float("nan")
    elif scale == "inf":
        x[0, 9] = float("inf")
    elif scale == "spread":
        x[0, :32] *= 2.0**-60  # terms far below the row's max, which alone sets k
    else:
        x = x * scale
    ids, weights = torch.tensor([[0, 1]], dtype=torch.int64), torch.tensor([[0.25, 0.75]])
    one = _native(x, w13, w2, weights, ids)
    try:
        native_mx.set_placed_loops(False)
        rows = _native(x, w13, w2, weights, ids)
    finally:
        native_mx.set_placed_loops(True)
    assert not torch.equal(one, rows) or scale in (0.0, 2.0**-100, "nan", "inf")  # (another order where finite)
    finite = rows.isfinite()
    assert torch.equal(finite, one.isfinite()) and torch.equal(rows.isnan(), one.isnan())
    assert torch.equal(one[~finite], rows[~finite]) or rows[~finite].isnan().all()
    torch.testing.assert_close(one[finite], rows[finite], rtol=1e-5, atol=1e-5 * rows[finite].abs().max().item()
                               if finite.any() else 0.0)


def test_layer_forward_takes_it_and_follows_weight_updates() -> None:
    layer = _layer(torch.float32)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    weights, ids = route(router_logits(x, layer.gate_weight, layer.routing), layer.routing)
    w13, w2 = layer.expert_weights()
    torch.testing.assert_close(layer(x), fused_experts_torch(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    # a re-quantized update written in place (as the loader does) is what the next call reads
    other = _layer(torch.float32, seed=9)
    layer.w13_mx.copy_(other.w13_mx)
    layer.w13_scale.copy_(other.w13_scale)
    w13, w2 = layer.expert_weights()
    torch.testing.assert_close(layer(x), fused_experts_torch(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    # autograd stays on the torch path (activation quantization too: FusedMoE checks act_quant)
    assert not supports_mxfp8(x.requires_grad_(), layer.gate_weight, w13, w2)


def test_nan_bytes_in_finite_blocks_refused_once_written() -> None:
    layer = _layer(torch.float32)
    x = torch.randn(2, 64)
    layer(x)
    layer.w2_mx.view(torch.uint8)[0, 0, 0] = 0x7F  # an in-place write bumps the version: checked again
    with pytest.raises(ValueError, match="NaN bytes in blocks with a finite scale"):
        _native(x, *layer.expert_weights(), torch.ones(2, 2) / 2, torch.zeros(2, 2, dtype=torch.int64))


@pytest.fixture(params=["dot", "panels"])
def bf16_layout(request):
    """MXFP8 experts on bf16 activations in the bf16-dot layout (W_MXFP8_DOT, where the library
    has AVX512-BF16 + VBMI) or the MXFP8 panels of the fp32 tiles (W_MXFP8)."""
    dot = request.param == "dot"
    native_moe.set_bf16_dot(dot)
    if dot and not native_moe._lib(record=False).moe_mx_dot_available():
        native_moe.set_bf16_dot(True)
        pytest.skip("library built without AVX512-BF16 + VBMI (this CPU lacks them)")
    yield request.param
    native_moe.set_bf16_dot(True)


def _expect_layout(layer: FusedMoE, layout: str) -> None:
    w13, w2 = layer.expert_weights()
    fmt = native_moe.mx_format(torch.bfloat16, w13.scale, w2.scale)
    assert fmt == (native_moe.W_MXFP8_DOT if layout == "dot" else native_moe.W_MXFP8)


@pytest.mark.parametrize("T", [1, 5, 40])
def test_bf16_layouts_within_bf16_rounding(bf16_layout: str, T: int) -> None:
    # H = 96: the second 64-output w2 panel is half padding; 40 tokens over 8 experts: several row tiles
    layer = _layer(torch.bfloat16, H=96, I=64)
    _expect_layout(layer, bf16_layout)
    x = torch.randn(T, 96, generator=torch.Generator().manual_seed(T)).bfloat16()
    got, ref = _both(layer, x)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2 * 2.0**-8, atol=2e-3)
    assert (got != ref).float().mean() < 0.05  # the same roundings: only summation order differs


def test_bf16_layouts_no_token_one_token_every_token(bf16_layout: str) -> None:
    layer = _layer(torch.bfloat16, E=4)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    ids = torch.tensor([[0, 1]] + [[0, 0]] * 5, dtype=torch.int64)
    got, ref = _both(layer, x, ids)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2 * 2.0**-8, atol=2e-3)


@pytest.mark.parametrize("scale_byte", [63, 247, 255])
def test_bf16_scales_outside_the_exact_range_keep_the_fp32_panels(scale_byte: int) -> None:
    """One block scale outside mxfp8.h's safe range (the scaled weights would not all be exact
    bf16, or NaN): the experts are packed for the fp32 tiles and still equal the torch path."""
    if not native_moe._lib(record=False).moe_mx_dot_available():
        pytest.skip("library built without AVX512-BF16 + VBMI (this CPU lacks them)")
    layer = _layer(torch.bfloat16, E=4)
    _expect_layout(layer, "dot")
    layer.w2_scale.view(torch.uint8)[1, 3, 0] = scale_byte
    if scale_byte == 247:  # a huge block, kept finite: one element 2^-6 (x 2^120), the rest zero
        layer.w2_mx.view(torch.uint8)[1, 3, :32] = 0
        layer.w2_mx.view(torch.uint8)[1, 3, 5] = 0x08
    _expect_layout(layer, "panels")
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    ids = torch.tensor([[1, 0]] * 7, dtype=torch.int64)
    got, ref = _both(layer, x, ids)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2 * 2.0**-8, atol=2e-3, equal_nan=True)
    if scale_byte == 255:  # output 3 of expert 1 is NaN in every row (its block's scale is)
        assert got[:, 3].isnan().all() and not got[:, 4].isnan().any()


@pytest.mark.parametrize("T", [1, 3, 40])  # the in-register tile (<= 4 rows an expert) and the dequantized panel
def test_dot_layout_gfni_and_table_decode_give_the_same_bits(T: int) -> None:
    """In the W_MXFP8_DOT layout, 64 bytes without a zero or subnormal element are decoded by the
    affine ops at element * 256 and take the exponent add less 8 (mxfp8.h); the others the table:
    both give the same words, so the outputs are bit-identical, and equal the torch path."""
    if not native_moe._lib(record=False).moe_mx_dot_available() or not native_mx.set_gfni_decode(True):
        pytest.skip("library built without AVX512-BF16 + VBMI + GFNI (this CPU lacks them)")
    layer = _layer(torch.bfloat16, E=4, H=128, I=64)
    _expect_layout(layer, "dot")
    w13 = layer.w13_mx.view(torch.uint8)
    w13[0, :5, :7] = 0x00  # zeros and subnormals in some chunks (those take the table)
    w13[1, 3:9, 40:44] = 0x03
    x = torch.randn(T, 128, generator=torch.Generator().manual_seed(T)).bfloat16()
    ids = torch.tensor([[0, 1], [1, 2], [3, 0]] * T, dtype=torch.int64)[:T]
    try:
        outs = []
        for on in (True, False):
            assert native_mx.set_gfni_decode(on) == on
            got, ref = _both(layer, x, ids)
            torch.testing.assert_close(got.float(), ref.float(), rtol=2 * 2.0**-8, atol=2e-3)
            outs.append(got)
    finally:
        native_mx.set_gfni_decode(True)
    assert torch.equal(outs[0], outs[1])
