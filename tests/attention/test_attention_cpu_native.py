"""The native CPU decode kernel (attention/csrc/paged_decode.c) against the naive float64 oracle and
against the plain-torch path of the same backend, in fp32 and bf16, over the shared cases plus
batches large and small enough to take both work splits (whole sequences / heads split)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from attention_cases import CASES, Case, build_batch, naive_attention
from cuttle.attention import native, native_attention, torch_backend
from cuttle.attention.torch_backend import TorchAttentionBackend

EXTRA = (
    Case("many_decodes", tuple((int(n), 1) for n in torch.randint(0, 90, (40,), generator=torch.Generator().manual_seed(3))), 8, 4, 64, 16),
    Case("one_decode_long", ((300, 1),), 16, 8, 128, 16),
    Case("decode_with_prefill", ((0, 9), (47, 1), (12, 1), (30, 5)), 4, 2, 32, 8),
    # a short chunk over a long cached context (32 rows x 3032 keys): SDPA's, the decode row native
    Case("chunk_on_long_context", ((3000, 32), (40, 1)), 4, 2, 64, 16),
)


@pytest.fixture(scope="module", autouse=True)
def kernels_built() -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the native kernel cannot build here")
    assert native_attention.available(), "a compiler is present, so the kernel must build"


def _run(backend: TorchAttentionBackend, batch) -> torch.Tensor:
    backend.begin_step(batch.meta)
    return backend.forward(0, batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale)[0]


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts native decode calls, so a test fails if the backend silently took the torch path."""
    calls: list[int] = []
    real = native_attention.paged_attention_rows

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(native_attention, "paged_attention_rows", counted)
    return calls


def _native_rows(cached: int, new: int) -> bool:
    """The backend's routing rule: decode rows, and short chunks whose rows read few keys in all."""
    return new == 1 or (new <= torch_backend.NATIVE_PREFILL_MAX_QLEN
                        and new * (cached + new) <= torch_backend.NATIVE_PREFILL_MAX_KEY_READS)


def _has_decode(case: Case) -> bool:
    """Whether the native kernel has rows in this case: decodes and short prefill chunks."""
    return any(_native_rows(cached, new) for cached, new in case.seqs)


def test_a_chunk_over_a_long_context_goes_to_sdpa_and_a_decode_row_stays_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native kernel reads each row's keys on its own, so a chunk over a long cached context
    (a resumed 64-token turn on a 4k history) would read the history once per row: SDPA takes it."""
    assert not _native_rows(4000, 64) and _native_rows(4000, 1) and _native_rows(0, 128)
    given: list[int] = []
    real = native_attention.paged_attention_rows

    def recorded(*args, **kwargs):
        given.append(args[5].numel())  # the query rows the kernel computes
        return real(*args, **kwargs)

    monkeypatch.setattr(native_attention, "paged_attention_rows", recorded)
    case = Case("chunk_and_decode", ((3000, 32), (40, 1), (10, 6)), 4, 2, 64, 16)
    batch = build_batch(case, junk=None)
    err = (_run(TorchAttentionBackend(native=True), batch).double() - naive_attention(batch)).abs().max().item()
    assert err <= 1e-5, err
    assert given == [1 + 6]  # the decode row and the short chunk on a short context; not the 32 rows


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


def test_native_kernel_disabled_by_env() -> None:
    code = (
        "from cuttle.attention.torch_backend import TorchAttentionBackend\n"
        "from cuttle.attention import native_attention\n"
        "assert not native_attention.available() and not TorchAttentionBackend().native\n"
        "print('ok')\n"
    )
    env = {**os.environ, "CUTTLE_CPU_KERNELS": "0"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# The vectorised bf16 path (head_dim 64/128/256, AVX512-BF16 or AVX2 + FMA): Qwen3-0.6B's shape at batch 40,
# rows per item above 16 (the 16-row score chunks, masked), MQA, groups of 3 and of 1, heads split
# across threads (one sequence), partial last blocks everywhere.
FAST_CASES = (
    Case("qwen3_0.6b_batch40", tuple((int(n), 1) for n in torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(5))), 16, 8, 128, 16),
    Case("rows20_mha_d64", ((33, 1), (0, 1), (70, 1)), 20, 20, 64, 16),
    Case("mqa_group4_d64", ((17, 1), (64, 1)), 4, 1, 64, 8),
    Case("group3_d256", ((40, 1), (9, 1), (1, 1)), 6, 2, 256, 16),
    Case("one_seq_heads_split_d128", ((500, 1),), 32, 8, 128, 16),
    Case("with_prefill_rows_d128", ((0, 7), (47, 1), (30, 4), (12, 1)), 8, 4, 128, 16),
)


def _bf16_batch(case: Case):
    """A bf16 batch whose oracle K/V/q are the bf16-rounded values the kernel reads."""
    batch = build_batch(case, junk=None, dtype=torch.bfloat16)
    batch.full_k = [t.bfloat16().float() for t in batch.full_k]
    batch.full_v = [t.bfloat16().float() for t in batch.full_v]
    return batch


@pytest.mark.parametrize("case", FAST_CASES, ids=lambda c: c.name)
def test_fast_bf16_decode_matches_naive_and_scalar_path(case: Case, kernel_calls: list[int]) -> None:
    lib = native.kernels().lib
    flags = set(next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split())
    if "avx512_bf16" not in flags and not {"avx2", "fma"} <= flags:
        pytest.skip("the fast bf16 path needs AVX512-BF16 or AVX2 + FMA")
    ref = naive_attention(_bf16_batch(case))
    # every row is the kernel's: decodes and (short) prefill chunks alike
    rows = torch.ones(sum(new for _, new in case.seqs), dtype=torch.bool)
    outs = {}
    try:
        for fast in (1, 0):
            lib.paged_decode_set_fast_path(fast)
            out = _run(TorchAttentionBackend(native=True), _bf16_batch(case))
            assert out.dtype == torch.bfloat16 and lib.paged_decode_last_call_fast() == fast
            outs[fast] = out.double()
    finally:
        lib.paged_decode_set_fast_path(1)
    assert len(kernel_calls) == 2
    for fast, out in outs.items():
        # fp32 math from bf16 inputs, output rounded to bf16 once: within one bf16 ulp of float64
        err = ((out - ref).abs() / ref.abs().clamp_min(1.0))[rows].max().item()
        assert err <= 2 ** -8, (fast, err)
    # the two paths sum in different orders; after rounding they differ by at most one ulp
    assert ((outs[1] - outs[0]).abs() <= 2 ** -7 * outs[0].abs().clamp_min(1.0))[rows].all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_prefill_rows_beside_sdpa_chunks(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, kernel_calls: list[int]) -> None:
    """With the native prefill limit at 8 tokens, chunks of 1, 5 and 8 rows (fresh and after a cached
    prefix) go through the kernel and chunks of 9 and 30 through SDPA in the same step: all match
    the float64 oracle."""
    monkeypatch.setattr(torch_backend, "NATIVE_PREFILL_MAX_QLEN", 8)
    case = Case("mixed_native_sdpa", ((0, 5), (20, 8), (13, 1), (0, 9), (7, 30), (40, 1)), 8, 2, 128, 16)
    batch = _bf16_batch(case) if dtype == torch.bfloat16 else build_batch(case, junk=None)
    out = _run(TorchAttentionBackend(native=True), batch).double()
    ref = naive_attention(batch)
    assert len(kernel_calls) == 1
    tol = 2 ** -8 if dtype == torch.bfloat16 else 1e-5
    err = ((out - ref).abs() / ref.abs().clamp_min(1.0)).max().item()
    assert err <= tol, err


# Items of at most 8 query rows (a KV head or two of GQA: batch-1 and small-batch decode) lay their
# scores out row-major; the token-major layout must give the same bits. Block sizes 4 / 16 / 32,
# lengths of one token, under 16, a multiple of 16 and ragged, groups of 1, 2 and 4.
ROW_MAJOR_CASES = (
    Case("b1_group2_d64_bs16", ((200, 1),), 8, 4, 64, 16),
    Case("b1_group2_d128_bs4", ((37, 1),), 16, 8, 128, 4),
    Case("b2_group4_d64_bs32", ((63, 1), (64, 1)), 8, 2, 64, 32),
    Case("b3_group1_d256", ((0, 1), (15, 1), (16, 1)), 4, 4, 256, 16),
    Case("b1_prefill_rows_d128", ((40, 5),), 8, 4, 128, 16),
)


@pytest.mark.parametrize("case", ROW_MAJOR_CASES + FAST_CASES, ids=lambda c: c.name)
def test_row_major_items_give_the_token_major_bits(case: Case, kernel_calls: list[int]) -> None:
    lib = native.kernels().lib
    flags = set(next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split())
    if "avx512_bf16" not in flags:
        pytest.skip("the row-major items are on the AVX512-BF16 path")
    ref = naive_attention(_bf16_batch(case))
    outs = {}
    try:
        for rm in (1, 0):
            for pf in (1, 0):  # the walks' block prefetches (on by default) change nothing either
                lib.paged_decode_set_row_major(rm)
                lib.paged_decode_set_prefetch(pf)
                outs[rm, pf] = _run(TorchAttentionBackend(native=True), _bf16_batch(case))
                assert lib.paged_decode_last_call_fast() == 1
    finally:
        lib.paged_decode_set_row_major(1)
        lib.paged_decode_set_prefetch(1)
    assert torch.equal(outs[1, 1], outs[0, 1]) and torch.equal(outs[1, 1], outs[1, 0]) and torch.equal(outs[0, 1], outs[0, 0])
    outs = {rm: outs[rm, 1] for rm in (1, 0)}
    rows = torch.ones(sum(new for _, new in case.seqs), dtype=torch.bool)
    err = ((outs[1].double() - ref).abs() / ref.abs().clamp_min(1.0))[rows].max().item()
    assert err <= 2 ** -8, err


def test_a_sequence_with_no_new_token_among_decodes_stays_in_bounds(kernel_calls: list[int]) -> None:
    """A decode step in which one sequence brings no token (max query length 1, but fewer query
    rows than sequences) must not take the one-row-per-sequence path (its rows would name q / out
    rows past the step's tokens): each real row still matches the float64 oracle."""
    case = Case("decode_with_empty_row", ((20, 1), (9, 0), (33, 1), (4, 1)), 8, 4, 64, 16)
    batch = build_batch(case, junk=None)
    assert batch.q.shape[0] == 3 and batch.meta.num_seqs == 4
    out = _run(TorchAttentionBackend(native=True), batch).double()
    ref = naive_attention(batch)
    assert len(kernel_calls) == 1
    assert ((out - ref).abs() / ref.abs().clamp_min(1.0)).max().item() <= 1e-5
