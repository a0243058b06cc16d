"""Top-k attention over squid segments (attention/topk_backend.py): a step whose sequences read a
prefix, documents (some moved by a rope delta) and their own tokens attends part by part, each
part under the top-k rule on its own keys (a shared part's rows all sit at its last key, so its
first and last blocks are the forced ones), and the parts merge by the log-sum-exp.

The oracle is independent of the paged machinery: per part, `topk_attend` over the segment's
unpaged keys with summaries computed from those keys, the query rotated by -delta
(`RotaryEmbedding.delta_tables`), merged by hand. The backend's native kernel (every loop) and its
torch path must equal it in fp32, with a document in the host pool (read in place) too.
"""
from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__" and "--triton" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from cuttle.attention.metadata import HOST_BLOCK, AttentionMetadata, KVSegment, SeqLayout  # noqa: E402
from cuttle.attention.native import topk as native_topk  # noqa: E402
from cuttle.attention.rope import RotaryEmbedding, rotate_partial  # noqa: E402
from cuttle.attention.topk import TopKConfig, topk_attend  # noqa: E402
from cuttle.attention.topk_backend import TopKBackend, summary_slots_per_block  # noqa: E402
from cuttle.attention.torch_backend import TorchAttentionBackend  # noqa: E402

HEADS, KV_HEADS, DIM, BS = 4, 2, 16, 8
SEGMENTS = {"prefix": 13, "A": 29, "B": 22, "own0": 9, "own1": 40}  # keys already cached
# (sequence's segments: name, rope delta), its own segment, query rows this step
STEP = [
    ([("prefix", 0), ("A", 13), ("B", 42)], "own0", 5),  # a prefill chunk after two documents
    ([("prefix", 0), ("B", 13)], "own1", 1),  # a decode row; B placed elsewhere
]


def _build(cfg: TopKConfig, host_doc: str | None, seed: int = 0, empty: bool = False):
    """The step (and its oracle); `empty` adds an empty part (a segment of no key) to each sequence."""
    g = torch.Generator().manual_seed(seed)
    lens = dict(SEGMENTS)
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
    k_cache = torch.full((total, BS, KV_HEADS, DIM), float("nan"))
    v_cache = k_cache.clone()
    summ = torch.full((total, summary_slots_per_block(cfg, BS), cfg.summary_rows, KV_HEADS, DIM), float("nan"))
    # every segment's cached keys (and the blocks' summaries) written by the backend, as the engine
    # writes a prefix or document: a causal prefill of the segment alone
    filler = TopKBackend(cfg, TorchAttentionBackend(native=False), BS, [summ], native=False)
    layouts = [SeqLayout(SEGMENTS[n], [KVSegment(tables[n], SEGMENTS[n], causal=True)]) for n in SEGMENTS]
    meta = AttentionMetadata.build(layouts, BS, "cpu")
    k = torch.cat([keys[n][0][: SEGMENTS[n]] for n in SEGMENTS])
    v = torch.cat([keys[n][1][: SEGMENTS[n]] for n in SEGMENTS])
    filler.begin_step(meta)
    filler.forward(0, torch.randn(k.shape[0], HEADS, DIM, generator=g), k, v, k_cache, v_cache, meta, DIM**-0.5)
    host = None
    if host_doc is not None:  # that document's blocks move to a host pool (read in place)
        k_host = torch.full((len(tables[host_doc]) + 1, *k_cache.shape[1:]), float("nan"))
        v_host, s_host = k_host.clone(), torch.full((k_host.shape[0], *summ.shape[1:]), float("nan"))
        for i, b in enumerate(tables[host_doc]):
            k_host[i + 1], v_host[i + 1], s_host[i + 1] = k_cache[b], v_cache[b], summ[b]
            k_cache[b] = v_cache[b] = summ[b] = float("nan")
        tables[host_doc] = [i + 1 for i in range(len(tables[host_doc]))]
        host = (k_host, v_host, s_host)
    rope = RotaryEmbedding(DIM, 512, 10000.0, None, torch.device("cpu"))
    q = torch.randn(sum(qlen for *_, qlen in STEP), HEADS, DIM, generator=g) * 1.5
    layouts, k_new, v_new = [], [], []
    for shared, own, qlen in STEP:
        segs = [KVSegment(tables[n], SEGMENTS[n], causal=False, rope_delta=d, pool=int(n == host_doc)) for n, d in shared]
        if empty:
            segs.insert(1, KVSegment([], 0, causal=False))
        segs.append(KVSegment(tables[own], lens[own], causal=True))
        layouts.append(SeqLayout(qlen, segs))
        k_new.append(keys[own][0][SEGMENTS[own] :])
        v_new.append(keys[own][1][SEGMENTS[own] :])
    host_kv = None if host is None else [host[:2]]
    meta = AttentionMetadata.build(layouts, BS, "cpu", rope=rope, host_kv=host_kv)
    step = (q, torch.cat(k_new), torch.cat(v_new), k_cache, v_cache, meta, host)

    # the oracle, part by part on unpaged keys
    want_o, want_l, row = [], [], 0
    for shared, own, qlen in STEP:
        qs = q[row : row + qlen]
        row += qlen
        parts = []
        for n, d in shared:
            qv = qs
            if d:
                cos, sin = rope.delta_tables([d])
                qv = rotate_partial(qs, cos[:, None, :].expand(qlen, 1, -1), sin[:, None, :].expand(qlen, 1, -1))
            pos = torch.full((qlen,), SEGMENTS[n] - 1)
            parts.append(topk_attend(qv, keys[n][0], keys[n][1], pos, cfg, DIM**-0.5))
        parts.append(topk_attend(qs, keys[own][0], keys[own][1], torch.arange(SEGMENTS[own], lens[own]), cfg, DIM**-0.5))
        lse = torch.logsumexp(torch.stack([l for _, l in parts]), dim=0)
        want_o.append(sum(torch.exp(l - lse)[..., None] * o for o, l in parts))
        want_l.append(lse)
    return step, torch.cat(want_o), torch.cat(want_l), summ


CONFIGS = [
    TopKConfig(budget=16, block=4, init_blocks=1, local_blocks=1, summary="quest"),  # 2 summaries a raw block
    TopKConfig(budget=32, block=16, init_blocks=0, local_blocks=1, summary="mean"),  # a block spans 2 raw blocks
]


@pytest.mark.parametrize("kernel", ["native", "native-scalar", "torch"])
@pytest.mark.parametrize("host_doc", [None, "B"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["quest-P4", "mean-P16"])
def test_segmented_step_equals_per_part_oracle(cfg, host_doc, kernel):
    (q, k, v, k_cache, v_cache, meta, host), want_o, want_l, summ = _build(cfg, host_doc)
    backend = TopKBackend(cfg, TorchAttentionBackend(native=False), BS, [summ], native=kernel != "torch")
    if kernel != "torch":
        assert backend.native, "the native library did not build"
    if host is not None:
        backend.host_summaries = [host[2]]
        assert any(t >= HOST_BLOCK for t in meta.segments.block_tables.flatten().tolist())
    native_topk.set_fast_path(kernel != "native-scalar")
    try:
        backend.begin_step(meta)
        out, lse = backend.forward(0, q, k, v, k_cache, v_cache, meta, DIM**-0.5)
    finally:
        native_topk.set_fast_path(True)
    assert (backend._plan.native_rows is not None) == (kernel != "torch")
    assert (out - want_o).abs().max().item() <= 1e-5
    assert (lse - want_l).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_an_empty_part_adds_nothing(kernel):
    """A part of no key (kv_len 0) beside the others: skipped by the plan, its lse -inf, the
    result the oracle's without it."""
    cfg = CONFIGS[0]
    (q, k, v, k_cache, v_cache, meta, _), want_o, want_l, summ = _build(cfg, None, empty=True)
    assert 0 in meta.segments.kv_lens_cpu
    backend = TopKBackend(cfg, TorchAttentionBackend(native=False), BS, [summ], native=kernel == "native")
    backend.begin_step(meta)
    out, lse = backend.forward(0, q, k, v, k_cache, v_cache, meta, DIM**-0.5)
    assert (out - want_o).abs().max().item() <= 1e-5 and (lse - want_l).abs().max().item() <= 1e-5


# ---- Triton, in the interpreter (a subprocess of this file) -----------------------------------

def _triton_error(cfg: TopKConfig, empty: bool = False) -> float:
    (q, k, v, k_cache, v_cache, meta, _), want_o, want_l, summ = _build(cfg, None, empty=empty)
    backend = TopKBackend(cfg, TorchAttentionBackend(native=False), BS, [summ], native=False, kernel="triton")
    backend.begin_step(meta)
    out, lse = backend.forward(0, q, k, v, k_cache, v_cache, meta, DIM**-0.5)
    return max((out - want_o).abs().max().item(), (lse - want_l).abs().max().item())


def test_triton_kernel_takes_segments_interpreted():
    """The Triton top-k kernel over the same segmented step (virtual rows over the parts' tables,
    merged by the backend) equals the per-part oracle in the interpreter."""
    from sparse_helpers import check_triton_subprocess

    check_triton_subprocess(__file__, {f"topk-segments-{i}" for i in range(len(CONFIGS))} | {"topk-empty-part"}, tol=1e-5)


if __name__ == "__main__" and "--triton" in sys.argv:
    for i, cfg in enumerate(CONFIGS):
        print(json.dumps({"case": f"topk-segments-{i}", "err": _triton_error(cfg)}), flush=True)
    print(json.dumps({"case": "topk-empty-part", "err": _triton_error(CONFIGS[0], empty=True)}), flush=True)
