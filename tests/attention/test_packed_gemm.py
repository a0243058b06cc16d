"""The packed bf16 GEMM (attention/csrc/packed_gemm.c, behind `cuttle.attention.native.gemm.linear` for
bf16): against a float64 product over row/feature/K tails, strided inputs and bias; its packed weight copy
follows in-place weight updates; the switch turns it off."""
from __future__ import annotations

import pytest
import torch

from cuttle.attention import native
from cuttle.attention.native import gemm


@pytest.fixture(scope="module", autouse=True)
def packed_available() -> None:
    if not native.kernels().packed_gemm:
        pytest.skip("packed GEMM needs the native library and AVX512-BF16")


@pytest.fixture
def packs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts weight packings; a call through the packed path looks its weight up every time."""
    calls: list[int] = []
    real = gemm._packed

    def counting(weight):
        calls.append(weight.shape[0])
        return real(weight)

    monkeypatch.setattr(gemm, "_packed", counting)
    return calls


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    # products are exact and sums fp32; the output is rounded to bf16 once: half an ulp (2^-9)
    # plus a little for the fp32 sum order
    tol = 2 ** -8 * ref.abs().clamp_min(1.0)
    err = (out.double() - ref).abs()
    assert (err <= tol).all(), err.max().item()


@pytest.mark.parametrize("m", [1, 2, 4, 5, 6, 7, 13, 64, 131])
@pytest.mark.parametrize("n,k", [(1, 2), (63, 33), (64, 128), (65, 1), (200, 1000)])
def test_packed_gemm_matches_float64(m: int, n: int, k: int, packs: list[int]) -> None:
    g = torch.Generator().manual_seed(1000 * m + 10 * n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    for bias in (None, b):
        _check(gemm.linear(x, w, bias), x, w, bias)
    assert packs == [n, n]


def test_packed_gemm_strided_rows(packs: list[int]) -> None:
    """x a column slice of a wider tensor (row stride != K), as q|k|v splits produce."""
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(9, 300, generator=g).bfloat16()
    x = wide[:, 100:228]
    w = torch.randn(70, 128, generator=g).bfloat16()
    _check(gemm.linear(x, w), x, w, None)
    assert packs == [70]


def test_packed_copy_follows_weight_updates(packs: list[int]) -> None:
    g = torch.Generator().manual_seed(8)
    x = torch.randn(8, 64, generator=g).bfloat16()
    holder = torch.nn.Module()
    holder.w = torch.nn.Parameter(torch.randn(96, 64, generator=g).bfloat16(), requires_grad=False)
    w = holder.w
    y0 = gemm.linear(x, w)
    packed_before = getattr(w, gemm._PACKED_ATTR)[1]
    assert torch.equal(gemm.linear(x, w), y0)
    assert getattr(w, gemm._PACKED_ATTR)[1] is packed_before  # reused, not rebuilt
    w2 = torch.randn(96, 64, generator=g).bfloat16()
    with torch.no_grad():  # an in-place write through a slice bumps the version counter
        w[:48].copy_(w2[:48])
        w[48:].copy_(w2[48:])
    _check(gemm.linear(x, w), x, w2, None)
    w.data.copy_(torch.zeros_like(w))  # `.data` bypasses the counter ...
    assert not torch.equal(gemm.linear(x, w), torch.zeros(8, 96, dtype=torch.bfloat16))
    gemm.drop_packed(holder)  # ... and drop_packed is the remedy
    assert torch.equal(gemm.linear(x, w), torch.zeros(8, 96, dtype=torch.bfloat16))
    assert len(packs) == 5  # every call looked its packed weight up


def test_packed_gemm_switch_and_fallbacks(monkeypatch: pytest.MonkeyPatch, packs: list[int]) -> None:
    """CUTTLE_PACKED_GEMM=0, fp32 inputs and autograd all take F.linear, exactly."""
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(12, 40, generator=g).bfloat16(), torch.randn(24, 40, generator=g).bfloat16()
    monkeypatch.setattr(native, "_current", native.kernels())  # the test's re-selections are undone after it
    monkeypatch.setenv("CUTTLE_PACKED_GEMM", "0")
    assert not native.select().packed_gemm  # the switch is read when the kernel set is chosen
    assert torch.equal(gemm.linear(x, w), torch.nn.functional.linear(x, w))
    monkeypatch.delenv("CUTTLE_PACKED_GEMM")
    assert native.select().packed_gemm
    xf, wf = x.float(), w.float()
    assert torch.equal(gemm.linear(xf, wf), torch.nn.functional.linear(xf, wf))
    wg = w.clone().requires_grad_()
    gemm.linear(x, wg).float().sum().backward()
    assert wg.grad is not None
    assert packs == []


def test_mismatched_shapes_raise_like_torch(packs: list[int]) -> None:
    """A K or bias length that does not fit the weight never reaches the kernels: F.linear's error."""
    w = torch.randn(16, 32).bfloat16()
    with pytest.raises(RuntimeError):
        gemm.linear(torch.randn(6, 31).bfloat16(), w)
    with pytest.raises(RuntimeError):
        gemm.linear(torch.randn(6, 32).bfloat16(), w, torch.randn(15).bfloat16())
    assert packs == []
