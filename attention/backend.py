"""The one attention-backend interface and the choice among its implementations.

A backend writes this step's K/V into a layer's paged cache and computes attention for the
flattened batch described by `AttentionMetadata` (one causal segment per sequence, or several
segments merged by their log-sum-exp). KV cache of one layer: `k_cache`, `v_cache`, each
`[num_blocks, block_size, num_kv_heads, head_dim]` (flashinfer's NHD layout). Backends are
stateless apart from per-step planning; they never own cache memory.

Every backend returns `(o, lse)`: `o` [T, num_heads, head_dim] in q's dtype and `lse`
[T, num_heads] float32, the natural-log log-sum-exp of the scaled scores of the keys each row
attended to (-inf for a row that saw no key), so results over disjoint key sets merge exactly
(`merge.py`). `layer` names the model layer the call serves: the host tier's caches
(`meta.host_kv[layer]`) and the sparse backends' per-layer side caches hang on it.
"""
from __future__ import annotations

from typing import Protocol

import torch

from cuttle.attention.metadata import HOST_BLOCK, AttentionMetadata
from cuttle.attention.native import rows


class AttentionBackend(Protocol):
    name: str
    # whether it takes segmented steps (`meta.segments`: squid documents, shared prefixes); the
    # engine refuses documents at admission beside one that does not
    takes_segments: bool

    def begin_step(self, meta: AttentionMetadata) -> None:
        """Called once per model step before the layers run (planning shared by all layers)."""

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, num_heads, head_dim], RoPE applied at the rows' absolute positions
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, num_heads, head_dim], lse [T, num_heads] fp32
        ...


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V rows into their cache slots (natively on CPU: `native.rows`)."""
    rows.scatter_(k_cache.view(-1, *k_cache.shape[2:]), slot_mapping, k if k.dtype == k_cache.dtype else k.to(k_cache.dtype))
    rows.scatter_(v_cache.view(-1, *v_cache.shape[2:]), slot_mapping, v if v.dtype == v_cache.dtype else v.to(v_cache.dtype))


def gather_pools(dev: torch.Tensor, host: torch.Tensor | None, idx: torch.Tensor, host_base: int) -> torch.Tensor:
    """dev[idx] where rows at or above `host_base` come from host[idx - host_base]: the torch paths'
    gather over both pools when a table names host blocks (read in place). A row index computed
    from a `HOST_BLOCK` id as from any other (id * rows_per_block + row) lands at or above
    host_base = HOST_BLOCK * rows_per_block, so callers need no pool logic of their own. With no
    such row (host None) this is dev[idx]."""
    if host is None:
        return dev[idx]
    on_host = idx >= host_base
    out = dev[idx.masked_fill(on_host, 0)]
    if bool(on_host.any()):
        out[on_host] = host[idx[on_host] - host_base].to(out.device)
    return out


class PoolRows:
    """One layer's caches of both pools as flat row tensors, gathered by row index: `rows(name,
    idx)` is `gather_pools(dev[name], host[name], idx, HOST_BLOCK * rows_per_block[name])`. The
    sparse backends' torch paths (compression windows, summaries, the reference) read through it,
    so a table naming host blocks needs no branch of theirs. dev / host: name -> tensor whose first
    dims are (blocks, rows a block) (host None: no host block this step); the rest is a row."""

    __slots__ = ("dev", "host", "base")

    def __init__(self, dev: dict[str, torch.Tensor], host: dict[str, torch.Tensor] | None) -> None:
        self.dev = {n: t.flatten(0, 1) for n, t in dev.items()}
        self.host = None if host is None else {n: t.flatten(0, 1) for n, t in host.items()}
        self.base = {n: HOST_BLOCK * t.shape[1] for n, t in dev.items()}

    def __call__(self, name: str, idx: torch.Tensor) -> torch.Tensor:
        return gather_pools(self.dev[name], None if self.host is None else self.host[name], idx, self.base[name])


BACKENDS = ("auto", "torch", "triton", "flashinfer")


def rows_as_decode_rows(meta: AttentionMetadata, seqs: list[tuple[int, int, int, int]], tables: torch.Tensor | None = None,
                        full: list[bool] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every query row of the given sequences as a decode row of its own, for the native sparse
    kernels (NSA, top-k), whose rule is per position: seqs holds (sequence index, first row,
    rows, keys after the step); row j of a sequence with c cached keys sees c + j + 1 keys.
    Returns the rows (int64), each row's block table (int32 [rows, blocks]) and key count (int32).
    `tables` (default: meta.block_tables) is indexed by the first field; `full[i]` (a squid part
    whose keys are all visible: a prefix or a document) gives every row of seqs[i] all its keys."""
    rows: list[int] = []
    seq_of_row: list[int] = []
    lens: list[int] = []
    for i, (b, start, qlen, num_keys) in enumerate(seqs):
        rows.extend(range(start, start + qlen))
        seq_of_row.extend([b] * qlen)
        lens.extend([num_keys] * qlen if full is not None and full[i] else range(num_keys - qlen + 1, num_keys + 1))
    nblocks = -(-max(lens) // meta.block_size)
    source = meta.block_tables if tables is None else tables
    tables = source[torch.tensor(seq_of_row), :nblocks].to(torch.int32).contiguous()
    return torch.tensor(rows, dtype=torch.int64), tables, torch.tensor(lens, dtype=torch.int32)


def get_backend(name: str, device: torch.device, dtype: torch.dtype | None = None) -> AttentionBackend:
    """Resolve a backend name; 'auto' means flashinfer on CUDA when installed, else triton on CUDA, else torch.
    A backend that cannot run on `device` / `dtype` is refused here, before any step (an engine
    built on it used to start, report healthy, and fail every request)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        if device.type == "cuda":
            try:
                import flashinfer  # noqa: F401

                name = "flashinfer"
            except ImportError:
                name = "triton"
        else:
            name = "torch"
    if name == "torch":
        from cuttle.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from cuttle.attention.triton_backend import TritonAttentionBackend

        TritonAttentionBackend.check_runs_on(device, dtype)
        return TritonAttentionBackend()
    from cuttle.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(device)
