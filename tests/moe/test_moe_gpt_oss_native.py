"""gpt-oss's experts on the native path (`moe_experts_ep`: biases after both GEMMs and the clamped
SwiGLU in the kernel's epilogues, the router's bias before routing) against the torch expert
path: fp32 (<= 1e-5), bf16 (within bf16 rounding), MXFP8 experts, experts with no / one / every
token, small and decode-sized batches, both sides of both clamps, and the refusals."""
from __future__ import annotations

import os

import pytest
import torch

from cuttle.attention.native import moe as native_moe
from cuttle.moe import FusedMoE, RoutingConfig, route
from cuttle.moe import layer as layer_mod
from cuttle.moe.experts_torch import ClampedSwiGLU, fused_experts_torch
from cuttle.moe.routing import router_logits

if os.environ.get("CUTTLE_CPU_KERNELS", "1") == "0" or os.environ.get("CUTTLE_MOE_NATIVE", "1") == "0":
    pytest.skip("CUTTLE_CPU_KERNELS=0 / CUTTLE_MOE_NATIVE=0: the native MoE path is switched off in this run",
                allow_module_level=True)

ROUTING = {"model_type": "gpt_oss", "num_local_experts": 8, "num_experts_per_tok": 3}


@pytest.fixture(autouse=True)
def _library_loaded() -> None:
    assert native_moe.available(), "the CPU kernel library did not build or load (see the log)"


def _layer(dtype: torch.dtype, H: int = 64, I: int = 64, limit: float = 0.5, seed: int = 0) -> FusedMoE:
    layer = FusedMoE(H, I, RoutingConfig.from_hf(ROUTING), dtype, bias=True, activation=ClampedSwiGLU(1.702, limit))
    g = torch.Generator().manual_seed(seed)
    for p in (layer.gate_weight, layer.w13, layer.w2):
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.15)
    for b in (layer.gate_bias, layer.w13_bias, layer.w2_bias):
        b.data.copy_(torch.randn(b.shape, generator=g) * 0.3)
    return layer


def _torch_path(layer: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    weights, ids = route(router_logits(x, layer.gate_weight, layer.routing, layer.gate_bias), layer.routing)
    w13, w2 = layer.expert_weights()
    return fused_experts_torch(x, w13, w2, weights, ids, b13=layer.w13_bias, b2=layer.w2_bias, activation=layer.activation)


@pytest.fixture
def native_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer's forward must not fall back to the torch path."""
    def refuse(*args, **kwargs):
        raise AssertionError("FusedMoE.forward took the torch expert path")

    monkeypatch.setattr(layer_mod, "fused_experts_torch", refuse)


def _bf16_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    # the same roundings as torch's bf16 ops; fp32 summation order (and the exp) can move an
    # intermediate across a bf16 rounding boundary: a couple of bf16 ulps
    torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=2 ** -7 * float(ref.abs().max()))


@pytest.mark.parametrize("T", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_native_equals_torch(T: int, dtype: torch.dtype) -> None:
    layer = _layer(dtype)
    x = (torch.randn(T, 64, generator=torch.Generator().manual_seed(T)) * 2).to(dtype)
    ref = _torch_path(layer, x)
    assert layer.pack_() and layer.packed.fmt in (native_moe.W_F32, native_moe.W_BF16)  # widening layouts
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layer_mod, "fused_experts_torch", lambda *a, **k: (_ for _ in ()).throw(AssertionError("torch path")))
        out = layer(x)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        _bf16_close(out, ref)


def test_both_clamps_are_taken() -> None:
    """The inputs reach past the limit on both sides, so a kernel that skipped a clamp would differ."""
    layer = _layer(torch.float32, limit=0.5)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)) * 2
    weights, ids = route(router_logits(x, layer.gate_weight, layer.routing, layer.gate_bias), layer.routing)
    gate_up = torch.einsum("th,eih->tei", x, layer.w13) + layer.w13_bias
    gate, up = gate_up.chunk(2, dim=-1)
    assert bool((gate > 0.5).any()) and bool((up < -0.5).any()) and bool((up > 0.5).any())
    layer.pack_()
    torch.testing.assert_close(layer(x), _torch_path(layer, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_with_no_one_and_every_token(dtype: torch.dtype) -> None:
    T, H, I, E, k = 9, 64, 32, 6, 2
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.15).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.15).to(dtype)
    b13, b2 = (torch.randn(E, 2 * I, generator=g) * 0.3).to(dtype), (torch.randn(E, H, generator=g) * 0.3).to(dtype)
    ids = torch.zeros(T, k, dtype=torch.int64)  # expert 0: every token
    ids[:, 1] = 2
    ids[4, 1] = 5  # expert 5: one token; 1, 3: none; 2: all but one
    weights = torch.rand(T, k, generator=g)
    act = ClampedSwiGLU(1.702, 0.4)
    packed = native_moe.pack(w13, w2, dot=False)
    out = native_moe.experts_packed(x, packed, weights, ids, native_moe.Epilogue(b13, b2, (act.alpha, act.limit)))
    ref = fused_experts_torch(x, w13, w2, weights, ids, b13=b13, b2=b2, activation=act)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        _bf16_close(out, ref)
    # biases of an expert that receives no token change nothing
    b13b, b2b = b13.clone(), b2.clone()
    b13b[[1, 3]], b2b[[1, 3]] = 5.0, -5.0
    assert torch.equal(native_moe.experts_packed(x, packed, weights, ids, native_moe.Epilogue(b13b, b2b, (act.alpha, act.limit))), out)


@pytest.mark.parametrize("T", [1, 5, 40])
def test_mxfp8_experts_native_equals_torch(T: int, native_only: None) -> None:
    layer = _layer(torch.float32)
    layer.quantize_("mxfp8")
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(2))
    w13, w2 = layer.expert_weights()
    weights, ids = route(router_logits(x, layer.gate_weight, layer.routing, layer.gate_bias), layer.routing)
    ref = fused_experts_torch(x, w13, w2, weights, ids, b13=layer.w13_bias, b2=layer.w2_bias, activation=layer.activation)
    assert layer.pack_() and layer.packed.fmt == native_moe.W_MXFP8
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)


def test_biases_only_and_activation_only() -> None:
    """Each epilogue part on its own (the kernel takes them separately)."""
    T, H, I, E = 6, 32, 32, 4
    g = torch.Generator().manual_seed(8)
    x, w13, w2 = torch.randn(T, H, generator=g), torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
    b13, b2 = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    ids, weights = torch.randint(0, E, (T, 2), generator=g), torch.rand(T, 2, generator=g)
    packed = native_moe.pack(w13, w2, dot=False)
    act = ClampedSwiGLU(1.5, 0.7)
    for ep, kw in ((native_moe.Epilogue(b13, None, None), dict(b13=b13)), (native_moe.Epilogue(None, b2, None), dict(b2=b2)),
                   (native_moe.Epilogue(None, None, (1.5, 0.7)), dict(activation=act))):
        torch.testing.assert_close(native_moe.experts_packed(x, packed, weights, ids, ep),
                                   fused_experts_torch(x, w13, w2, weights, ids, **kw), rtol=1e-5, atol=1e-5)


def test_bad_epilogues_are_refused() -> None:
    T, H, I, E = 2, 32, 32, 4
    x, w13, w2 = torch.randn(T, H), torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    ids, weights = torch.zeros(T, 1, dtype=torch.int64), torch.ones(T, 1)
    packed = native_moe.pack(w13, w2, dot=False)
    with pytest.raises(ValueError, match="b13"):
        native_moe.experts_packed(x, packed, weights, ids, native_moe.Epilogue(torch.zeros(E, I), None, None))
    with pytest.raises(ValueError, match="b2"):
        native_moe.experts_packed(x, packed, weights, ids, native_moe.Epilogue(None, torch.zeros(E, H, dtype=torch.bfloat16), None))
    if native_moe.dot_in_use():  # (only where the library has the AVX512-BF16 dot tiles)
        dot = native_moe.pack(w13.bfloat16(), w2.bfloat16())
        with pytest.raises(ValueError, match="widening"):
            native_moe.experts_packed(x.bfloat16(), dot, weights, ids, native_moe.Epilogue(None, None, (1.0, 1.0)))
