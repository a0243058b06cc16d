"""Read in place: attention over blocks that lie in a second pool (HOST_BLOCK ids in the block
tables, whole pool-1 segments) equals attention over the same blocks gathered into one pool.

The native CPU kernel and the plain-torch paths (decode gather, SDPA chunks) must be bit-identical
to their own one-pool runs (only addresses differ) in fp32 and bf16, and the native kernel within
1e-5 (fp32) of the plain-torch oracle; the Triton kernel (interpreter, fp32) likewise, against its
own one-pool run exactly and the torch oracle within 1e-5. A host block without a host pool is
refused, not read.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cuttle.attention.torch_backend as tb
from cuttle.attention import native_attention
from cuttle.attention.metadata import HOST_BLOCK, AttentionMetadata, KVSegment, SeqLayout
from cuttle.attention.torch_backend import TorchAttentionBackend
from read_in_place_cases import BLOCK, build, run

HERE = Path(__file__).parent
needs_native = pytest.mark.skipif(not native_attention.available(), reason="native CPU library did not build")


@needs_native
@pytest.mark.parametrize("segmented", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_reads_host_blocks_in_place(dtype: torch.dtype, segmented: bool) -> None:
    split, joined = build(dtype, segmented)
    o_s, l_s = run(TorchAttentionBackend(), split)
    o_j, l_j = run(TorchAttentionBackend(), build(dtype, segmented)[1])
    assert torch.equal(o_s, o_j) and torch.equal(l_s, l_j)
    if dtype == torch.float32:
        o_r, l_r = run(TorchAttentionBackend(native=False), joined)
        assert (o_s - o_r).abs().max().item() <= 1e-5
        assert (l_s - l_r).abs().max().item() <= 1e-5


@pytest.mark.parametrize("segmented", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sdpa", [False, True])
def test_torch_paths_read_host_blocks(dtype: torch.dtype, segmented: bool, sdpa: bool, monkeypatch) -> None:
    if sdpa:  # every chunk of more than one token through SDPA, decode rows through the native kernel
        monkeypatch.setattr(tb, "NATIVE_PREFILL_MAX_QLEN", 1)
    split, joined = build(dtype, segmented)
    backend = TorchAttentionBackend(native=sdpa)  # sdpa: native decode rows, SDPA chunks
    o_s, l_s = run(backend, split)
    o_j, l_j = run(TorchAttentionBackend(native=sdpa), joined)
    assert torch.equal(o_s, o_j) and torch.equal(l_s, l_j)


@needs_native
def test_host_block_without_host_pool_is_refused() -> None:
    split, _ = build(torch.float32, False)
    kc, vc = split.kv[0]
    q = split.q[:1]
    out = torch.empty_like(q)
    table = torch.tensor([[0, 1 | HOST_BLOCK]], dtype=torch.int32)
    rows = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="host block"):
        native_attention.paged_attention_rows(q, kc, vc, out, None, rows, rows, table,
                                              torch.tensor([8], dtype=torch.int32), 1.0)


def test_metadata_refuses_host_writes_and_missing_pool() -> None:
    with pytest.raises(ValueError, match="host_kv"):
        AttentionMetadata.build([SeqLayout(1, [KVSegment([1 | HOST_BLOCK, 2], 6, causal=True)])], BLOCK, "cpu")
    host = [(torch.zeros(4, BLOCK, 2, 16), torch.zeros(4, BLOCK, 2, 16))]
    with pytest.raises(ValueError, match="written into a host block"):
        AttentionMetadata.build([SeqLayout(2, [KVSegment([1, 2 | HOST_BLOCK], 7, causal=True)])], BLOCK, "cpu", host_kv=host)
    with pytest.raises(ValueError, match="device pool"):
        AttentionMetadata.build([SeqLayout(1, [KVSegment([1], 3, causal=True, pool=1)])], BLOCK, "cpu", host_kv=host)


def test_triton_kernel_reads_host_blocks_in_place() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "read_in_place_worker.py")], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 4
    for row in rows:
        assert row["finite"], row
        assert row["vs_one_pool"] == 0.0 and row["lse_vs_one_pool"] == 0.0, row
        assert row["vs_torch"] <= 1e-5 and row["lse_vs_torch"] <= 1e-5, row
