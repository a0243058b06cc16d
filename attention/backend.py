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

Also here, shared by the backends: `write_kv`, the gathers over both pools (`gather_pools`,
`PoolRows`), and for the sparse backends (NSA, top-k) the units a step attends (`SparseUnits`:
sequences or squid parts, and the decode rows of their native kernels, `rows_as_decode_rows`).
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


def key_slots(table: torch.Tensor, keys: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots of key indices `keys` (any shape) of a sequence with block table `table` [nb] int64."""
    return table[keys // block_size] * block_size + keys % block_size


class SparseUnits:
    """What a sparse backend (NSA, top-k) attends in one step, and the rows its native kernel
    takes: the base of their step plans. A unit is a sequence (its query rows over its causal
    keys) or, in a segmented step (squid: a prefix and documents beside the own tokens), a part
    (`SegmentBatch`: one per sequence and segment, virtual query rows over the part's table), each
    attended under the backend's rule on its own keys and merged by the log-sum-exp afterwards.

    seqs: per unit (first row, rows, keys, block table [nb] int64); full: per part, whether every
    key is visible (a prefix or a document: its rows all sit at its last key), None without
    segments; native_seqs / torch_seqs: the units on the native kernel (every query row a decode
    row with its own key count: the rules are per position) and on the torch reference; an empty
    part (no key) is in neither."""

    __slots__ = ("meta", "seqs", "full", "native_rows", "native_tables", "native_lens", "native_seqs", "torch_seqs",
                 "_row_units")

    def __init__(self, meta: AttentionMetadata, native_rows: bool) -> None:
        self.meta = meta
        bs = meta.block_size
        sb = meta.segments
        if sb is None:
            starts, qlens, lens, tables = meta.query_start_loc.tolist(), meta.query_lens_cpu, meta.seq_lens_cpu, meta.block_tables
            self.full: list[bool] | None = None
        else:
            starts, qlens, lens, tables = sb.query_start_loc.tolist(), sb.query_lens_cpu, sb.kv_lens_cpu, sb.block_tables
            self.full = [not c for c in sb.causal_cpu]
        self.seqs: list[tuple[int, int, int, torch.Tensor]] = [
            (starts[u], qlen, n, tables[u, : -(-n // bs)].long()) for u, (qlen, n) in enumerate(zip(qlens, lens))]
        attended = [u for u in range(len(self.seqs)) if self.seqs[u][2] > 0]
        self.native_seqs = attended if native_rows else []
        self.torch_seqs = [] if native_rows else attended
        self._row_units: tuple[torch.Tensor, torch.Tensor] | None = None
        self.native_rows = self.native_tables = self.native_lens = None
        if self.native_seqs:
            self.native_rows, self.native_tables, self.native_lens = rows_as_decode_rows(
                meta, [(u, *self.seqs[u][:3]) for u in self.native_seqs], tables,
                None if self.full is None else [self.full[u] for u in self.native_seqs])

    def positions(self, u: int, device: torch.device) -> torch.Tensor:
        """The key index of each query row of unit u; a whole part's rows sit at its last key."""
        _, qlen, num_keys, _ = self.seqs[u]
        if self.full is not None and self.full[u]:
            return torch.full((qlen,), num_keys - 1, device=device)
        return torch.arange(num_keys - qlen, num_keys, device=device)

    def row_units(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Every (virtual) query row's unit and key index, int32 [rows] each (-1: a row of an empty
        part, which attends nothing): the Triton sparse kernels' row tables, built once a step
        for every layer."""
        if self._row_units is None:
            rows = sum(qlen for _, qlen, _, _ in self.seqs)
            unit = torch.empty(rows, dtype=torch.int32)
            pos = torch.full((rows,), -1, dtype=torch.int32)
            for u, (start, qlen, num_keys, _) in enumerate(self.seqs):
                unit[start : start + qlen] = u
                if num_keys > 0:
                    pos[start : start + qlen] = self.positions(u, torch.device("cpu")).to(torch.int32)
            self._row_units = (unit.to(device), pos.to(device))
        return self._row_units


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


def resolve_backend_name(name: str, device: torch.device) -> str:
    """The backend a name means on `device` ('auto': flashinfer on CUDA when installed, else triton
    on CUDA, else torch)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name != "auto":
        return name
    if device.type != "cuda":
        return "torch"
    try:
        import flashinfer  # noqa: F401

        return "flashinfer"
    except ImportError:
        return "triton"


# the backends that attend a model's sliding windows (`set_windows`); on the others an engine
# serves such a model within its window
WINDOWED_BACKENDS = ("torch", "triton")


def checked_windows(windows: dict[int, int]) -> dict[int, int]:
    """A backend's `set_windows` argument (layer id -> W), checked: each W a positive integer."""
    if any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in windows.values()):
        raise ValueError(f"sliding windows must be positive integers, got {windows!r}")
    return dict(windows)


def get_backend(name: str, device: torch.device, dtype: torch.dtype | None = None) -> AttentionBackend:
    """Resolve a backend name; 'auto' means flashinfer on CUDA when installed, else triton on CUDA, else torch.
    A backend that cannot run on `device` / `dtype` is refused here, before any step (an engine
    built on it used to start, report healthy, and fail every request)."""
    name = resolve_backend_name(name, device)
    if name == "torch":
        from cuttle.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from cuttle.attention.triton_backend import TritonAttentionBackend

        TritonAttentionBackend.check_runs_on(device, dtype)
        return TritonAttentionBackend()
    from cuttle.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(device)
