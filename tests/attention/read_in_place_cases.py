"""Steps whose KV lies partly in a second pool (read in place), and the same steps over one pool.

`build(dtype, segmented)` returns two views of one step: `split` (a device pool and a host pool;
some blocks of the sequences' tables, and in the segmented case a whole full-visibility segment,
are host blocks named by HOST_BLOCK ids, with `meta.host_kv`) and `joined` (one pool holding both
pools' blocks, host ids shifted past the device ones, no host pool). Attention over the two must
agree exactly: the same keys and values, in the same order, only their addresses differ. Shared by
test_read_in_place.py and read_in_place_worker.py (which imports triton in interpreter mode).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cuttle.attention.metadata import HOST_BLOCK, AttentionMetadata, KVSegment, SeqLayout

LAYERS, BLOCK, HKV, GROUP, DIM = 2, 4, 2, 2, 16
DEV_BLOCKS, HOST_BLOCKS = 40, 24


@dataclass
class Step:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)
    meta: AttentionMetadata
    scale: float


def _layouts(segmented: bool, host: bool) -> list[SeqLayout]:
    """Three sequences: a decode over 37 keys, a 5-token chunk after 35 cached, a 9-token chunk
    after 20 cached; cold blocks of each lie in the host pool. Segmented: the first two also read
    an 18-token full-visibility segment that lies wholly in the host pool."""
    def h(i: int) -> int:  # a host block: flagged, or in the joined pool after the device blocks
        return (i | HOST_BLOCK) if host else DEV_BLOCKS + i

    seqs = [
        (1, [h(0), h(1), 3, h(2), 4, h(3), 5, 6, 7, 8], 37),
        (5, [h(4), h(5), h(6), 9, h(7), 10, 11, 12, 13, 14], 40),
        (9, [h(8), 15, h(9), h(10), h(11), 16, 17, 18], 29),
    ]
    out = []
    for i, (qlen, table, length) in enumerate(seqs):
        segs = [KVSegment(table, length, causal=True)]
        if segmented and i < 2:
            blocks = [12 + j for j in range(5)]
            doc = KVSegment(blocks if host else [DEV_BLOCKS + b for b in blocks], 18, causal=False, pool=1 if host else 0)
            segs.insert(0, doc)
        out.append(SeqLayout(qlen, segs))
    return out


def build(dtype: torch.dtype, segmented: bool, seed: int = 0) -> tuple[Step, Step]:
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCK, HKV, DIM)
    dev = [(torch.randn(DEV_BLOCKS, *shape, generator=g).to(dtype), torch.randn(DEV_BLOCKS, *shape, generator=g).to(dtype))
           for _ in range(LAYERS)]
    host = [(torch.randn(HOST_BLOCKS, *shape, generator=g).to(dtype), torch.randn(HOST_BLOCKS, *shape, generator=g).to(dtype))
            for _ in range(LAYERS)]
    joined = [(torch.cat([dk, hk]), torch.cat([dv, hv])) for (dk, dv), (hk, hv) in zip(dev, host)]
    rows = 1 + 5 + 9
    q = torch.randn(rows, HKV * GROUP, DIM, generator=g).to(dtype)
    k = torch.randn(rows, HKV, DIM, generator=g).to(dtype)
    v = torch.randn(rows, HKV, DIM, generator=g).to(dtype)
    scale = DIM ** -0.5
    split_meta = AttentionMetadata.build(_layouts(segmented, True), BLOCK, "cpu", host_kv=host)
    joined_meta = AttentionMetadata.build(_layouts(segmented, False), BLOCK, "cpu")
    assert split_meta.host_kv is not None and joined_meta.host_kv is None
    return Step(q, k, v, dev, split_meta, scale), Step(q, k, v, joined, joined_meta, scale)


def run(backend, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer of the step through `backend`: outputs and lse stacked over layers."""
    backend.begin_step(step.meta)
    outs, lses = [], []
    for layer, (kc, vc) in enumerate(step.kv):
        o, lse = backend.forward(layer, step.q, step.k, step.v, kc, vc, step.meta, step.scale)
        outs.append(o.float())
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)
