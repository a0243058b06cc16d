"""Batch invariance of the CPU kernels (`cuttle.attention.native.invariance`): row i of a call over
rows [0, n) equals row i of the call over all rows, bit for bit, for n from 1 to 64.

With the switch on every kernel a model's forward runs is invariant; with it off the kernels the
module docstring names as invariant still are, and the others are shown to differ (the control:
without it this file could not fail for a kernel that ignored the switch). Outputs are fp32 where
the kernel can write fp32, so bf16 rounding cannot hide a different summation order."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from cuttle.attention import native_attention
from cuttle.attention.native import fused, gemm, invariance, kernels
from cuttle.attention.native import moe as native_moe
from cuttle.attention.native import mxfp8 as native_mxfp8
from cuttle.attention.native.build import DTYPE_CODE
from cuttle.moe.mxfp8 import quantize_mxfp8
from cuttle.moe.routing import RoutingConfig, route

pytestmark = pytest.mark.skipif(kernels().lib is None, reason="native CPU kernel library not built")

ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 17, 33, 64)
K, N = 512, 768  # a linear layer's shape (K a multiple of 64: every MXFP8 loop applies)
E, H, I, TOP_K, T = 8, 512, 256, 2, 200  # routed experts: 200 tokens, expert 3 in half of them


def _differing(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> list[int]:
    """The row counts n at which f(x[:n]) is not the first n rows of f(x)."""
    full = f(x)
    return [n for n in ROW_COUNTS if not torch.equal(f(x[:n]), full[:n])]


def _cases() -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    w_bf16 = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
    x32 = torch.randn(80, K, generator=g)
    lib = kernels().lib
    cases: dict[str, tuple[Callable, torch.Tensor]] = {}
    cases["linear fp32"] = (lambda x: gemm.linear(x, w_bf16.float()), x32)
    cases["linear bf16"] = (lambda x: gemm.linear(x, w_bf16), x32.bfloat16())  # bf16 out: the engine's call
    if kernels().packed_gemm:
        def packed(x: torch.Tensor) -> torch.Tensor:
            y = torch.empty(x.shape[0], N)
            lib.packed_gemm_bf16(x.data_ptr(), x.stride(0), gemm._packed(w_bf16).data_ptr(), None, y.data_ptr(),
                                 DTYPE_CODE[y.dtype], N, x.shape[0], N, K)
            return y
        cases["packed GEMM bf16 (fp32 out)"] = (packed, x32.bfloat16())
    if lib.w16_gemm_available():  # the AVX2 widening GEMM: callable on any AVX2 CPU, used where AVX512-BF16 is absent
        def w16(x: torch.Tensor) -> torch.Tensor:
            y = torch.empty(x.shape[0], N)
            assert lib.w16_linear(x.data_ptr(), DTYPE_CODE[x.dtype], x.stride(0), w_bf16.data_ptr(), None, y.data_ptr(),
                                  DTYPE_CODE[y.dtype], x.shape[0], N, K, int(invariance.on())) == 0
            return y
        cases["w16 GEMM bf16 (fp32 out)"] = (w16, x32.bfloat16())
    data, scale = quantize_mxfp8(w_bf16.float())
    for dt in (torch.bfloat16, torch.float32):
        cases[f"MXFP8 linear {dt} (fp32 out)"] = (
            lambda x: native_mxfp8.linear(x, data, scale, out=torch.empty(x.shape[0], N)), x32.to(dt))
    # 700 output features: the decode loop's last group of 16 weight rows is partial (12 rows)
    data7, scale7 = data[:700].contiguous(), scale[:700].contiguous()
    cases["MXFP8 linear torch.bfloat16, N 700 (fp32 out)"] = (
        lambda x: native_mxfp8.linear(x, data7, scale7, out=torch.empty(x.shape[0], 700)), x32.bfloat16())
    # 200 rows x 300: past torch's 32768-element grain, so with several threads its ranges (and
    # silu_mul's default scalar tails) fall inside rows; the switch puts the tails at row ends
    gate_up = torch.randn(200, 600, generator=g)
    for dt in (torch.float32, torch.bfloat16):
        cases[f"silu_mul {dt}"] = (fused.silu_mul, gate_up.to(dt))
        cases[f"sigmoid {dt}"] = (fused.sigmoid, gate_up[:, :300].contiguous().to(dt))
    # the torch routers (the native router hands them its near-tied rows): 24 experts, not a
    # multiple of torch's vector step, so where its elementwise tails fall moves with the row count
    # (with torch's own sigmoid these weights differed at 33 rows)
    logits = torch.randn(80, 24, generator=g) * 3
    bias = torch.randn(24, generator=g) * 0.1
    for name, cfg in (("sigmoid", RoutingConfig(24, 6, scoring_func="sigmoid", n_group=4, topk_group=3,
                                                 routed_scaling_factor=2.5)),
                      ("softmax", RoutingConfig(24, 6, norm_topk_prob=True))):
        def routed(x: torch.Tensor, cfg=cfg) -> torch.Tensor:
            weights, ids = route(x, cfg, bias if cfg.scoring_func == "sigmoid" else None)
            return torch.cat([weights, ids.float()], dim=1)
        cases[f"route {name}"] = (routed, logits)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.05
    w2 = torch.randn(E, H, I, generator=g) * 0.05
    xe = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(T)])
    ids[: T // 2, 0] = 3  # one crowded expert: tiles of every height, remainders of 1..5 rows
    ids[: T // 2, 1] = torch.where(ids[: T // 2, 1] == 3, 4, ids[: T // 2, 1])
    weights = torch.rand(T, TOP_K, generator=g)
    for dt in (torch.float32, torch.bfloat16):
        for dot in (True, False):  # the dot tiles (where the CPU has them) and the panel tiles
            if dot and not (dt == torch.bfloat16 and native_moe.dot_in_use()):
                continue
            before = native_moe.dot_in_use()
            native_moe.set_bf16_dot(dot)
            try:
                plain = native_moe.pack(w13.to(dt), w2.to(dt))
                mx = native_moe.pack_mxfp8(quantize_mxfp8(w13.to(dt)), quantize_mxfp8(w2.to(dt)), dt)
            finally:
                native_moe.set_bf16_dot(before)
            for name, p in (("plain", plain), ("MXFP8", mx)):
                cases[f"experts {name} {dt} format {p.fmt}"] = (
                    lambda x, p=p: native_moe.experts_packed(x, p, weights[: x.shape[0]], ids[: x.shape[0]]), xe.to(dt))
    return cases


CASES = _cases()
# What the module docstring says sums in one order with the switch off (the engine's default).
DEFAULT_INVARIANT = [n for n in CASES if n.startswith(("packed GEMM", "linear bf16")) and kernels().packed_gemm]
DEFAULT_INVARIANT += [n for n in CASES if n.startswith("experts") and (f"format {native_moe.W_BF16_DOT}" in n
                                                                         or f"format {native_moe.W_MXFP8_DOT}" in n)]
DEFAULT_INVARIANT += [n for n in CASES if n.startswith(("sigmoid", "route"))]
# ... and what it says does not: each must differ somewhere, or the switch would be untested.
SWITCHED = ["linear fp32", "MXFP8 linear torch.bfloat16 (fp32 out)", "MXFP8 linear torch.float32 (fp32 out)",
            f"experts plain torch.float32 format {native_moe.W_F32}", f"experts MXFP8 torch.float32 format {native_moe.W_MXFP8}"]
SWITCHED += [n for n in CASES if n.startswith("w16")]


@pytest.mark.parametrize("name", list(CASES))
def test_every_kernel_is_invariant_with_the_switch_on(name: str) -> None:
    f, x = CASES[name]
    with invariance.batch_invariant():
        assert _differing(f, x) == [], name


@pytest.mark.parametrize("name", DEFAULT_INVARIANT)
def test_default_invariant_kernels(name: str) -> None:
    f, x = CASES[name]
    assert _differing(f, x) == [], name


@pytest.mark.parametrize("name", SWITCHED)
def test_switch_changes_what_differs_by_row_count(name: str) -> None:
    f, x = CASES[name]
    assert _differing(f, x), f"{name} is already invariant with the switch off: update invariance.py's list"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_sigmoid_is_torchs_within_rounding(dtype: torch.dtype) -> None:
    x = torch.cat([torch.randn(4000, generator=torch.Generator().manual_seed(2)) * 8, torch.tensor([-88.0, -30.0, 0.0, 30.0, 88.0])])
    x = x.to(dtype)
    got, want = fused.sigmoid(x), torch.sigmoid(x)
    exact = torch.sigmoid(x.double())
    if dtype == torch.float32:
        assert ((got.double() - exact).abs() / exact).max() < 1e-6
        assert ((got - want).abs() / want).max() < 1e-6
    else:  # bf16: one rounding of the fp32 value: within one bf16 step of torch's
        assert ((got.float() - want.float()).abs() / want.float()).max() <= 2 ** -8


def test_switch_is_scoped_and_per_thread() -> None:
    import threading

    seen = []
    with invariance.batch_invariant():
        assert invariance.on()
        t = threading.Thread(target=lambda: seen.append(invariance.on()))
        t.start()
        t.join()
        with invariance.batch_invariant(False):
            assert not invariance.on()
        assert invariance.on()
    assert not invariance.on() and seen == [False]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,kv_heads,group", [(64, 2, 4), (128, 4, 2), (128, 8, 1), (64, 1, 8), (16, 2, 2)])
def test_paged_attention_rows_are_invariant(dtype: torch.dtype, head_dim: int, kv_heads: int, group: int) -> None:
    """The attention kernel at its default: a row's output and log-sum-exp do not depend on the
    other rows of the call (nor on how the heads are split into work items, which follows the row
    count)."""
    g = torch.Generator().manual_seed(1)
    bs, nblocks, rows = 16, 120, 12
    k_cache = torch.randn(nblocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(nblocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(rows, kv_heads * group, head_dim, generator=g).to(dtype)
    lens = torch.randint(1, 60 * bs, (rows,), generator=g, dtype=torch.int32)
    tables = torch.stack([torch.randperm(nblocks, generator=g)[:60] for _ in range(rows)]).to(torch.int32)

    def attend(sel: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(sel)
        out = torch.zeros(rows, kv_heads * group, head_dim, dtype=dtype)
        lse = torch.zeros(rows, kv_heads * group)
        native_attention.paged_attention_rows(q, k_cache, v_cache, out, lse, idx, idx, tables[idx].contiguous(),
                                              lens[idx].contiguous(), head_dim ** -0.5)
        return out[idx], lse[idx]

    full_o, full_l = attend(list(range(rows)))
    for sel in ([0], [5], [0, 1], [4, 5, 6], list(range(8))):
        o, lse = attend(sel)
        assert torch.equal(o, full_o[sel]) and torch.equal(lse, full_l[sel]), sel
