"""flashinfer attention backend (CUDA, fp16/bf16): K/V written by the shared `write_kv` scatter,
attention by flashinfer's paged wrappers over the same NHD cache tensors.

Owns the translation of `AttentionMetadata` into flashinfer's CSR page layout (built once per
step, no device sync) and the wrappers' planning, which needs the head counts, dtype and scale the
first layer brings and is then reused by every layer of the step. Never owns cache memory and
never imports flashinfer at module import: `cuttle.attention` must import without it.

A decode-only step uses BatchDecodeWithPagedKVCacheWrapper; any step with a prefill chunk uses
BatchPrefillWithPagedKVCacheWrapper for all of its sequences (a decode row is a 1-token chunk).
flashinfer's causal mask for a chunk shorter than its KV is aligned to the end of the KV, which is
exactly the metadata's offset (new token j sits at `seq_len - query_len + j`). Both wrappers run
with `return_lse=True`; flashinfer's log-sum-exp is base 2, converted here to the natural log the
interface promises. Segmented steps (several KV segments per sequence) are refused for now: they
would need a second, non-causal wrapper over the parts and flashinfer's `merge_state`, which has
not been run on a GPU yet.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from cuttle.attention.backend import write_kv
from cuttle.attention.metadata import AttentionMetadata

WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's documented default float workspace
LN2 = math.log(2.0)  # flashinfer's lse is log2-sum-exp2 of the scaled scores (log2(e) folded in)


@dataclass(slots=True)
class PagedKVLayout:
    """flashinfer's CSR view of the block tables: sequence b's pages are
    `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`, the last one holding `last_page_len[b]` tokens."""

    meta: AttentionMetadata
    qo_indptr: torch.Tensor  # [B+1] int32, host: flashinfer's plan reads it on the host anyway
    kv_indptr: torch.Tensor  # [B+1] int32, host
    kv_indices: torch.Tensor  # [total pages] int32, on the cache's device
    last_page_len: torch.Tensor  # [B] int32, host, in 1..block_size


def paged_kv_layout(meta: AttentionMetadata) -> PagedKVLayout:
    bs = meta.block_size
    seq_lens = torch.tensor(meta.seq_lens_cpu, dtype=torch.int32)
    num_pages = (seq_lens + bs - 1) // bs
    kv_indptr = torch.zeros(meta.num_seqs + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(num_pages, 0)
    qo_indptr = torch.zeros(meta.num_seqs + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.cumsum(torch.tensor(meta.query_lens_cpu, dtype=torch.int32), 0)
    # Gather the used prefix of every table row with host-built indices: no mask, no device sync.
    total = int(kv_indptr[-1])
    rows = torch.repeat_interleave(torch.arange(meta.num_seqs), num_pages.long(), output_size=total)
    cols = torch.arange(total) - kv_indptr[rows].long()
    device = meta.block_tables.device
    kv_indices = meta.block_tables[rows.to(device), cols.to(device)].to(torch.int32)
    last_page_len = seq_lens - (num_pages - 1) * bs
    return PagedKVLayout(meta, qo_indptr, kv_indptr, kv_indices, last_page_len)


class FlashInferAttentionBackend:
    name = "flashinfer"
    takes_segments = False  # segmented steps are refused (forward, below)

    def __init__(self, device: torch.device, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        if device.type != "cuda":
            raise ValueError(f"the flashinfer attention backend needs a CUDA device, got {device}")
        try:
            import flashinfer
        except ImportError as e:
            raise ImportError(
                "attention_backend='flashinfer' needs the flashinfer package "
                "(pip install flashinfer-python, or the 'cuda' extra); 'triton' works without it"
            ) from e
        self._flashinfer: Any = flashinfer
        # One workspace for both wrappers: a step plans and runs only one of them.
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode: Any = None  # built at the first decode plan: its kernel choice needs the group size
        self._decode_tensor_cores: bool | None = None
        self._layout: PagedKVLayout | None = None
        self._planned: tuple[Any, ...] | None = None

    def begin_step(self, meta: AttentionMetadata) -> None:
        self._layout = paged_kv_layout(meta)
        self._planned = None

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if meta.segments is not None:
            raise NotImplementedError(
                "the flashinfer backend does not take segmented steps (several KV segments per sequence) yet; "
                "use attention_backend='triton' or 'torch'"
            )
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"flashinfer attention runs in float16/bfloat16, got {q.dtype}; use 'triton' or 'torch'")
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if self._layout is None or self._layout.meta is not meta:
            self.begin_step(meta)
        key = (q.shape[1], k_cache.shape[2], q.shape[2], q.dtype, k_cache.dtype, scale)
        if self._planned != key:
            self._plan(*key)
            self._planned = key
        wrapper = self._decode if meta.is_decode_only else self._prefill
        out, lse2 = wrapper.run(q.contiguous(), (k_cache, v_cache), return_lse=True)
        return out, lse2.float() * LN2

    def _plan(
        self, num_heads: int, num_kv_heads: int, head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, scale: float
    ) -> None:
        layout = self._layout
        assert layout is not None
        meta = layout.meta
        if meta.is_decode_only:
            # Tensor-core decode pays off once several query heads share a KV head.
            tensor_cores = num_heads // num_kv_heads >= 4
            if self._decode is None or self._decode_tensor_cores != tensor_cores:
                self._decode = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=tensor_cores
                )
                self._decode_tensor_cores = tensor_cores
            self._decode.plan(
                layout.kv_indptr, layout.kv_indices, layout.last_page_len,
                num_qo_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=meta.block_size,
                pos_encoding_mode="NONE", q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=scale,
            )
        else:
            self._prefill.plan(
                layout.qo_indptr, layout.kv_indptr, layout.kv_indices, layout.last_page_len,
                num_qo_heads=num_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim, page_size=meta.block_size,
                causal=True, pos_encoding_mode="NONE", sm_scale=scale, q_data_type=q_dtype, kv_data_type=kv_dtype,
            )
