"""NSA over squid segments (attention/nsa_backend.py): a step whose sequences read a prefix,
documents (some moved by a rope delta) and their own tokens attends part by part, each part under
NSA's rules on its own keys (a whole part's rows all sit at its last key: its complete compressed
entries, its first and last blocks forced, its last `window` keys), every branch merged over the
parts by the log-sum-exp, then gated.

The oracle is independent of the paged machinery: per part, `nsa_branches` over the segment's
unpaged keys with compressed entries computed from those keys by `compress`, the query rotated by
-delta (`RotaryEmbedding.delta_tables`), each branch merged by hand, then the gates. The backend's
native kernel (vector and scalar loops) and its torch path must equal it in fp32, with a document
in the host pool (read in place) too; the caches the parts read were written by the backend itself,
each segment prefilled alone as the engine computes a document.
"""
from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__" and "--triton" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from cuttle.attention.metadata import HOST_BLOCK  # noqa: E402
from cuttle.attention.native import nsa as native_nsa  # noqa: E402
from cuttle.attention.native import topk as native_topk  # noqa: E402
from cuttle.attention.nsa import NSAConfig, compress, compress_windows, nsa_branches  # noqa: E402
from cuttle.attention.nsa_backend import NSABackend, compressed_slots_per_block  # noqa: E402
from cuttle.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from sparse_segment_cases import (BS, DIM, HEADS, KV_HEADS, STEP, keys_and_tables, move_to_host,  # noqa: E402
                                  oracle_parts, prefill_alone, step_metadata)

SEGMENTS = {"prefix": 13, "A": 61, "B": 45, "own0": 9, "own1": 40}  # keys already cached
CONFIGS = [
    # l=8, d=4 (2 compressed slots a raw block), l'=16; the prefix has 2 entries
    NSAConfig(compress_block=8, compress_stride=4, select_block=16, top_n=3, init_blocks=1, local_blocks=1, window=8,
              compress_fn="linear"),
    # l=d=16 (an entry spans 2 raw blocks), l'=32; the prefix has no entry (an empty branch in a part)
    NSAConfig(compress_block=16, compress_stride=16, select_block=32, top_n=2, init_blocks=0, local_blocks=1, window=6,
              compress_fn="mean"),
]


def _build(cfg: NSAConfig, host_doc: str | None, seed: int = 0, empty: bool = False):
    """The step (and its oracle); `empty` adds an empty part (a segment of no key) to each sequence."""
    g = torch.Generator().manual_seed(seed)
    scale = DIM**-0.5
    weights = None
    if cfg.compress_fn == "linear":
        weights = [torch.randn(KV_HEADS, cfg.compress_block * DIM, DIM, generator=g) / (cfg.compress_block * DIM) ** 0.5
                   for _ in range(2)]

    def compressor(wk, wv):
        return (compress_windows(wk, weights and weights[0], cfg), compress_windows(wv, weights and weights[1], cfg))

    lens, keys, tables, total = keys_and_tables(SEGMENTS, g)
    slots = compressed_slots_per_block(cfg, BS)
    caches = [torch.full((total, BS, KV_HEADS, DIM), float("nan")) for _ in range(2)]
    caches += [torch.full((total, slots, KV_HEADS, DIM), float("nan")) for _ in range(2)]
    # every segment's cached keys and compressed entries written by the backend
    filler = NSABackend(cfg, TorchAttentionBackend(native=False), BS, native=False)
    meta, k, v = prefill_alone(SEGMENTS, keys, tables)
    filler.begin_step(meta)
    filler.forward_nsa(0, torch.randn(k.shape[0], HEADS, DIM, generator=g), k, v, torch.rand(k.shape[0], HEADS, 3),
                       tuple(caches), meta, scale, compressor)
    host = None if host_doc is None else move_to_host(tables, host_doc, caches)
    rows = sum(qlen for *_, qlen in STEP)
    q = torch.randn(rows, HEADS, DIM, generator=g) * 1.5
    gates = torch.rand(rows, HEADS, 3, generator=g)
    meta, k_new, v_new = step_metadata(SEGMENTS, lens, keys, tables, host_doc, empty,
                                       None if host is None else [host[:2]])
    step = (q, k_new, v_new, gates, tuple(caches), meta, host, compressor)

    def attend(qv, kk, vv, pos):
        ck, cv = compress(kk, weights and weights[0], cfg), compress(vv, weights and weights[1], cfg)
        return nsa_branches(qv, kk, vv, ck, cv, pos, cfg, scale)[:2]

    # the oracle, part by part on unpaged keys, each branch merged by hand, then gated
    want, row = [], 0
    for parts, (_, _, qlen) in zip(oracle_parts(SEGMENTS, lens, keys, q, attend), STEP):
        lse = torch.stack([l for _, l in parts])  # [P, M, H, 3]
        top = lse.amax(0)
        top = torch.where(torch.isinf(top), 0.0, top)
        w = torch.exp(lse - top)  # 0 for an empty branch of a part
        o = sum(wp[..., None] * torch.nan_to_num(op) for (op, _), wp in zip(parts, w)) / w.sum(0).clamp_min(1e-30)[..., None]
        gs = gates[row : row + qlen]
        want.append(gs[..., 0:1] * o[:, :, 0] + gs[..., 1:2] * o[:, :, 1] + gs[..., 2:3] * o[:, :, 2])
        row += qlen
    return step, torch.cat(want)


@pytest.mark.parametrize("kernel", ["native", "native-scalar", "torch"])
@pytest.mark.parametrize("host_doc", [None, "B"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["linear-l8", "mean-l16"])
def test_segmented_step_equals_per_part_oracle(cfg, host_doc, kernel):
    (q, k, v, gates, caches, meta, host, compressor), want = _build(cfg, host_doc)
    backend = NSABackend(cfg, TorchAttentionBackend(native=False), BS, native=kernel != "torch")
    if kernel != "torch":
        assert backend.native, "the native library did not build"
    if host is not None:
        backend.host_compressed = [host[2:]]
        assert any(t >= HOST_BLOCK for t in meta.segments.block_tables.flatten().tolist())
    native_topk.set_fast_path(kernel != "native-scalar")
    try:
        backend.begin_step(meta)
        out = backend.forward_nsa(0, q, k, v, gates, caches, meta, DIM**-0.5, compressor)
    finally:
        native_topk.set_fast_path(True)
    assert (backend._plan.native_rows is not None) == (kernel != "torch")
    assert out.shape == q.shape and out.dtype == q.dtype
    assert (out - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_an_empty_part_adds_nothing(kernel):
    """A part of no key (kv_len 0) beside the others: skipped by the plan, its branches empty, the
    result the oracle's without it."""
    cfg = CONFIGS[0]
    (q, k, v, gates, caches, meta, _, compressor), want = _build(cfg, None, empty=True)
    assert 0 in meta.segments.kv_lens_cpu
    backend = NSABackend(cfg, TorchAttentionBackend(native=False), BS, native=kernel == "native")
    backend.begin_step(meta)
    out = backend.forward_nsa(0, q, k, v, gates, caches, meta, DIM**-0.5, compressor)
    assert (out - want).abs().max().item() <= 1e-5


def test_kernel_branches_equal_the_reference_per_part():
    """The native kernel's branch outputs (a part's three branches apart with their log-sum-exps)
    equal `nsa_branches` on the same part, empty branches included (-inf, 0)."""
    cfg = CONFIGS[1]
    (q, k, v, gates, caches, meta, host, compressor), _ = _build(cfg, None)
    backend = NSABackend(cfg, TorchAttentionBackend(native=False), BS)
    backend.begin_step(meta)
    backend.forward_nsa(0, q, k, v, gates, caches, meta, DIM**-0.5, compressor)  # stores the new entries
    plan = backend._plan
    rows_q = meta.segments.virtual_queries(q)
    bo = torch.zeros(rows_q.shape[0], HEADS, 3, DIM)
    bl = torch.full((rows_q.shape[0], HEADS, 3), float("nan"))
    native_nsa.nsa_decode(rows_q, *caches, None, None, plan.native_rows, plan.native_tables, plan.native_lens, cfg,
                          DIM**-0.5, branches=(bo, bl))
    assert not torch.isnan(bl).any()
    saw_empty = False
    for b in plan.native_seqs:
        start, qlen = plan.seqs[b][:2]
        kk, vv, ck, cv = backend._gather(plan, b, lambda name, idx: _pool(caches, name, idx))
        o, lse, _ = nsa_branches(rows_q[start : start + qlen], kk, vv, ck, cv, plan.positions(b, q.device),
                                 cfg, DIM**-0.5)
        empty = torch.isinf(lse)
        saw_empty |= bool(empty.any())
        assert torch.equal(torch.isinf(bl[start : start + qlen]), empty)
        assert (bo[start : start + qlen] - o).abs().max().item() <= 1e-5
        assert (bl[start : start + qlen][~empty] - lse[~empty]).abs().max().item() <= 1e-5
        assert (bo[start : start + qlen][empty] == 0).all()
    assert saw_empty, "the case should hold a part whose compressed branch is empty"


def test_kernel_branches_with_a_rows_heads_split_over_items():
    """One row at a time the binding splits its KV heads over work items (head_chunks > 1), so
    each item writes its own heads' branches (rows * heads + head indexing with h0 > 0)."""
    cfg = CONFIGS[0]
    (q, k, v, gates, caches, meta, _, compressor), _ = _build(cfg, None)
    backend = NSABackend(cfg, TorchAttentionBackend(native=False), BS)
    backend.begin_step(meta)
    backend.forward_nsa(0, q, k, v, gates, caches, meta, DIM**-0.5, compressor)
    plan = backend._plan
    rows_q = meta.segments.virtual_queries(q)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # one row, 2 threads: head_chunks = min(KV_HEADS, 4) = 2
    try:
        for b in plan.native_seqs:
            start, qlen = plan.seqs[b][:2]
            first = plan.native_rows.tolist().index(start)
            bo = torch.full((rows_q.shape[0], HEADS, 3, DIM), float("nan"))
            bl = torch.full((rows_q.shape[0], HEADS, 3), float("nan"))
            native_nsa.nsa_decode(rows_q, *caches, None, None, plan.native_rows[first : first + 1],
                                  plan.native_tables[first : first + 1], plan.native_lens[first : first + 1], cfg,
                                  DIM**-0.5, branches=(bo, bl))
            kk, vv, ck, cv = backend._gather(plan, b, lambda name, idx: _pool(caches, name, idx))
            pos = plan.positions(b, q.device)[:1]
            o, lse, _ = nsa_branches(rows_q[start : start + 1], kk, vv, ck, cv, pos, cfg, DIM**-0.5)
            assert not torch.isnan(bo[start]).any() and not torch.isnan(bl[start]).any()  # every head written
            assert (bo[start : start + 1] - o).abs().max().item() <= 1e-5
            fin = torch.isfinite(lse)
            assert torch.equal(torch.isfinite(bl[start : start + 1]), fin)
            assert (bl[start : start + 1][fin] - lse[fin]).abs().max().item() <= 1e-5
    finally:
        torch.set_num_threads(threads)


def _pool(caches, name, idx):
    c = caches["k v ck cv".split().index(name)]
    return c.reshape(-1, *c.shape[2:])[idx]


# ---- Triton, in the interpreter (a subprocess of this file) -----------------------------------

def _triton_error(cfg: NSAConfig, empty: bool = False) -> float:
    (q, k, v, gates, caches, meta, _, compressor), want = _build(cfg, None, empty=empty)
    backend = NSABackend(cfg, TorchAttentionBackend(native=False), BS, kernel="triton")
    backend.begin_step(meta)
    out = backend.forward_nsa(0, q, k, v, gates, caches, meta, DIM**-0.5, compressor)
    return (out - want).abs().max().item()


def test_triton_kernel_takes_segments_interpreted():
    """The Triton NSA kernel over the same segmented step (per-part branches with their
    log-sum-exps, merged and gated by the backend) equals the per-part oracle in the interpreter."""
    from sparse_helpers import check_triton_subprocess

    check_triton_subprocess(__file__, {f"nsa-segments-{i}" for i in range(len(CONFIGS))} | {"nsa-empty-part"}, tol=1e-5)


if __name__ == "__main__" and "--triton" in sys.argv:
    for i, cfg in enumerate(CONFIGS):
        print(json.dumps({"case": f"nsa-segments-{i}", "err": _triton_error(cfg)}), flush=True)
    print(json.dumps({"case": "nsa-empty-part", "err": _triton_error(CONFIGS[0], empty=True)}), flush=True)
