"""The native routed-expert path (csrc/moe_experts.c via cuttle.attention.native.moe and
cuttle.moe.experts_native) against the torch expert path, its reference: routing of every family,
the layer in fp32 (<= 1e-5) and bf16 (within bf16 rounding), experts with no / one / every token,
repacking after weight writes, and the refusals."""
from __future__ import annotations

import os

import pytest
import torch

from cuttle.attention.native import gemm
from cuttle.attention.native import moe as native_moe
from cuttle.moe import FusedMoE, RoutingConfig, SharedExpert, route
from cuttle.moe import layer as layer_mod
from cuttle.moe.experts_torch import fused_experts_torch
from cuttle.moe.routing import router_logits

if os.environ.get("CUTTLE_CPU_KERNELS", "1") == "0" or os.environ.get("CUTTLE_MOE_NATIVE", "1") == "0":
    pytest.skip("CUTTLE_CPU_KERNELS=0 / CUTTLE_MOE_NATIVE=0: the native MoE path is switched off in this run",
                allow_module_level=True)


@pytest.fixture(autouse=True)
def _library_loaded() -> None:
    assert native_moe.available(), "the CPU kernel library did not build or load (see the log)"


FAMILIES = {
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": True},
    "qwen2_moe": {"model_type": "qwen2_moe", "num_experts": 12, "num_experts_per_tok": 4},  # no renormalization
    "mixtral": {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2},
    "deepseek_v3": {"model_type": "deepseek_v3", "n_routed_experts": 32, "num_experts_per_tok": 6, "n_group": 8,
                    "topk_group": 3, "routed_scaling_factor": 2.5, "norm_topk_prob": True},
    # DeepSeek-V2's softmax routers: within the groups of highest max score, scaled, not renormalized
    "deepseek_v2": {"model_type": "deepseek_v2", "n_routed_experts": 16, "num_experts_per_tok": 4, "topk_method": "group_limited_greedy",
                    "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5},
    "deepseek_v2_greedy": {"model_type": "deepseek_v2", "n_routed_experts": 12, "num_experts_per_tok": 3,
                           "routed_scaling_factor": 2.0},
}


def _layer(family: str, H: int, I: int, dtype: torch.dtype, seed: int = 0) -> FusedMoE:
    layer = FusedMoE(H, I, RoutingConfig.from_hf(FAMILIES[family]), dtype)
    g = torch.Generator().manual_seed(seed)
    for p in (layer.gate_weight, layer.w13, layer.w2):
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.15)
    if layer.e_score_correction_bias is not None:
        layer.e_score_correction_bias.data.copy_(torch.randn(layer.routing.num_experts, generator=g) * 0.05)
    return layer


def _torch_path(layer: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    weights, ids = route(router_logits(x, layer.gate_weight, layer.routing), layer.routing, layer.e_score_correction_bias)
    return fused_experts_torch(x, layer.w13, layer.w2, weights, ids)


@pytest.fixture
def native_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer's forward must not fall back to the torch path."""
    def refuse(*args, **kwargs):
        raise AssertionError("FusedMoE.forward took the torch expert path")

    monkeypatch.setattr(layer_mod, "fused_experts_torch", refuse)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_native_router_matches_torch(family: str) -> None:
    cfg = RoutingConfig.from_hf(FAMILIES[family])
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(300, cfg.num_experts, generator=g)
    bias = torch.randn(cfg.num_experts, generator=g) * 0.05 if cfg.scoring_func == "sigmoid" else None
    from cuttle.moe.experts_native import route_native

    weights, ids = route_native(logits, cfg, bias)
    ref_w, ref_ids = route(logits, cfg, bias)
    # DeepSeek's top-k is unsorted in torch: compare as sets, weights following their ids
    ids_s, order = ids.sort(dim=-1)
    ref_s, ref_order = ref_ids.sort(dim=-1)
    assert torch.equal(ids_s, ref_s)
    torch.testing.assert_close(weights.gather(1, order), ref_w.gather(1, ref_order), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v2_greedy"])
def test_grouped_scaled_softmax_runs_in_the_kernel(family: str) -> None:
    """DeepSeek-V2's rule is the kernel's own (no hand-off to the torch router, which a decode
    graph could not replay): its result equals the torch router's, groups and scale included."""
    cfg = RoutingConfig.from_hf(FAMILIES[family])
    logits = torch.randn(200, cfg.num_experts, generator=torch.Generator().manual_seed(3)) * 2
    weights, ids, tied = native_moe.route(logits, cfg.top_k, False, cfg.norm_topk_prob, cfg.n_group, cfg.topk_group,
                                          cfg.routed_scaling_factor)
    ref_w, ref_ids = route(logits, cfg)
    rows = torch.ones(200, dtype=torch.bool)
    if tied is not None:
        rows[tied] = False  # (near-ties are the torch router's to break)
    ids_s, order = ids[rows].sort(dim=-1)
    ref_s, ref_order = ref_ids[rows].sort(dim=-1)
    assert torch.equal(ids_s, ref_s) and int(rows.sum()) > 190
    torch.testing.assert_close(weights[rows].gather(1, order), ref_w[rows].gather(1, ref_order), rtol=1e-6, atol=1e-7)
    if cfg.n_group > 1:  # the groups matter: experts of one group only can be picked together with the rule off
        plain_w, plain_ids, _ = native_moe.route(logits, cfg.top_k, False, False, 1, 1, cfg.routed_scaling_factor)
        assert not torch.equal(plain_ids.sort(dim=-1)[0], ids.sort(dim=-1)[0])


def test_native_router_bf16_logits() -> None:
    cfg = RoutingConfig.from_hf(FAMILIES["qwen3_moe"])
    logits = torch.randn(64, cfg.num_experts, generator=torch.Generator().manual_seed(2)).bfloat16()
    from cuttle.moe.experts_native import route_native

    weights, ids = route_native(logits, cfg, None)
    ref_w, ref_ids = route(logits, cfg)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_ties_at_the_cut_are_routed_by_torch(family: str) -> None:
    """Exact ties (common with bf16 logits over many experts) are broken the way torch.topk breaks
    them: the native router flags those rows and hands them to the torch router."""
    from cuttle.moe.experts_native import route_native

    cfg = RoutingConfig.from_hf(FAMILIES[family])
    logits = torch.randn(200, cfg.num_experts, generator=torch.Generator().manual_seed(7)).mul(0.05).bfloat16()
    logits[:5] = 0.25  # whole rows tied
    _, _, tied = native_moe.route(logits, cfg.top_k, cfg.scoring_func == "sigmoid", cfg.norm_topk_prob,
                                  cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
    assert tied is not None and set(range(5)) <= set(tied.tolist())
    weights, ids = route_native(logits, cfg, None)
    ref_w, ref_ids = route(logits, cfg)
    ids_s, order = ids.sort(dim=-1)
    ref_s, ref_order = ref_ids.sort(dim=-1)
    assert torch.equal(ids_s, ref_s)
    torch.testing.assert_close(weights.gather(1, order), ref_w.gather(1, ref_order), rtol=1e-6, atol=1e-7)


def test_a_replayed_step_meeting_a_tie_settles_it_with_torch_and_goes_on() -> None:
    """In a kernel graph (`native.graph`) the router's tie count differs from the capture's 0 when
    a tie appears; the registered handler routes those rows with torch on the graph's tensors, so
    the replay continues with the eager result instead of stopping."""
    from cuttle.attention.native import graph
    from cuttle.moe.experts_native import route_native

    cfg = RoutingConfig.from_hf(FAMILIES["qwen3_moe"])
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, cfg.num_experts, generator=g).mul(0.05).bfloat16()
    with torch.inference_mode():
        with graph.capture() as kg:
            weights, ids = route_native(logits, cfg, None)
        logits[1] = 0.25  # a whole row tied
        logits[2] = torch.randn(cfg.num_experts, generator=g).bfloat16()
        assert kg.replay()
        ref_w, ref_ids = route_native(logits.clone(), cfg, None)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)


def test_a_capture_meeting_a_tie_settles_it_and_its_replays_follow_their_own_ties() -> None:
    """A capture whose router meets a near-tie (frequent at large decode batches: bf16 logits over
    many experts) settles it with torch unrecorded and records "no tie", instead of breaking the
    capture; its replays then equal the eager router with ties in other rows and with none."""
    from cuttle.attention.native import graph
    from cuttle.moe.experts_native import route_native

    cfg = RoutingConfig.from_hf(FAMILIES["qwen3_moe"])
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, cfg.num_experts, generator=g).mul(0.05).bfloat16()
    logits[3] = 0.25  # a whole row tied at capture
    with torch.inference_mode():
        with graph.capture() as kg:
            weights, ids = route_native(logits, cfg, None)
        ref_w, ref_ids = route_native(logits.clone(), cfg, None)  # eager
        assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)  # the capture's own result
        for tied_row in (0, None):  # a tie elsewhere, then none
            logits.copy_(torch.randn(6, cfg.num_experts, generator=g).mul(0.05).bfloat16())
            if tied_row is not None:
                logits[tied_row] = 0.25
            assert kg.replay()
            ref_w, ref_ids = route_native(logits.clone(), cfg, None)
            assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("T", [1, 3, 37])
def test_layer_native_equals_torch_fp32(family: str, T: int, native_only: None) -> None:
    layer = _layer(family, 64, 40, torch.float32)  # I = 40: a partial weight panel
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(T))
    torch.testing.assert_close(layer(x), _torch_path(layer, x), rtol=1e-5, atol=1e-5)


@pytest.fixture(params=["bf16_dot", "widening"])
def bf16_tiles(request):
    """The bf16 expert tiles: the AVX512-BF16 dot tiles (where the library has them) or the
    widening fp32 tiles."""
    dot = request.param == "bf16_dot"
    if native_moe.set_bf16_dot(dot) != dot:
        pytest.skip("library built without AVX512-BF16 (this CPU lacks it)")
    yield request.param
    native_moe.set_bf16_dot(True)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layer_native_equals_torch_bf16(family: str, native_only: None, bf16_tiles: str) -> None:
    layer = _layer(family, 96, 48, torch.bfloat16)
    x = torch.randn(29, 96, generator=torch.Generator().manual_seed(3)).bfloat16()
    out, ref = layer(x), _torch_path(layer, x)
    # the same roundings as the torch bf16 path; only fp32 summation order differs, which can move
    # an intermediate across a bf16 rounding boundary: allow a couple of bf16 ulps, and few of them
    torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=2 ** -7 * float(ref.abs().max()))
    assert (out != ref).float().mean() < 0.05


def test_shared_expert_qwen2_moe(native_only: None) -> None:
    layer = _layer("qwen2_moe", 64, 32, torch.float32)
    shared = SharedExpert(64, 48, torch.float32, gated=True)
    g = torch.Generator().manual_seed(4)
    for p in shared.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.15)
    x = torch.randn(11, 64, generator=g)
    gate, up = (x @ shared.w13.t()).chunk(2, dim=-1)
    ref_shared = torch.sigmoid(x @ shared.gate_weight.t()) * ((torch.nn.functional.silu(gate) * up) @ shared.w2.t())
    torch.testing.assert_close(layer(x) + shared(x), _torch_path(layer, x) + ref_shared, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_with_no_one_and_every_token(dtype: torch.dtype, bf16_tiles: str) -> None:
    T, H, I, E, k = 9, 64, 24, 6, 2
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.15).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.15).to(dtype)
    ids = torch.zeros(T, k, dtype=torch.int64)  # expert 0: every token
    ids[:, 1] = 2
    ids[4, 1] = 5  # expert 5: one token; 1, 3: none; 2: all but one
    weights = torch.rand(T, k, generator=g)
    out = native_moe.experts(x, w13, w2, weights, ids)
    ref = fused_experts_torch(x, w13, w2, weights, ids)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=2 ** -7 * float(ref.abs().max()))
    # an expert that receives no token contributes nothing: changing its weights changes nothing
    w13b, w2b = w13.clone(), w2.clone()
    w13b[[1, 3]] = 7.0
    w2b[[1, 3]] = -7.0
    assert torch.equal(native_moe.experts(x, w13b, w2b, weights, ids), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repacked_after_weight_writes(dtype: torch.dtype, native_only: None) -> None:
    layer = _layer("qwen3_moe", 64, 32, dtype)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    before = layer(x)
    with torch.no_grad():  # what the loader and update_weights do: in-place copies, also of one expert
        layer.w13.copy_(layer.w13 * -0.5)
        layer.w2[3].copy_(torch.randn(64, 32) * 0.3)
    after = layer(x)
    assert not torch.equal(after, before)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7 * float(after.abs().max()))
    torch.testing.assert_close(after, _torch_path(layer, x), **tol)
    # a write that bypasses the version counter (.data) is covered by drop_packed, which the
    # engine's update_weights calls
    layer.w2.data.mul_(2.0)
    gemm.drop_packed(layer)
    torch.testing.assert_close(layer(x), _torch_path(layer, x), **tol)


def test_empty_batch_and_fallbacks() -> None:
    layer = _layer("qwen3_moe", 64, 32, torch.float32)
    assert layer(torch.empty(0, 64)).shape == (0, 64)
    # autograd needs the torch path: gradients must flow
    x = torch.randn(4, 64, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    # MXFP8 experts stay on the torch path (no plain weights left to pack)
    layer.quantize_("mxfp8")
    assert layer(torch.randn(2, 64)).shape == (2, 64)


def test_bad_input_is_refused() -> None:
    x = torch.randn(3, 64)
    w13, w2 = torch.randn(4, 64, 64), torch.randn(4, 64, 32)
    weights = torch.rand(3, 2)
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 4\)"):
        native_moe.experts(x, w13, w2, weights, torch.tensor([[0, 4]] * 3))
    with pytest.raises(ValueError, match="int64"):
        native_moe.experts(x, w13, w2, weights, torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="hidden size"):
        native_moe.experts(torch.randn(3, 32), w13, w2, weights, torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="differ from the activations"):
        native_moe.experts(x.bfloat16(), w13, w2, weights, torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="top_k"):
        native_moe.route(torch.randn(3, 4), 5, False, True)
    with pytest.raises(ValueError, match="n_group"):
        native_moe.route(torch.randn(3, 6), 2, True, True, n_group=4, topk_group=1)


def test_switched_off_takes_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from cuttle.attention import native

    layer = _layer("qwen3_moe", 64, 32, torch.float32)
    x = torch.randn(3, 64)
    calls: list[int] = []

    def counting(*args, **kwargs):
        calls.append(1)
        return fused_experts_torch(*args, **kwargs)

    monkeypatch.setattr(layer_mod, "fused_experts_torch", counting)
    monkeypatch.setenv("CUTTLE_MOE_NATIVE", "0")
    native.select()
    try:
        assert not native_moe.available() and "moe experts: torch" in native.kernels().describe
        layer(x)
        assert calls == [1]
    finally:
        monkeypatch.delenv("CUTTLE_MOE_NATIVE")
        native.select()
    assert native_moe.available()
    layer(x)
    assert calls == [1]


@pytest.mark.parametrize("T", [1, 2, 7])
def test_bf16_experts_with_odd_sizes(T: int, bf16_tiles: str) -> None:
    """H and I odd: the dot tiles take k in pairs and the last k alone (its weights beside zeros)."""
    H, I, E, k = 33, 17, 4, 2
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.3).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * 0.3).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    out, ref = native_moe.experts(x, w13, w2, weights, ids), fused_experts_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=2 ** -7 * float(ref.abs().max()))
