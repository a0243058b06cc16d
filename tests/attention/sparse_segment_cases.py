"""The segmented step the sparse backends' squid tests share (test_nsa_segments.py,
test_topk_segments.py): named segments (a prefix, documents, each sequence's own tokens) with
random keys in shuffled blocks, two sequences reading them (one a prefill chunk, one a decode row;
documents moved by rope deltas), a document optionally moved to a host pool, and the query rotated
by -delta as the oracle needs it. Each test fills the caches through its own backend."""
from __future__ import annotations

import torch

from cuttle.attention.metadata import AttentionMetadata, KVSegment, SeqLayout
from cuttle.attention.rope import RotaryEmbedding, rotate_partial

HEADS, KV_HEADS, DIM, BS = 4, 2, 16, 8
# (sequence's segments: name, rope delta), its own segment, query rows this step
STEP = [
    (["prefix", "A", "B"], "own0", 5),  # a prefill chunk after two documents
    (["prefix", "B"], "own1", 1),  # a decode row; B placed elsewhere
]
ROPE = RotaryEmbedding(DIM, 512, 10000.0, None, torch.device("cpu"))


def keys_and_tables(segments: dict[str, int], g: torch.Generator):
    """Every segment's keys and values after this step (an own segment gains its query rows) and
    its blocks in one shuffled pool: (lens, keys {name: (k, v)}, tables {name: ids}, pool blocks)."""
    lens = dict(segments)
    for _, own, qlen in STEP:
        lens[own] += qlen
    keys = {n: (torch.randn(n_, KV_HEADS, DIM, generator=g) * 1.5, torch.randn(n_, KV_HEADS, DIM, generator=g))
            for n, n_ in lens.items()}
    nblocks = {n: -(-n_ // BS) for n, n_ in lens.items()}
    total = sum(nblocks.values()) + 2
    perm = torch.randperm(total, generator=g).tolist()
    tables, at = {}, 0
    for n, nb in nblocks.items():
        tables[n] = perm[at : at + nb]
        at += nb
    return lens, keys, tables, total


def prefill_alone(segments: dict[str, int], keys, tables):
    """The metadata and (k, v) of every segment's cached keys written as the engine writes a prefix
    or document: a causal prefill of each segment alone."""
    layouts = [SeqLayout(segments[n], [KVSegment(tables[n], segments[n], causal=True)]) for n in segments]
    k = torch.cat([keys[n][0][: segments[n]] for n in segments])
    v = torch.cat([keys[n][1][: segments[n]] for n in segments])
    return AttentionMetadata.build(layouts, BS, "cpu"), k, v


def move_to_host(tables, name: str, caches: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Segment `name`'s blocks of every cache move to a host pool (read in place): poisoned in the
    device pool, its table renumbered into the host pool. Returns the host pool's tensors."""
    host = tuple(torch.full((len(tables[name]) + 1, *c.shape[1:]), float("nan")) for c in caches)
    for i, b in enumerate(tables[name]):
        for h, c in zip(host, caches):
            h[i + 1] = c[b]
            c[b] = float("nan")
    tables[name] = [i + 1 for i in range(len(tables[name]))]
    return host


def deltas(segments: dict[str, int], shared: list[str]) -> list[int]:
    """Each shared segment's rope delta: placed one after another after the prefix (`concat`)."""
    out, at = [], 0
    for n in shared:
        out.append(at)
        at += segments[n]
    return out


def step_metadata(segments: dict[str, int], lens, keys, tables, host_doc: str | None, empty: bool, host_kv=None):
    """This step's metadata (every sequence's shared segments, an empty one after the first if
    `empty`, then its own) and the new keys and values of its own segments."""
    layouts, k_new, v_new = [], [], []
    for shared, own, qlen in STEP:
        segs = [KVSegment(tables[n], segments[n], causal=False, rope_delta=d, pool=int(n == host_doc))
                for n, d in zip(shared, deltas(segments, shared))]
        if empty:
            segs.insert(1, KVSegment([], 0, causal=False))
        segs.append(KVSegment(tables[own], lens[own], causal=True))
        layouts.append(SeqLayout(qlen, segs))
        k_new.append(keys[own][0][segments[own] :])
        v_new.append(keys[own][1][segments[own] :])
    meta = AttentionMetadata.build(layouts, BS, "cpu", rope=ROPE, host_kv=host_kv)
    return meta, torch.cat(k_new), torch.cat(v_new)


def oracle_parts(segments: dict[str, int], lens, keys, q: torch.Tensor, attend):
    """Per sequence, the list of `attend(q rows rotated by -delta, k, v, positions)` over each of
    its parts on unpaged keys (a shared part's rows at its last key, the own part causal)."""
    out, row = [], 0
    for shared, own, qlen in STEP:
        qs = q[row : row + qlen]
        row += qlen
        parts = []
        for n, d in zip(shared, deltas(segments, shared)):
            qv = qs
            if d:
                cos, sin = ROPE.delta_tables([d])
                qv = rotate_partial(qs, cos[:, None, :].expand(qlen, 1, -1), sin[:, None, :].expand(qlen, 1, -1))
            parts.append(attend(qv, keys[n][0][: segments[n]], keys[n][1][: segments[n]], torch.full((qlen,), segments[n] - 1)))
        parts.append(attend(qs, keys[own][0], keys[own][1], torch.arange(segments[own], lens[own])))
        out.append(parts)
    return out
