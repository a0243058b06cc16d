"""Segmented batches for the attention tests: sequences whose KV is several cached documents (full
visibility, some placed at a RoPE offset, some shared by several sequences, some empty, most
ending mid-block) followed by their own causal tokens, built through `AttentionMetadata.build`;
and a float64 oracle of (o, lse) from the logical K/V alone, which moves a document by rotating
its *keys* (the backends rotate the query instead).

Imports torch and cuttle.attention's metadata and rope only, never triton: the Triton tests import
this module in the worker subprocess too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from cuttle.attention.metadata import AttentionMetadata, KVSegment, SeqLayout
from cuttle.attention.rope import RotaryEmbedding

# (full segments as (document, rope_delta), tokens of its own already cached, new tokens)
SeqSpec = tuple[tuple[tuple[int, int], ...], int, int]


@dataclass(frozen=True)
class SegCase:
    name: str
    docs: tuple[int, ...]  # lengths of the cached documents (each stored once, in its own blocks)
    seqs: tuple[SeqSpec, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    rotary_dim: int | None = None  # dims RoPE rotates (first ones); None: head_dim
    triton: dict[str, Any] = field(default_factory=dict)


SEG_CASES: tuple[SegCase, ...] = (
    # GQA 4: documents ending mid-block (37, 5), one of a full block, one empty; a document used by
    # two sequences at different offsets; decode rows, a fresh prompt and a chunk after cached tokens
    SegCase(
        "gqa4_docs_mixed", (37, 16, 5, 0),
        (
            (((0, 0), (1, 37)), 3, 1),
            (((2, 0), (0, -5), (3, 0)), 0, 7),
            (((1, 0),), 20, 13),
            ((), 15, 1),
            (((0, 53), (2, 11)), 0, 1),
        ),
        8, 2, 32, 16, triton={"block_n": 16},
    ),
    # MHA, every context shorter than one block
    SegCase("mha_short_contexts", (3, 9), ((((0, 0), (1, 3)), 2, 1), (((1, -2),), 0, 4), (((0, 7),), 5, 2)), 4, 4, 16, 16),
    # MQA, block size 8, chunked prefill after a cached own part, several documents each
    SegCase(
        "mqa_chunks_bs8", (20, 13, 1),
        ((((0, 0), (1, 20), (2, 33)), 10, 6), (((2, 0), (0, 1)), 0, 1), (((1, 100),), 8, 9)),
        4, 1, 64, 8, triton={"block_n": 16, "block_m": 16},
    ),
    # group of 3 (padded to 4), head_dim 24 with RoPE over its first 16 dims only
    SegCase("group3_partial_rotary", (11, 30), ((((0, 4), (1, 15)), 0, 5), (((1, 0), (0, -30)), 7, 1)), 6, 2, 24, 8,
            rotary_dim=16, triton={"block_n": 16}),
    # empty documents only, a sequence without documents beside ones with them
    SegCase("empty_segments", (0, 0, 4), ((((0, 0), (1, 0)), 0, 3), ((), 6, 1), (((2, 2), (0, 0)), 1, 1)), 4, 2, 16, 8),
    # long documents under decode: the Triton split-KV path runs over segment parts
    SegCase("split_decode_docs", (70, 45), ((((0, 0), (1, 70)), 4, 1), (((1, 0),), 60, 1), (((0, 9),), 0, 1)), 8, 2, 16, 8,
            triton={"block_n": 16, "split_len": 16, "max_splits": 8}),
)


@dataclass
class SegBatch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    layouts: list[SeqLayout]
    rope: RotaryEmbedding
    seq_docs: list[list[tuple[int, int]]]  # (document, rope_delta) of each sequence's full segments
    doc_k: list[torch.Tensor]  # cached keys of each document as stored (rotated at their own positions)
    doc_v: list[torch.Tensor]
    own_k: list[torch.Tensor]  # each sequence's own keys after this step, [L, Hkv, D]
    own_v: list[torch.Tensor]
    scale: float
    # each sequence's segments' first positions (documents one after another, its own tokens last),
    # what a sliding window measures
    seq_pos: list[list[int]] = field(default_factory=list)

    def to(self, device: torch.device) -> SegBatch:
        meta = AttentionMetadata.build(self.layouts, self.meta.block_size, device, self.rope)
        return SegBatch(
            q=self.q.to(device), k=self.k.to(device), v=self.v.to(device), k_cache=self.k_cache.to(device),
            v_cache=self.v_cache.to(device), meta=meta, layouts=self.layouts, rope=self.rope,
            seq_docs=self.seq_docs, doc_k=self.doc_k,
            doc_v=self.doc_v, own_k=self.own_k, own_v=self.own_v, scale=self.scale, seq_pos=self.seq_pos,
        )


def build_seg_batch(case: SegCase, junk: float | None, seed: int = 0, dtype: torch.dtype = torch.float32) -> SegBatch:
    """A segmented batch over a cache whose unwritten slots hold `junk` (None: large random values).
    The oracle's K/V/q are the values the cache holds (rounded to `dtype`)."""
    g = torch.Generator().manual_seed(seed)
    hkv, d, bs, h = case.num_kv_heads, case.head_dim, case.block_size, case.num_heads
    rnd = lambda n: torch.randn(n, hkv, d, generator=g).to(dtype).float()  # noqa: E731
    doc_k = [rnd(n) for n in case.docs]
    doc_v = [rnd(n) for n in case.docs]
    own_k = [rnd(c + n) for _, c, n in case.seqs]
    own_v = [rnd(c + n) for _, c, n in case.seqs]
    need = [-(-n // bs) for n in case.docs] + [-(-(c + n) // bs) for _, c, n in case.seqs]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[perm.pop() for _ in range(nb)] for nb in need]
    doc_tables, own_tables = tables[: len(case.docs)], tables[len(case.docs) :]

    shape = (num_blocks, bs, hkv, d)
    if junk is None:
        g_junk = torch.Generator().manual_seed(seed + 1)
        k_cache, v_cache = torch.randn(shape, generator=g_junk) * 100, torch.randn(shape, generator=g_junk) * 100
    else:
        k_cache, v_cache = torch.full(shape, junk), torch.full(shape, junk)
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    for t, kk, vv in zip(doc_tables, doc_k, doc_v):
        slots = _slots(t, range(kk.shape[0]), bs)
        flat_k[slots], flat_v[slots] = kk, vv
    for t, kk, vv, (_, cached, _) in zip(own_tables, own_k, own_v, case.seqs):
        slots = _slots(t, range(cached), bs)
        flat_k[slots], flat_v[slots] = kk[:cached], vv[:cached]

    layouts = []
    seq_pos = []
    for b, (docs, cached, new) in enumerate(case.seqs):
        bases = [sum(case.docs[i] for i, _ in docs[:j]) for j in range(len(docs) + 1)]
        segs = [KVSegment(doc_tables[i], case.docs[i], causal=False, rope_delta=delta, pos_base=at)
                for (i, delta), at in zip(docs, bases)]
        segs.append(KVSegment(own_tables[b], cached + new, causal=True, pos_base=bases[-1]))
        layouts.append(SeqLayout(new, segs))
        seq_pos.append(bases)
    rope = RotaryEmbedding(case.rotary_dim or d, 64, 10000.0, None, torch.device("cpu"))
    meta = AttentionMetadata.build(layouts, bs, "cpu", rope)
    total = sum(n for _, _, n in case.seqs)
    return SegBatch(
        q=torch.randn(total, h, d, generator=g).to(dtype),
        k=torch.cat([kk[c:] for kk, (_, c, _) in zip(own_k, case.seqs)]).to(dtype),
        v=torch.cat([vv[c:] for vv, (_, c, _) in zip(own_v, case.seqs)]).to(dtype),
        k_cache=k_cache.to(dtype), v_cache=v_cache.to(dtype), meta=meta, layouts=layouts, rope=rope,
        seq_docs=[list(docs) for docs, _, _ in case.seqs], doc_k=doc_k, doc_v=doc_v, own_k=own_k, own_v=own_v, scale=d**-0.5,
        seq_pos=seq_pos,
    )


def _slots(table: list[int], positions: range, block_size: int) -> torch.Tensor:
    return torch.tensor([table[i // block_size] * block_size + i % block_size for i in positions], dtype=torch.int64)


def rotate_keys(k: torch.Tensor, delta: int, rope: RotaryEmbedding) -> torch.Tensor:
    """Keys [L, Hkv, D] moved by `delta` positions: rotated by +delta * inv_freq over the first
    rotary dims (NeoX halves), in float64."""
    half = rope.inv_freq.shape[0]
    angle = delta * rope.inv_freq.double()
    cos, sin = angle.cos(), angle.sin()
    k = k.double()
    x1, x2 = k[..., :half], k[..., half : 2 * half]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, k[..., 2 * half :]), dim=-1)


def seg_oracle(batch: SegBatch, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention per sequence and head in float64 over the concatenation of its documents'
    keys (rotated to their placement) and its own keys (causal): (o [T, H, D], lse [T, H]). Under a
    sliding `window` a query at position p sees the keys at p - window + 1 .. p (`seq_pos`)."""
    q = batch.q.double().cpu()
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float64)
    h = q.shape[1]
    row = 0
    for b, layout in enumerate(batch.layouts):
        qlen = layout.query_len
        keys, vals, vis = [], [], []
        for i, delta in batch.seq_docs[b]:
            keys.append(rotate_keys(batch.doc_k[i], delta, batch.rope))
            vals.append(batch.doc_v[i].double())
            vis.append(torch.ones(qlen, batch.doc_k[i].shape[0], dtype=torch.bool))
        own_len = batch.own_k[b].shape[0]
        keys.append(batch.own_k[b].double())
        vals.append(batch.own_v[b].double())
        vis.append(torch.arange(own_len)[None, :] <= own_len - qlen + torch.arange(qlen)[:, None])
        k, v, allowed = torch.cat(keys), torch.cat(vals), torch.cat(vis, dim=1)
        if window is not None:
            bases = batch.seq_pos[b]
            lens = [batch.doc_k[i].shape[0] for i, _ in batch.seq_docs[b]] + [own_len]
            kpos = torch.cat([torch.arange(at, at + n) for at, n in zip(bases, lens)])
            qpos = torch.arange(bases[-1] + own_len - qlen, bases[-1] + own_len)
            allowed = allowed & (qpos[:, None] - kpos[None, :] < window)
        group = h // k.shape[1]
        for head in range(h):
            scores = (q[row : row + qlen, head] @ k[:, head // group].T) * batch.scale
            scores = scores.masked_fill(~allowed, float("-inf"))
            lse[row : row + qlen, head] = torch.logsumexp(scores, dim=-1)
            out[row : row + qlen, head] = torch.softmax(scores, dim=-1) @ v[:, head // group]
        row += qlen
    return out, lse
