"""The native CPU decode kernel (attention/csrc/paged_decode.c) against the naive float64 oracle and
against the plain-torch path of the same backend, in fp32 and bf16, over the shared cases plus
batches large and small enough to take both work splits (whole sequences / heads split)."""
from __future__ import annotations

import shutil

import pytest
import torch

from attention_cases import CASES, Case, build_batch, naive_attention
from cuttle.attention import cpu_kernels
from cuttle.attention.torch_backend import TorchAttentionBackend

EXTRA = (
    Case("many_decodes", tuple((int(n), 1) for n in torch.randint(0, 90, (40,), generator=torch.Generator().manual_seed(3))), 8, 4, 64, 16),
    Case("one_decode_long", ((300, 1),), 16, 8, 128, 16),
    Case("decode_with_prefill", ((0, 9), (47, 1), (12, 1), (30, 5)), 4, 2, 32, 8),
)


@pytest.fixture(scope="module", autouse=True)
def kernels_built() -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the native kernel cannot build here")
    assert cpu_kernels.load() is not None, "a compiler is present, so the kernel must build"


def _run(backend: TorchAttentionBackend, batch) -> torch.Tensor:
    backend.begin_step(batch.meta)
    return backend.forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts native decode calls, so a test fails if the backend silently took the torch path."""
    calls: list[int] = []
    real = cpu_kernels.paged_decode_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "paged_decode_attention", counted)
    return calls


def _has_decode(case: Case) -> bool:
    return any(new == 1 for _, new in case.seqs)


@pytest.mark.parametrize("case", CASES + EXTRA, ids=lambda c: c.name)
def test_native_decode_matches_naive_fp32(case: Case, kernel_calls: list[int]) -> None:
    batch = build_batch(case, junk=None)
    native = TorchAttentionBackend(native=True)
    assert native.native
    err = (_run(native, batch).double() - naive_attention(batch)).abs().max().item()
    assert err <= 1e-5, err
    assert len(kernel_calls) == int(_has_decode(case))


@pytest.mark.parametrize("case", CASES + EXTRA, ids=lambda c: c.name)
def test_native_decode_matches_torch_path_bf16(case: Case, kernel_calls: list[int]) -> None:
    """bf16 cache and queries: both paths compute in fp32 from the same bf16 inputs and round the
    output once, so they agree to bf16 rounding of the output."""
    ref_batch, nat_batch = build_batch(case, junk=0.0), build_batch(case, junk=0.0)
    for b in (ref_batch, nat_batch):
        for name in ("q", "k", "v", "k_cache", "v_cache"):
            setattr(b, name, getattr(b, name).to(torch.bfloat16))
    ref = _run(TorchAttentionBackend(native=False), ref_batch).float()
    assert kernel_calls == []
    out_bf16 = _run(TorchAttentionBackend(native=True), nat_batch)
    assert out_bf16.dtype == torch.bfloat16 and len(kernel_calls) == int(_has_decode(case))
    assert torch.equal(ref_batch.k_cache, nat_batch.k_cache)
    out = out_bf16.float()
    tol = 2 ** -7 * ref.abs().clamp_min(1.0)  # a couple of bf16 ulps
    assert ((out - ref).abs() <= tol).all(), (out - ref).abs().max().item()


def test_native_kernel_disabled_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setenv("CUTTLE_CPU_KERNELS", "0")
    assert cpu_kernels.load() is None
    assert not TorchAttentionBackend().native


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 37, 64), (3, 256, 1000), (4, 1031, 96), (2, 5, 33)])
def test_small_m_linear_matches_float64(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    """The weight-streaming linear (odd N and K exercise the 4-row and 32-element tails) against a
    float64 product of the same inputs: fp32 to ~1e-5 relative, bf16 to one rounding of the output."""
    g = torch.Generator().manual_seed(m * n + k)
    x, w, b = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    for bias in (None, b):
        ref = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
        out = cpu_kernels.linear(x, w, bias)
        assert out.dtype == dtype and out.shape == (m, n)
        tol = (1e-5 if dtype == torch.float32 else 2 ** -8) * ref.abs().clamp_min(1.0) * (k ** 0.5 if dtype == torch.float32 else 1)
        assert ((out.double() - ref).abs() <= tol).all(), (out.double() - ref).abs().max().item()


def test_small_m_linear_falls_back_outside_its_shapes() -> None:
    """Many rows, 3-D input, autograd, a transposed weight: all take F.linear and stay exact."""
    x, w = torch.randn(9, 16), torch.randn(8, 16)
    assert torch.equal(cpu_kernels.linear(x, w), torch.nn.functional.linear(x, w))
    x3 = torch.randn(2, 1, 16)
    assert torch.equal(cpu_kernels.linear(x3, w), torch.nn.functional.linear(x3, w))
    wt = torch.randn(16, 8).t()
    assert torch.equal(cpu_kernels.linear(x[:1], wt), torch.nn.functional.linear(x[:1], wt))
    wg = w.clone().requires_grad_()
    y = cpu_kernels.linear(x[:1], wg)
    y.sum().backward()
    assert wg.grad is not None
