"""The Triton kernels equal the torch backend in the Triton interpreter (float32 within 1e-4,
float16 within 4e-3 of a float32 reference on the same rounded inputs), never read an unwritten
cache slot, and write K/V exactly; their log-sum-exp equals the naive oracle's (float32 within
1e-5); segmented steps (segment_cases.py: documents merged by the log-sum-exp, some moved by a
RoPE offset) equal the float64 oracle (o and lse: float32 within 1e-5, float16 within 4e-3), also
under sliding windows measured by position. On a
CUDA machine the compiled kernels are held to the same bounds (bf16 within 2e-2).

The kernels run in subprocesses (triton_worker.py) because TRITON_INTERPRET=1 must be set before
triton is imported; this pytest process never imports triton, so nothing leaks into other tests.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attention_cases import CASES, Case
from segment_cases import SEG_CASES, SegCase

HERE = Path(__file__).parent
TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 2e-2}
SEG_TOLERANCE = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 2e-2}
Results = dict[tuple, dict[str, object]]


def _python(args: list[str], interpret: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, *args], cwd=HERE, env=env, capture_output=True, text=True, timeout=600)


def _worker(cuda: bool) -> Results:
    proc = _python([str(HERE / "triton_worker.py"), *(["--cuda"] if cuda else [])], interpret=not cuda)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {(row["case"], row["dtype"], *((row["window"],) if "window" in row else ())): row for row in rows}


@pytest.fixture(scope="module")
def interpreted() -> Results:
    return _worker(cuda=False)


@pytest.fixture(scope="module")
def compiled() -> Results:
    return _worker(cuda=True)


def _check(row: dict[str, object], dtype: str) -> None:
    assert row["shape_ok"]
    assert row["cache_exact"], "K/V not written exactly into their slots"
    assert row["err_vs_torch"] <= TOLERANCE[dtype], row  # NaN (an unwritten slot was read) fails too
    if dtype == "float32":
        assert row["err_vs_naive"] <= 1e-4, row


def _check_segments(row: dict[str, object], dtype: str) -> None:
    assert row["segments"] and row["shape_ok"] and row["cache_exact"], row
    assert row["err_vs_oracle"] <= SEG_TOLERANCE[dtype], row  # NaN (an unwritten slot was read) fails too
    assert row["lse_err_vs_oracle"] <= SEG_TOLERANCE[dtype], row


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_interpreted_matches_torch_backend(interpreted: Results, case: Case, dtype: str) -> None:
    _check(interpreted[(case.name, dtype)], dtype)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_interpreted_lse_matches_naive(interpreted: Results, case: Case) -> None:
    row = interpreted[(case.name, "float32")]
    assert row["lse_err_vs_naive"] <= 1e-5, row


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", SEG_CASES, ids=lambda c: c.name)
def test_triton_interpreted_segments_match_oracle(interpreted: Results, case: SegCase, dtype: str) -> None:
    _check_segments(interpreted[(case.name, dtype)], dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_compiled_matches_torch_backend(compiled: Results, case: Case, dtype: str) -> None:
    _check(compiled[(case.name, dtype)], dtype)
    if dtype == "float32":
        assert compiled[(case.name, dtype)]["lse_err_vs_naive"] <= 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", SEG_CASES, ids=lambda c: c.name)
def test_triton_compiled_segments_match_oracle(compiled: Results, case: SegCase, dtype: str) -> None:
    _check_segments(compiled[(case.name, dtype)], dtype)


def test_triton_on_cpu_without_interpreter_fails_clearly() -> None:
    code = (
        "import torch\n"
        "from attention_cases import CASES, build_batch\n"
        "from cuttle.attention.triton_backend import TritonAttentionBackend\n"
        "b = build_batch(CASES[0], junk=0.0)\n"
        "try:\n"
        "    TritonAttentionBackend().forward(0, b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, b.scale)\n"
        "except RuntimeError as e:\n"
        "    print('raised:', e)\n"
    )
    proc = _python(["-c", code], interpret=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "raised:" in proc.stdout and "TRITON_INTERPRET=1" in proc.stdout


def test_triton_kernels_compile_for_sm90_within_consumer_shared_memory() -> None:
    """Ahead-of-time compile (no GPU needed): the interpreter does not enforce GPU rules, this does."""
    proc = _python([str(HERE / "triton_compile_worker.py"), "90"], interpret=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 12
    assert max(row["shared"] for row in rows) <= 99 * 1024, rows


@pytest.mark.parametrize("window", [1, 5, 16, 24])
@pytest.mark.parametrize("case", ["gqa_mixed", "mha_prefill", "gqa_decode_split"])
def test_triton_interpreted_sliding_window_matches_the_oracle(interpreted: Results, case: str, window: int) -> None:
    """`set_windows`: a row at p sees keys p - W + 1 .. p (decode splits and prefill tiles whose
    walk starts at their first row's window), float32 within 1e-5 of the windowed oracle; also
    with the blocks before each window given back (NULL_BLOCK entries, their KV NaN), which the
    walk, starting up to block_n - 1 keys early, loads nothing from."""
    row = interpreted[(case, "float32", window)]
    assert row["err_vs_oracle"] <= 1e-5 and row["given_back_err_vs_oracle"] <= 1e-5, row
    # (mha_prefill's sequences start their steps within 5 keys of their first block's end)
    assert row["given_back"] > 0 or case == "mha_prefill" and window > 1 or case == "gqa_mixed" and window == 24


@pytest.mark.parametrize("window", [1, 8, 30])
@pytest.mark.parametrize("case", SEG_CASES, ids=lambda c: c.name)
def test_triton_interpreted_windows_over_segments_match_the_oracle(interpreted: Results, case: SegCase, window: int) -> None:
    """Squid's documents under a window: each part's keys by position (`gaps`), parts wholly
    before a row's window neutral in its merge, decode splits and prefill tiles; float32 within
    1e-5 of the windowed float64 oracle (o and lse)."""
    row = interpreted[(case.name, "float32", window)]
    assert row["err_vs_oracle"] <= 1e-5 and row["lse_err_vs_oracle"] <= 1e-5, row


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [1, 8, 30])
@pytest.mark.parametrize("case", SEG_CASES, ids=lambda c: c.name)
def test_triton_compiled_windows_over_segments_match_the_oracle(compiled: Results, case: SegCase, window: int) -> None:
    row = compiled[(case.name, "float32", window)]
    assert row["err_vs_oracle"] <= 1e-5 and row["lse_err_vs_oracle"] <= 1e-5, row


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [1, 5, 16, 24])
@pytest.mark.parametrize("case", ["gqa_mixed", "mha_prefill", "gqa_decode_split"])
def test_triton_compiled_sliding_window_matches_the_oracle(compiled: Results, case: str, window: int) -> None:
    row = compiled[(case, "float32", window)]
    assert row["err_vs_oracle"] <= 1e-5 and row["given_back_err_vs_oracle"] <= 1e-5, row
