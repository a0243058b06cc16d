"""The CPU kernel set (`cuttle.attention.native.kernels()`): chosen once per process, logged in
one line when the model loads, consulted by every kernel without re-reading the environment; and
the weight-streaming linear kernel it picks for a few rows (fp32, or bf16 with the packed GEMM off)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from cuttle.attention import native
from cuttle.attention.native import gemm


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**os.environ, **env})


def test_engine_load_logs_the_choice_once() -> None:
    code = (
        "import logging\n"
        "logging.basicConfig(level=logging.INFO, format='%(name)s|%(message)s')\n"
        "from cuttle.engine import LLM, SamplingParams\n"
        "llm = LLM(dtype='float32', num_kv_blocks=32)\n"
        "import sys; print('LOADED', file=sys.stderr, flush=True)\n"
        "llm.generate(['def f(x):'] * 2, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)\n"
        "LLM(dtype='float32', num_kv_blocks=32)\n"
    )
    r = _python(code)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "CPU kernels:" in line]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("cuttle.attention.native|CPU kernels: ")
    # chosen while the model loads (the runner's prepack), not in the first request
    assert r.stderr.index("CPU kernels:") < r.stderr.index("LOADED")


def test_disabled_library_is_torch_only() -> None:
    code = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "from cuttle.attention import native\n"
        "from cuttle.attention.native import argmax, fused, gemm\n"
        "ks = native.kernels()\n"
        "assert ks.lib is None and not ks.packed_gemm, ks\n"
        "x, w = torch.randn(2, 16), torch.randn(8, 16)\n"
        "assert torch.equal(gemm.linear(x, w), torch.nn.functional.linear(x, w))\n"
        "assert torch.equal(argmax.argmax(x), torch.argmax(x, dim=-1))\n"
        "assert torch.equal(fused.rms_norm(x, torch.ones(16), 1e-6), fused.rms_norm_torch(x, torch.ones(16), 1e-6))\n"
        "assert gemm.prepack([w.bfloat16()]) == 0\n"
        "print('ok')\n"
    )
    r = _python(code, CUTTLE_CPU_KERNELS="0")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    assert "CPU kernels: torch only (CUTTLE_CPU_KERNELS=0)" in r.stderr


def test_environment_is_read_at_selection_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the choice, the switches change nothing until `select()` is called again."""
    before = native.kernels()
    monkeypatch.setattr(native, "_current", before)  # undo the re-selection below after the test
    monkeypatch.setenv("CUTTLE_PACKED_GEMM", "0")
    assert native.kernels() is before
    after = native.select()
    assert not after.packed_gemm and not after.w16_gemm and native.kernels() is after


class _CountingLib:
    def __init__(self, lib, calls: list[str]):
        self._lib, self._calls = lib, calls

    def __getattr__(self, name: str):
        self._calls.append(name)
        return getattr(self._lib, name)


@pytest.fixture
def streaming(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The library with the native bf16 GEMMs off, so bf16 at a few rows takes the streaming
    kernel; the names of the kernels called."""
    ks = native.kernels()
    if ks.lib is None:
        pytest.skip("no native library here")
    calls: list[str] = []
    monkeypatch.setattr(native, "_current", dataclasses.replace(ks, lib=_CountingLib(ks.lib, calls), packed_gemm=False, w16_gemm=False))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 37, 64), (3, 256, 1000), (4, 1031, 96), (2, 5, 33)])
def test_small_m_linear_matches_float64(dtype: torch.dtype, m: int, n: int, k: int, streaming: list[str]) -> None:
    """The weight-streaming linear (odd N and K exercise the 4-row and 32-element tails) against a
    float64 product of the same inputs: fp32 to ~1e-5 relative, bf16 to one rounding of the output."""
    g = torch.Generator().manual_seed(m * n + k)
    x, w, b = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    for bias in (None, b):
        ref = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
        out = gemm.linear(x, w, bias)
        assert out.dtype == dtype and out.shape == (m, n)
        tol = (1e-5 if dtype == torch.float32 else 2 ** -8) * ref.abs().clamp_min(1.0) * (k ** 0.5 if dtype == torch.float32 else 1)
        assert ((out.double() - ref).abs() <= tol).all(), (out.double() - ref).abs().max().item()
    assert streaming == ["small_m_linear", "small_m_linear"]


def test_small_m_linear_falls_back_outside_its_shapes(streaming: list[str]) -> None:
    """Many rows, 3-D input, autograd, a transposed weight: all take F.linear and stay exact."""
    x, w = torch.randn(9, 16), torch.randn(8, 16)
    assert torch.equal(gemm.linear(x, w), torch.nn.functional.linear(x, w))
    x3 = torch.randn(2, 1, 16)
    assert torch.equal(gemm.linear(x3, w), torch.nn.functional.linear(x3, w))
    wt = torch.randn(16, 8).t()
    assert torch.equal(gemm.linear(x[:1], wt), torch.nn.functional.linear(x[:1], wt))
    wg = w.clone().requires_grad_()
    y = gemm.linear(x[:1], wg)
    y.sum().backward()
    assert wg.grad is not None
    assert streaming == []


@pytest.fixture
def widening(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The library with the AVX2 widening bf16 GEMM on (as chosen on a CPU without AVX512-BF16;
    forced here so a CPU with it tests the kernel too); the names of the kernels called."""
    ks = native.kernels()
    if ks.lib is None or not ks.lib.w16_gemm_available():
        pytest.skip("the library here was built without AVX2 + FMA: no widening GEMM to test")
    calls: list[str] = []
    monkeypatch.setattr(native, "_current", dataclasses.replace(ks, lib=_CountingLib(ks.lib, calls), packed_gemm=False, w16_gemm=True))
    return calls


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(1, 37, 64), (1, 300, 48), (2, 5, 33), (3, 256, 1000), (4, 1031, 96), (5, 3, 16),
                                   (7, 65, 200), (9, 64, 512), (64, 97, 130), (3, 1, 15)])
def test_w16_gemm_matches_float64(x_dtype: torch.dtype, m: int, n: int, k: int, widening: list[str]) -> None:
    """bf16 weights, streamed (<= 4 rows) and tiled (more rows; M and N not multiples of the 3 x 2
    tile, N not a multiple of the 32-row block, K with a tail past the last 16-column block or
    shorter than one), bf16 or fp32 x, with and without bias, x a strided view: against a float64
    product of the same values, to one rounding of the output (bf16) or fp32 accumulation error."""
    g = torch.Generator().manual_seed(m * n + k)
    w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    x = torch.randn(m, k + 3, generator=g).to(x_dtype)[:, 2 : k + 2]  # row stride k + 3
    for bias in (None, b):
        ref = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
        out = gemm.linear(x, w, bias)
        assert out.dtype == x_dtype and out.shape == (m, n)
        if x_dtype == torch.bfloat16:
            tol = 2 ** -8 * ref.abs().clamp_min(1.0)
        else:
            tol = 1e-6 * k ** 0.5 * torch.nn.functional.linear(x.double().abs(), w.double().abs()).clamp_min(1.0)
        assert ((out.double() - ref).abs() <= tol).all(), (out.double() - ref).abs().max().item()
    assert widening == ["w16_linear", "w16_linear"]


def test_w16_gemm_takes_only_bf16_weights(widening: list[str]) -> None:
    """fp32 weights keep the streaming kernel / torch; autograd and K = 0 take F.linear."""
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    gemm.linear(x, w)
    assert widening == ["small_m_linear"]
    widening.clear()
    wg = w.bfloat16().requires_grad_()
    gemm.linear(x.bfloat16(), wg).sum().backward()
    assert wg.grad is not None
    e = gemm.linear(torch.zeros(3, 0).bfloat16(), torch.zeros(4, 0).bfloat16(), torch.ones(4).bfloat16())
    assert torch.equal(e, torch.ones(3, 4).bfloat16())
    assert widening == []
