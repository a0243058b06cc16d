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

from cuttle.attention.metadata import HOST_BLOCK  # noqa: E402
from cuttle.attention.native import topk as native_topk  # noqa: E402
from cuttle.attention.topk import TopKConfig, topk_attend  # noqa: E402
from cuttle.attention.topk_backend import TopKBackend, summary_slots_per_block  # noqa: E402
from cuttle.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from sparse_segment_cases import (BS, DIM, HEADS, KV_HEADS, STEP, keys_and_tables, move_to_host,  # noqa: E402
                                  oracle_parts, prefill_alone, step_metadata)

SEGMENTS = {"prefix": 13, "A": 29, "B": 22, "own0": 9, "own1": 40}  # keys already cached


def _build(cfg: TopKConfig, host_doc: str | None, seed: int = 0, empty: bool = False):
    """The step (and its oracle); `empty` adds an empty part (a segment of no key) to each sequence."""
    g = torch.Generator().manual_seed(seed)
    lens, keys, tables, total = keys_and_tables(SEGMENTS, g)
    k_cache = torch.full((total, BS, KV_HEADS, DIM), float("nan"))
    v_cache = k_cache.clone()
    summ = torch.full((total, summary_slots_per_block(cfg, BS), cfg.summary_rows, KV_HEADS, DIM), float("nan"))
    # every segment's cached keys (and the blocks' summaries) written by the backend
    filler = TopKBackend(cfg, TorchAttentionBackend(native=False), BS, [summ], native=False)
    meta, k, v = prefill_alone(SEGMENTS, keys, tables)
    filler.begin_step(meta)
    filler.forward(0, torch.randn(k.shape[0], HEADS, DIM, generator=g), k, v, k_cache, v_cache, meta, DIM**-0.5)
    host = None if host_doc is None else move_to_host(tables, host_doc, [k_cache, v_cache, summ])
    q = torch.randn(sum(qlen for *_, qlen in STEP), HEADS, DIM, generator=g) * 1.5
    meta, k_new, v_new = step_metadata(SEGMENTS, lens, keys, tables, host_doc, empty,
                                       None if host is None else [host[:2]])
    step = (q, k_new, v_new, k_cache, v_cache, meta, host)

    # the oracle, part by part on unpaged keys, merged by hand
    want_o, want_l = [], []
    for parts in oracle_parts(SEGMENTS, lens, keys, q, lambda qv, kk, vv, pos: topk_attend(qv, kk, vv, pos, cfg, DIM**-0.5)):
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
