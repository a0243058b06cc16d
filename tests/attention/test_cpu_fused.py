"""The fused CPU kernels of attention/csrc/fused_ops.c (RMSNorm, residual add + RMSNorm, q/k
norm + RoPE, silu * up, the in-place whole-row norm, the elementwise add / scale, the sink scale)
against the torch code they replace, in fp32 and bf16.

The kernels reproduce torch's rounding points and its summation order, so on the x86 torch
builds they are matched to (AVX512 / AVX2 kernels) the results must be bit-identical; elsewhere
within an ulp. Every native-path test counts the kernel calls, so a silent fallback to the torch
path fails it; the fallbacks (no library, autograd, unsupported layouts) are tested on their own.
"""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import torch.nn.functional as F

from cuttle.attention import native
from cuttle.attention.native import build, fused
from cuttle.attention.rope import RotaryEmbedding, apply_rope

DTYPES = (torch.float32, torch.bfloat16)
# the kernels are matched to torch's x86 vector kernels; on other builds allow an ulp
BIT_EXACT = torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX2")


@pytest.fixture(scope="module", autouse=True)
def kernels_built() -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the native kernels cannot build here")
    assert native.kernels().lib is not None, "a compiler is present, so the kernels must build"


class _Counting:
    """Stands in for the kernel library and counts calls per kernel name."""

    def __init__(self, lib, calls: dict[str, int]):
        self._lib, self._calls = lib, calls

    def __getattr__(self, name):
        fn = getattr(self._lib, name)

        def counted(*args):
            self._calls[name] = self._calls.get(name, 0) + 1
            return fn(*args)

        return counted


def use_library(monkeypatch: pytest.MonkeyPatch, lib) -> None:
    """Run the fused ops (only them) on `lib` (a counting proxy, another build, or None: the torch
    paths) until the test ends; the rest of the chosen kernel set (lanes, exactness) stays."""
    ks = dataclasses.replace(native.kernels(), lib=lib)
    monkeypatch.setattr(fused, "kernels", lambda: ks)


@pytest.fixture
def native_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls: dict[str, int] = {}
    use_library(monkeypatch, _Counting(native.kernels().lib, calls))
    return calls


@pytest.fixture
def no_library(monkeypatch: pytest.MonkeyPatch) -> None:
    use_library(monkeypatch, None)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if BIT_EXACT:
        diff = (got != want).sum().item()
        assert torch.equal(got, want), f"{diff} of {got.numel()} differ, max {(got.float() - want.float()).abs().max().item()}"
    else:
        ulp = torch.finfo(want.dtype).eps
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * ulp, atol=1e-6)


def test_probe_matched_this_torch_build() -> None:
    if BIT_EXACT:
        assert native.kernels().norms_exact, "the summation order of torch's sum kernel was not found"


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# (rows, hidden): decode shapes, hidden not a multiple of 16 or 8, fewer elements than a vector,
# many rows (the OpenMP split), and a row long enough for torch's cascade sum to go up a level
NORM_SHAPES = [(1, 1024), (64, 1024), (33, 1000), (1, 17), (3, 33), (5, 7), (4, 4096), (2, 70000)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", NORM_SHAPES)
def test_rms_norm(dtype, rows, n, native_calls) -> None:
    g = _gen(rows * n)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    w = torch.randn(n, generator=g).to(dtype)
    assert_same(fused.rms_norm(x, w, 1e-6), fused.rms_norm_torch(x, w, 1e-6))
    assert native_calls == {"fused_rms_norm": 1}


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_and_batched_inputs(dtype, native_calls) -> None:
    g = _gen(1)
    wide = (torch.randn(9, 300, generator=g) * 2).to(dtype)
    x = wide[:, 50:250]  # rows of a wider tensor (MLA's latent is such a slice)
    w = torch.randn(200, generator=g).to(dtype)
    y = fused.rms_norm(x, w, 1e-5)
    assert y.is_contiguous()
    assert_same(y, fused.rms_norm_torch(x, w, 1e-5))
    x3 = torch.randn(2, 3, 200, generator=g).to(dtype)  # contiguous [B, S, H]: the no-grad training shape
    assert_same(fused.rms_norm(x3, w, 1e-5), fused.rms_norm_torch(x3, w, 1e-5))
    one = torch.randn(200, generator=g).to(dtype)  # a single vector
    assert_same(fused.rms_norm(one, w, 1e-5), fused.rms_norm_torch(one, w, 1e-5))
    assert native_calls == {"fused_rms_norm": 3}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", NORM_SHAPES[:6])
def test_add_rms_norm(dtype, rows, n, native_calls) -> None:
    g = _gen(rows + n)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    d = torch.randn(rows, 2 * n, generator=g).to(dtype)[:, :n]  # strided delta
    w = torch.randn(n, generator=g).to(dtype)
    x_new, y = fused.add_rms_norm(x, d, w, 1e-6)
    want_x = x + d
    assert_same(x_new, want_x)
    assert_same(y, fused.rms_norm_torch(want_x, w, 1e-6))
    assert native_calls == {"fused_rms_norm": 1}


def _qkv_case(dtype, T, hq, hk, d, seed=0):
    g = _gen(seed)
    rope = RotaryEmbedding(d, 4096, 1e6, None, torch.device("cpu"))
    cos, sin = rope.tables(torch.randint(0, 4096, (T,), generator=g), dtype)
    qkv = (torch.randn(T, (hq + 2 * hk) * d, generator=g) * 2).to(dtype)
    qw = (torch.rand(d, generator=g) + 0.5).to(dtype)
    kw = (torch.rand(d, generator=g) + 0.5).to(dtype)
    return qkv, qw, kw, cos, sin


def _torch_qk_norm_rope(qkv, hq, hk, d, qw, kw, eps, cos, sin):
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.reshape(-1, hq, d), k.reshape(-1, hk, d)
    if qw is not None:
        q, k = fused.rms_norm_torch(q, qw, eps), fused.rms_norm_torch(k, kw, eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.reshape(-1, hk, d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,hq,hk,d", [(1, 16, 8, 128), (64, 16, 8, 128), (33, 4, 2, 64), (5, 3, 1, 20), (7, 2, 2, 96)])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope(dtype, T, hq, hk, d, qk_norm, native_calls) -> None:
    qkv, qw, kw, cos, sin = _qkv_case(dtype, T, hq, hk, d, seed=T * d)
    if not qk_norm:
        qw = kw = None
    want = _torch_qk_norm_rope(qkv.clone(), hq, hk, d, qw, kw, 1e-6, cos, sin)
    work = qkv.clone()
    q, k, v = fused.qk_norm_rope(work, hq, hk, d, qw, kw, 1e-6, cos, sin)
    for got, ref in zip((q, k, v), want):
        assert_same(got.contiguous(), ref.contiguous())
    assert q.data_ptr() == work.data_ptr()  # rewritten in place, returned as views
    assert torch.equal(work[:, (hq + hk) * d :], qkv[:, (hq + hk) * d :])  # v untouched
    assert native_calls == {"fused_qk_norm_rope": 1}


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_strided_rows(dtype, native_calls) -> None:
    """qkv as row slices of a wider buffer, and cos/sin given as 2-d [T, D/2] tables."""
    qkv, qw, kw, cos, sin = _qkv_case(dtype, 9, 4, 2, 64, seed=11)
    wide = torch.zeros(9, qkv.shape[1] + 40, dtype=dtype)
    wide[:, 8 : 8 + qkv.shape[1]] = qkv
    work = wide[:, 8 : 8 + qkv.shape[1]]
    q, k, v = fused.qk_norm_rope(work, 4, 2, 64, qw, kw, 1e-6, cos[:, 0], sin[:, 0])
    for got, ref in zip((q, k, v), _torch_qk_norm_rope(qkv, 4, 2, 64, qw, kw, 1e-6, cos, sin)):
        assert_same(got.contiguous(), ref.contiguous())
    assert torch.equal(wide[:, :8], torch.zeros(9, 8, dtype=dtype)) and torch.equal(wide[:, -32:], torch.zeros(9, 32, dtype=dtype))
    assert native_calls == {"fused_qk_norm_rope": 1}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,hq,hk,d,rot", [(1, 16, 8, 128, 64), (33, 4, 2, 64, 32), (5, 3, 1, 20, 8), (7, 2, 2, 96, 2)])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope_partial_rotary(dtype, T, hq, hk, d, rot, qk_norm, native_calls) -> None:
    """Partial rotary (GLM-4.5): the first `rot` dims of each head rotated, the rest normed only.
    Oracle: transformers' GLM-4-MoE apply_rotary_pos_emb (cos/sin repeated over both halves)."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    g = _gen(T * d + rot)
    rope = RotaryEmbedding(rot, 4096, 1e6, None, torch.device("cpu"))
    cos, sin = rope.tables(torch.randint(0, 4096, (T,), generator=g), dtype)
    assert cos.shape[-1] == rot // 2
    qkv = (torch.randn(T, (hq + 2 * hk) * d, generator=g) * 2).to(dtype)
    qw = kw = None
    if qk_norm:
        qw, kw = ((torch.rand(d, generator=g) + 0.5).to(dtype) for _ in range(2))
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.reshape(T, hq, d), k.reshape(T, hk, d)
    if qk_norm:
        q, k = fused.rms_norm_torch(q, qw, 1e-6), fused.rms_norm_torch(k, kw, 1e-6)
    full_cos, full_sin = (torch.cat((t[:, 0], t[:, 0]), dim=-1)[None] for t in (cos, sin))  # [1, T, rot]
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], full_cos, full_sin)
    work = qkv.clone()
    got_q, got_k, got_v = fused.qk_norm_rope(work, hq, hk, d, qw, kw, 1e-6, cos, sin)
    assert_same(got_q.contiguous(), q_ref[0].transpose(0, 1).contiguous())
    assert_same(got_k.contiguous(), k_ref[0].transpose(0, 1).contiguous())
    assert torch.equal(got_v.contiguous(), v.reshape(T, hk, d))
    assert native_calls == {"fused_qk_norm_rope": 1}
    # the torch path (training, other devices) computes the same
    tq, tk, _ = _torch_qk_norm_rope(qkv, hq, hk, d, qw, kw, 1e-6, cos, sin)
    assert_same(tq, got_q.contiguous())
    assert_same(tk, got_k.contiguous())


def test_rope_rounding_matters_in_bf16(native_calls) -> None:
    """The kernel rounds x1*cos and x2*sin to bf16 before subtracting (as torch's bf16 ops do);
    computing in fp32 and rounding once would differ from torch on some elements."""
    qkv, _, _, cos, sin = _qkv_case(torch.bfloat16, 64, 16, 8, 128, seed=5)
    q_ref, _, _ = _torch_qk_norm_rope(qkv, 16, 8, 128, None, None, 0.0, cos, sin)
    x1, x2 = qkv[:, : 16 * 128].float().view(64, 16, 128).chunk(2, dim=-1)
    c, s = cos.float(), sin.float()
    once = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(torch.bfloat16)
    assert not torch.equal(once, q_ref)
    q, _, _ = fused.qk_norm_rope(qkv.clone(), 16, 8, 128, None, None, 0.0, cos, sin)
    assert_same(q.contiguous(), q_ref)


# (rows, intermediate): decode shapes, tails torch leaves to its scalar loop (glibc expf), and
# enough elements that torch splits them over threads mid-row
SILU_SHAPES = [(1, 3072), (64, 3072), (33, 100), (1, 77), (7, 6001), (64, 1000), (13, 6001), (3, 40000)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", SILU_SHAPES)
def test_silu_mul(dtype, rows, inter, native_calls) -> None:
    gu = (torch.randn(rows, 2 * inter, generator=_gen(rows * inter)) * 4).to(dtype)
    gate, up = gu.split(inter, dim=-1)
    assert_same(fused.silu_mul(gu), F.silu(gate) * up)
    assert native_calls == {"fused_silu_mul": 1}


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_strided_rows(dtype, native_calls) -> None:
    wide = (torch.randn(5, 300, generator=_gen(7)) * 4).to(dtype)
    gu = wide[:, 10:210]  # rows of [gate (100) | up (100)] inside a wider buffer
    assert_same(fused.silu_mul(gu), F.silu(gu[:, :100]) * gu[:, 100:])
    assert native_calls == {"fused_silu_mul": 1}


@pytest.mark.parametrize("threads", [1, 3])
def test_silu_mul_follows_torch_thread_split(threads, native_calls) -> None:
    """Which elements torch computes in its scalar tail depends on how it splits the rows over
    threads; the kernel is told the thread count and must agree at any count."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in DTYPES:
            gu = (torch.randn(13, 2 * 6001, generator=_gen(threads)) * 4).to(dtype)
            gate, up = gu.split(6001, dim=-1)
            assert_same(fused.silu_mul(gu), F.silu(gate) * up)
    finally:
        torch.set_num_threads(old)
    assert native_calls == {"fused_silu_mul": 2}


def test_silu_extreme_inputs(native_calls) -> None:
    x = torch.tensor([-200.0, -104.5, -103.9, -88.0, -20.0, -1e-30, 0.0, 1e-30, 5.0, 88.5, 99.9, 100.5, 300.0] * 8)
    gu = torch.cat((x, torch.ones_like(x)))[None]
    want = F.silu(x) * 1.0
    assert_same(fused.silu_mul(gu)[0], want)
    assert_same(fused.silu_mul(gu.bfloat16())[0], (F.silu(x.bfloat16()) * torch.ones(1, dtype=torch.bfloat16)))



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", NORM_SHAPES[:6])
def test_rms_norm_in_place_on_qkv_columns(dtype, rows, n, native_calls) -> None:
    """MiniMax-M2's / OLMo's whole-row norms, in place on their columns of the fused qkv rows."""
    g = _gen(rows + n)
    qkv = (torch.randn(rows, 3 * n, generator=g) * 2).to(dtype)
    w = torch.randn(n, generator=g).to(dtype)
    want = fused.rms_norm_torch(qkv[:, n:2 * n], w, 1e-6)
    rest = qkv[:, :n].clone(), qkv[:, 2 * n:].clone()
    assert fused.rms_norm_(qkv[:, n:2 * n], w, 1e-6)
    assert_same(qkv[:, n:2 * n], want)
    assert torch.equal(qkv[:, :n], rest[0]) and torch.equal(qkv[:, 2 * n:], rest[1])  # the other columns untouched
    assert native_calls == {"fused_rms_norm_inplace": 1}


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_ops_are_torch_bit_for_bit(dtype, native_calls) -> None:
    """add / scale (by a number, by one factor a row, a division): torch's bits, on rows of a
    contiguous tensor and on strided rows (q's columns of the fused qkv)."""
    g = _gen(9)
    x, y = (torch.randn(37, 300, generator=g) * 3).to(dtype), torch.randn(37, 300, generator=g).to(dtype)
    assert torch.equal(fused.add(x, y), x + y)
    for s in (0.4, 1.702, 3.0, 0.05):
        assert torch.equal(fused.scale(x, s), x * s)
        assert torch.equal(fused.scale(x, s, divide=True), x / s)
    rows = torch.rand(37, 1, generator=g).to(dtype) + 0.5
    assert torch.equal(fused.scale(x, rows), x * rows)
    qkv = torch.randn(11, 6, 64, generator=g).to(dtype)
    q, qs = qkv[:, :4], (torch.rand(11, 1, 1, generator=g) + 1).to(dtype)
    assert not q.is_contiguous() and torch.equal(fused.scale(q, qs), q * qs)
    assert native_calls == {"fused_elementwise": 11}


@pytest.mark.parametrize("dtype", DTYPES)
def test_sink_scale_is_the_torch_formula(dtype, native_calls) -> None:
    g = _gen(4)
    o = torch.randn(9, 4, 64, generator=g).to(dtype)
    lse, sinks = torch.randn(9, 4, generator=g) * 3, torch.randn(4, generator=g).to(dtype)
    want = (o.float() * torch.sigmoid(lse - sinks.float())[..., None]).to(dtype)
    got = fused.sink_scale(o.clone(), lse, sinks)
    # the factor's exp is libm's, torch's a vector one: an fp32 ulp apart at most, so bf16 results
    # agree bit for bit unless a product sits on a rounding boundary
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-7)
    assert native_calls == {"fused_sink_scale": 1}



@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_and_gelu_close_to_torch(dtype, native_calls) -> None:
    """StarCoder2's LayerNorm (moments in double) and tanh gelu (libm's tanh): not torch's bits,
    within an fp32 ulp or two of its values (in bf16, one rounding of them); strided rows too."""
    g = _gen(12)
    wide = (torch.randn(33, 400, generator=g) * 3 + 1).to(dtype)
    x = wide[:, 50:350]
    w, b = torch.randn(300, generator=g).to(dtype), torch.randn(300, generator=g).to(dtype)
    tol = dict(rtol=4e-6, atol=4e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(fused.layer_norm(x, w, b, 1e-5).float(), F.layer_norm(x, (300,), w, b, 1e-5).float(), **tol)
    torch.testing.assert_close(fused.gelu_tanh(x).float(), F.gelu(x, approximate="tanh").float(), **tol)
    assert native_calls == {"fused_layer_norm": 1, "fused_gelu_tanh": 1}

def test_elementwise_fallbacks(native_calls) -> None:
    """Broadcasting, autograd and mixed dtypes take torch (no kernel call)."""
    x = torch.randn(4, 8)
    assert torch.equal(fused.add(x, torch.ones(8)), x + 1)
    w = torch.randn(4, 8, requires_grad=True)
    assert fused.scale(w, 2.0).requires_grad
    assert torch.equal(fused.scale(x, torch.ones(4, 1, dtype=torch.bfloat16)), x * torch.ones(4, 1, dtype=torch.bfloat16))
    assert native_calls == {}

def test_portable_build_is_exact_too(tmp_path, monkeypatch) -> None:
    """The C file built without -march=native (no AVX512: the scalar loops and the scalar Sleef
    port, as on another CPU) gives the same bits."""
    import ctypes
    import os
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    out = str(tmp_path / "fused_portable.so")
    flags = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-mno-avx512f"]
    src = os.path.join(build.SRC_DIR, "fused_ops.c")
    r = subprocess.run([cc, *flags, src, "-o", out, "-lm"], check=False, capture_output=True, text=True)
    if r.returncode != 0:  # a compiler without the x86 flag
        r = subprocess.run([cc, *flags[:-1], src, "-o", out, "-lm"], check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lib = ctypes.CDLL(out)
    build.declare(lib, [name for name in build.SIGNATURES if name.startswith("fused_")])
    calls: dict[str, int] = {}
    use_library(monkeypatch, _Counting(lib, calls))
    for dtype in DTYPES:
        g = _gen(9)
        x = (torch.randn(33, 1000, generator=g) * 3).to(dtype)
        d, w = torch.randn(33, 1000, generator=g).to(dtype), torch.randn(1000, generator=g).to(dtype)
        x_new, y = fused.add_rms_norm(x, d, w, 1e-6)
        assert_same(x_new, x + d)
        assert_same(y, fused.rms_norm_torch(x + d, w, 1e-6))
        qkv, qw, kw, cos, sin = _qkv_case(dtype, 33, 4, 2, 64)
        want = _torch_qk_norm_rope(qkv, 4, 2, 64, qw, kw, 1e-6, cos, sin)
        for got, ref in zip(fused.qk_norm_rope(qkv.clone(), 4, 2, 64, qw, kw, 1e-6, cos, sin), want):
            assert_same(got.contiguous(), ref.contiguous())
        gu = (torch.randn(7, 2 * 6001, generator=g) * 4).to(dtype)
        assert_same(fused.silu_mul(gu), F.silu(gu[:, :6001]) * gu[:, 6001:])
    assert calls == {"fused_rms_norm": 2, "fused_qk_norm_rope": 2, "fused_silu_mul": 2}


# ---- fallbacks -----------------------------------------------------------------------------


def test_no_library_takes_the_torch_path(no_library) -> None:
    g = _gen(3)
    x, d, w = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g), torch.randn(64, generator=g)
    assert torch.equal(fused.rms_norm(x, w, 1e-6), fused.rms_norm_torch(x, w, 1e-6))
    x_new, y = fused.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(x_new, x + d) and torch.equal(y, fused.rms_norm_torch(x + d, w, 1e-6))
    qkv, qw, kw, cos, sin = _qkv_case(torch.float32, 3, 4, 2, 16)
    before = qkv.clone()
    got = fused.qk_norm_rope(qkv, 4, 2, 16, qw, kw, 1e-6, cos, sin)
    assert torch.equal(qkv, before)  # the torch path does not write into qkv
    for a, b in zip(got, _torch_qk_norm_rope(before, 4, 2, 16, qw, kw, 1e-6, cos, sin)):
        assert torch.equal(a, b)
    gu = torch.randn(3, 64, generator=g)
    assert torch.equal(fused.silu_mul(gu), F.silu(gu[:, :32]) * gu[:, 32:])


def test_autograd_takes_the_torch_path(native_calls) -> None:
    g = _gen(4)
    w = torch.randn(64, generator=g).requires_grad_()
    x = torch.randn(4, 64, generator=g).requires_grad_()
    d = torch.randn(4, 64, generator=g)
    y = fused.rms_norm(x, w, 1e-6)
    x_new, y2 = fused.add_rms_norm(x, d, w, 1e-6)
    gu = torch.randn(4, 64, generator=g).requires_grad_()
    s = fused.silu_mul(gu)
    qkv, qw, kw, cos, sin = _qkv_case(torch.float32, 3, 4, 2, 16)
    qkv.requires_grad_()
    q, k, v = fused.qk_norm_rope(qkv, 4, 2, 16, qw, kw, 1e-6, cos, sin)
    (y.sum() + y2.sum() + x_new.sum() + s.sum() + q.sum() + k.sum() + v.sum()).backward()
    assert x.grad is not None and w.grad is not None and gu.grad is not None and qkv.grad is not None
    assert native_calls == {}
    with torch.no_grad():  # the same tensors without autograd recording: native
        assert_same(fused.rms_norm(x, w, 1e-6), y.detach())
    assert native_calls == {"fused_rms_norm": 1}


def test_unsupported_inputs_take_the_torch_path(native_calls) -> None:
    g = _gen(5)
    w = torch.randn(64, generator=g)
    x16 = torch.randn(4, 64, generator=g).half()
    assert torch.equal(fused.rms_norm(x16, w.half(), 1e-6), fused.rms_norm_torch(x16, w.half(), 1e-6))
    x = torch.randn(4, 64, generator=g)
    assert torch.equal(fused.rms_norm(x, w.bfloat16(), 1e-6), fused.rms_norm_torch(x, w.bfloat16(), 1e-6))
    xt = torch.randn(64, 4, generator=g).t()  # inner stride != 1
    assert torch.equal(fused.rms_norm(xt, w, 1e-6), fused.rms_norm_torch(xt, w, 1e-6))
    x3 = torch.randn(4, 3, 128, generator=g)[:, :, :64]  # 3-d, not contiguous
    assert torch.equal(fused.rms_norm(x3, w, 1e-6), fused.rms_norm_torch(x3, w, 1e-6))
    assert native_calls == {}


# ---- the engine ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_outputs_identical_with_and_without_fused_kernels(tmp_path, monkeypatch, dtype) -> None:
    from cuttle.engine import LLM, SamplingParams
    from helpers import make_checkpoint, parity_prompts

    make_checkpoint(str(tmp_path), "qwen3")
    prompts = parity_prompts()[:4]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)

    def run():
        outs = LLM(str(tmp_path), dtype=dtype, num_kv_blocks=64, attention_backend="torch").generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]) for o in outs]

    calls: dict[str, int] = {}
    use_library(monkeypatch, _Counting(native.kernels().lib, calls))
    with_fused = run()
    assert set(calls) == {"fused_rms_norm", "fused_qk_norm_rope", "fused_silu_mul"}, calls
    use_library(monkeypatch, None)
    plain = run()
    assert with_fused == plain  # token ids and logprobs, exactly
