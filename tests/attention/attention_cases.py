"""Batches for the attention tests: random paged batches whose logical K/V is known, and a naive
dense causal attention computed from scratch (float64) as an oracle independent of every backend.

Imports torch and the metadata only, never triton: the Triton tests import this module in the
pytest process and run their kernels in a subprocess with the interpreter on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from cuttle.attention.metadata import NULL_BLOCK, AttentionMetadata


@dataclass(frozen=True)
class Case:
    name: str
    seqs: tuple[tuple[int, int], ...]  # (tokens already cached, new tokens this step) per sequence
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    share_prefix: bool = False  # later sequences reuse the first one's full cached blocks (a fork)
    fused_qkv: bool = False  # q, k, v are strided views into one [T, (H + 2 Hkv) * D] tensor
    triton: dict[str, Any] = field(default_factory=dict)  # TritonAttentionBackend options


# Small shapes: the Triton interpreter runs every program in Python.
CASES: tuple[Case, ...] = (
    # decode, fresh prefill, chunk after a cached prefix, partial last blocks, a 1-token prompt
    Case("gqa_mixed", ((0, 7), (37, 1), (20, 13), (15, 1), (0, 1)), 8, 2, 32, 16, triton={"block_n": 16}),
    # block-aligned prefix and chunk, long chunk spanning many BLOCK_N steps
    Case("mha_prefill", ((0, 19), (8, 8), (5, 30)), 4, 4, 16, 8, triton={"block_n": 16, "block_m": 16}),
    Case("mqa_decode_bs32_d64", ((50, 1), (0, 1), (95, 1), (31, 1)), 4, 1, 64, 32),
    Case(
        "gqa_decode_split",
        ((60, 1), (3, 1), (17, 1), (33, 1)),
        8, 2, 16, 8,
        triton={"block_n": 16, "split_len": 16, "max_splits": 8},
    ),
    Case("mixed_split_d128_bs32", ((40, 5), (0, 3), (63, 1), (70, 1)), 2, 1, 128, 32,
         triton={"block_n": 16, "split_len": 32, "max_splits": 4}),
    Case("forked_prefix", ((32, 4), (32, 1), (40, 6)), 4, 2, 32, 16, share_prefix=True, triton={"block_n": 16}),
    # group of 3 (padded to 4), head_dim 24 (padded to 32), q/k/v strided views of a fused qkv
    Case("fused_qkv_group3_d24", ((0, 11), (9, 1), (21, 4)), 6, 2, 24, 8, fused_qkv=True, triton={"block_n": 16}),
)


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    full_k: list[torch.Tensor]  # logical K of each sequence after this step, [L, Hkv, D]
    full_v: list[torch.Tensor]
    scale: float

    def to(self, device: torch.device) -> Batch:
        meta = self.meta
        moved = AttentionMetadata(
            query_start_loc=meta.query_start_loc.to(device),
            seq_lens=meta.seq_lens.to(device),
            block_tables=meta.block_tables.to(device),
            slot_mapping=meta.slot_mapping.to(device),
            block_size=meta.block_size,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            query_lens_cpu=meta.query_lens_cpu,
            seq_lens_cpu=meta.seq_lens_cpu,
        )
        return Batch(
            q=self.q.to(device), k=self.k.to(device), v=self.v.to(device),
            k_cache=self.k_cache.to(device), v_cache=self.v_cache.to(device), meta=moved,
            full_k=self.full_k, full_v=self.full_v, scale=self.scale,
        )


def build_batch(case: Case, junk: float | None, seed: int = 0, dtype: torch.dtype = torch.float32) -> Batch:
    """A batch over a cache whose unwritten slots hold `junk` (None: large random values).

    Blocks are a random permutation of the pool, tables are wider than needed (tail entries 0).
    """
    g = torch.Generator().manual_seed(seed)
    hkv, d, bs = case.num_kv_heads, case.head_dim, case.block_size
    full_k: list[torch.Tensor] = []
    full_v: list[torch.Tensor] = []
    for cached, new in case.seqs:
        full_k.append(torch.randn(cached + new, hkv, d, generator=g))
        full_v.append(torch.randn(cached + new, hkv, d, generator=g))

    tables: list[list[int]] = []
    num_distinct = sum(-(-(c + n) // bs) for c, n in case.seqs)
    perm = torch.randperm(num_distinct + 3, generator=g).tolist()
    for b, (cached, new) in enumerate(case.seqs):
        nblocks = -(-(cached + new) // bs)
        shared = min(cached, case.seqs[0][0]) // bs if case.share_prefix and b > 0 else 0
        reused = tables[0][:shared] if shared else []
        tables.append(reused + [perm.pop() for _ in range(nblocks - shared)])
        if shared:
            full_k[b][: shared * bs] = full_k[0][: shared * bs]
            full_v[b][: shared * bs] = full_v[0][: shared * bs]

    num_blocks = num_distinct + 3
    shape = (num_blocks, bs, hkv, d)
    if junk is None:
        # Its own generator, so a batch is the same whatever the junk.
        g_junk = torch.Generator().manual_seed(seed + 1)
        k_cache = torch.randn(shape, generator=g_junk) * 100
        v_cache = torch.randn(shape, generator=g_junk) * 100
    else:
        k_cache = torch.full(shape, junk)
        v_cache = torch.full(shape, junk)
    for b, (cached, _) in enumerate(case.seqs):
        slots = _slots(tables[b], range(cached), bs)
        k_cache.view(-1, hkv, d)[slots] = full_k[b][:cached]
        v_cache.view(-1, hkv, d)[slots] = full_v[b][:cached]

    qlens = [n for _, n in case.seqs]
    seq_lens = [c + n for c, n in case.seqs]
    total = sum(qlens)
    h = case.num_heads
    if case.fused_qkv:
        qkv = torch.randn(total, (h + 2 * hkv) * d, generator=g)
        q = qkv[:, : h * d].view(total, h, d)
        k = qkv[:, h * d : (h + hkv) * d].view(total, hkv, d)
        v = qkv[:, (h + hkv) * d :].view(total, hkv, d)
        k.copy_(torch.cat([fk[c:] for fk, (c, _) in zip(full_k, case.seqs)]))
        v.copy_(torch.cat([fv[c:] for fv, (c, _) in zip(full_v, case.seqs)]))
    else:
        q = torch.randn(total, h, d, generator=g)
        k = torch.cat([fk[c:] for fk, (c, _) in zip(full_k, case.seqs)])
        v = torch.cat([fv[c:] for fv, (c, _) in zip(full_v, case.seqs)])

    width = max(len(t) for t in tables) + 2
    block_tables = torch.zeros(len(tables), width, dtype=torch.int32)
    for b, t in enumerate(tables):
        block_tables[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
    slot_mapping = torch.cat([_slots(tables[b], range(c, c + n), bs) for b, (c, n) in enumerate(case.seqs)])
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        block_size=bs,
        max_query_len=max(qlens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=qlens,
        seq_lens_cpu=seq_lens,
    )
    return Batch(
        q=q.to(dtype), k=k.to(dtype), v=v.to(dtype),
        k_cache=k_cache.to(dtype), v_cache=v_cache.to(dtype), meta=meta,
        full_k=full_k, full_v=full_v, scale=d**-0.5,
    )


def give_back_behind_window(batch: Batch, window: int, junk: float, poison_entries: bool = False) -> int:
    """What the block manager does under a window (engine/block_manager.py): each sequence's blocks
    wholly before its first new token's window are given back: their table entries become
    `NULL_BLOCK`, and the KV of every block no table names any more is set to `junk` (NaN: a read
    of one shows). `poison_entries`: the entries name a block of NaN instead of NULL_BLOCK, so a
    path that reads a given-back entry at all shows it. Returns how many entries were given back."""
    meta, bs = batch.meta, batch.meta.block_size
    tables = meta.block_tables

    def named() -> set[int]:
        return {int(x) for b, kv in enumerate(meta.seq_lens_cpu) for x in tables[b, : -(-kv // bs)] if x >= 0}

    before = named()
    entry = NULL_BLOCK
    if poison_entries:
        entry = min(set(range(batch.k_cache.shape[0])) - before)  # a block no table names (build_batch leaves 3)
        batch.k_cache[entry] = float("nan")
        batch.v_cache[entry] = float("nan")
    given = 0
    for b, (kv, q) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu)):
        end = max(0, (kv - q - window + 1) // bs)
        tables[b, :end] = entry
        given += end
    gone = sorted(before - named())
    if gone:
        batch.k_cache[gone] = junk
        batch.v_cache[gone] = junk
    return given


def _slots(table: list[int], positions: range, block_size: int) -> torch.Tensor:
    return torch.tensor([table[i // block_size] * block_size + i % block_size for i in positions], dtype=torch.int64)


def naive_attention(batch: Batch, window: int | None = None) -> torch.Tensor:
    """Dense causal attention per sequence and head, in float64, from the logical K/V alone
    (`window`: a query at p sees keys p - window + 1 .. p only)."""
    q = batch.q.double().cpu()
    out = torch.empty_like(q)
    num_heads = q.shape[1]
    starts = batch.meta.query_start_loc.tolist()
    for b, fk in enumerate(batch.full_k):
        group = num_heads // fk.shape[1]
        qlen = batch.meta.query_lens_cpu[b]
        ctx = fk.shape[0] - qlen
        allowed = torch.arange(fk.shape[0])[None, :] <= ctx + torch.arange(qlen)[:, None]
        if window is not None:
            allowed &= torch.arange(fk.shape[0])[None, :] > ctx + torch.arange(qlen)[:, None] - window
        for h in range(num_heads):
            qh = q[starts[b] : starts[b] + qlen, h]
            kh, vh = fk[:, h // group].double(), batch.full_v[b][:, h // group].double()
            scores = (qh @ kh.T) * batch.scale
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[starts[b] : starts[b] + qlen, h] = torch.softmax(scores, dim=-1) @ vh
    return out


def naive_lse(batch: Batch) -> torch.Tensor:
    """The log-sum-exp (natural log) of each row's scaled, causally visible scores, float64 [T, H]."""
    q = batch.q.double().cpu()
    lse = torch.empty(q.shape[:2], dtype=torch.float64)
    num_heads = q.shape[1]
    starts = batch.meta.query_start_loc.tolist()
    for b, fk in enumerate(batch.full_k):
        group = num_heads // fk.shape[1]
        qlen = batch.meta.query_lens_cpu[b]
        ctx = fk.shape[0] - qlen
        allowed = torch.arange(fk.shape[0])[None, :] <= ctx + torch.arange(qlen)[:, None]
        for h in range(num_heads):
            scores = (q[starts[b] : starts[b] + qlen, h] @ fk[:, h // group].double().T) * batch.scale
            lse[starts[b] : starts[b] + qlen, h] = torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return lse


def cache_matches(batch: Batch) -> bool:
    """True when every logical token of every sequence is in its slot in both caches."""
    hkv, d = batch.k_cache.shape[2], batch.k_cache.shape[3]
    bs = batch.meta.block_size
    k_cache, v_cache = batch.k_cache.cpu(), batch.v_cache.cpu()
    for b, fk in enumerate(batch.full_k):
        table = batch.meta.block_tables[b].tolist()
        slots = _slots(table, range(fk.shape[0]), bs)
        if not torch.equal(k_cache.view(-1, hkv, d)[slots], fk.to(k_cache.dtype)):
            return False
        if not torch.equal(v_cache.view(-1, hkv, d)[slots], batch.full_v[b].to(v_cache.dtype)):
            return False
    return True
