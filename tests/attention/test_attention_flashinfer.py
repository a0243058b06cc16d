"""flashinfer backend: the CSR page layout it plans from (checked here on CPU), a clear error where
it cannot run, and its output and log-sum-exp (converted from flashinfer's base 2) against the
torch backend (only on CUDA with flashinfer installed)."""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from attention_cases import CASES, Case, build_batch, cache_matches
from cuttle.attention.flashinfer_backend import FlashInferAttentionBackend, paged_kv_layout
from cuttle.attention.torch_backend import TorchAttentionBackend

HAS_FLASHINFER = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_paged_kv_layout_lists_each_sequences_pages(case: Case) -> None:
    meta = build_batch(case, junk=0.0).meta
    layout = paged_kv_layout(meta)
    bs = meta.block_size
    assert layout.qo_indptr.tolist() == meta.query_start_loc.tolist()
    for b, seq_len in enumerate(meta.seq_lens_cpu):
        pages = layout.kv_indices[layout.kv_indptr[b] : layout.kv_indptr[b + 1]].tolist()
        assert pages == meta.block_tables[b, : -(-seq_len // bs)].tolist()
        assert 1 <= layout.last_page_len[b] <= bs
        assert (len(pages) - 1) * bs + int(layout.last_page_len[b]) == seq_len
    assert layout.kv_indices.dtype == torch.int32 and layout.qo_indptr.dtype == torch.int32


def test_flashinfer_backend_refuses_cpu() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        FlashInferAttentionBackend(torch.device("cpu"))


@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_flashinfer_matches_torch_backend(case: Case, dtype: torch.dtype) -> None:
    # flashinfer ships kernels for the head sizes real models use; the small test sizes become 64.
    if case.head_dim not in (64, 128):
        case = dataclasses.replace(case, head_dim=64)
    batch = build_batch(case, junk=None, dtype=dtype)
    ref_backend = TorchAttentionBackend()
    ref_backend.begin_step(batch.meta)
    ref, ref_lse = ref_backend.forward(
        0,
        batch.q.float(), batch.k.float(), batch.v.float(), batch.k_cache.float(), batch.v_cache.float(),
        batch.meta, batch.scale,
    )
    gpu = build_batch(case, junk=float("nan"), dtype=dtype).to(torch.device("cuda"))
    backend = FlashInferAttentionBackend(torch.device("cuda"))
    backend.begin_step(gpu.meta)
    out, lse = backend.forward(0, gpu.q, gpu.k, gpu.v, gpu.k_cache, gpu.v_cache, gpu.meta, gpu.scale)
    assert out.shape == gpu.q.shape and out.dtype == dtype
    assert cache_matches(gpu)
    assert (out.float().cpu() - ref).abs().max().item() <= 2e-2
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert (lse.cpu() - ref_lse).abs().max().item() <= 2e-2
