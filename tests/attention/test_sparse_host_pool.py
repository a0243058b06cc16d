"""The NSA and top-k CPU kernels reading blocks of the KV host tier in place (csrc/host_pool.h):
a block-table entry flagged HOST_BLOCK names a block of the host pool, whose raw K/V and
companions (NSA's compressed entries, top-k's summaries) lie at that index of the host tensors.

Each case builds one pool of shuffled blocks, then moves a random subset of every sequence's
blocks to a host pool at other indices (their compressed entries / summaries with them) and
flags those table entries. The kernels must give the single-pool call's bits: outputs, log-sum-
exp, chosen blocks and the touched counts, on every loop (the bf16 dot loop where built, AVX2,
scalar), fp32 and bf16, at head dims the dot loop takes and one it does not. A flagged table with
no host pool is refused. `gather_pools`, the torch paths' two-pool gather, is checked on its own.
"""
from __future__ import annotations

import pytest
import torch

from cuttle.attention.backend import gather_pools
from cuttle.attention.metadata import HOST_BLOCK
from cuttle.attention.native import kernels
from cuttle.attention.native import nsa as native_nsa
from cuttle.attention.native import topk as native_topk
from cuttle.attention.nsa import NSAConfig
from cuttle.attention.nsa_backend import compressed_slots_per_block
from cuttle.attention.topk import TopKConfig
from sparse_helpers import shuffled_block_tables

pytestmark = pytest.mark.skipif(not native_nsa.available(), reason="the native CPU kernels did not build")

MODES = ("dot", "avx2", "scalar")


def _mode(mode: str) -> None:
    native_topk.set_fast_path(mode != "scalar")
    native_topk.set_dot_path(mode == "dot")


@pytest.fixture(autouse=True)
def _restore_loops():
    yield
    native_topk.set_fast_path(True)
    native_topk.set_dot_path(True)


def split_pools(tables: torch.Tensor, lens: list[int], block_size: int, caches: list[torch.Tensor],
                g: torch.Generator) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Move about half of each sequence's blocks (random ones) to a host pool at shuffled indices:
    returns the flagged tables and the host tensors (the same layout as `caches`, blocks first).
    The device copies of moved blocks are poisoned, so reading the wrong pool cannot pass."""
    nbs = [-(-n // block_size) for n in lens]
    moved = [(i, b) for i, nb in enumerate(nbs) for b in range(nb) if torch.rand(1, generator=g).item() < 0.5]
    host_ids = torch.randperm(len(moved) + 2, generator=g)[: len(moved)]
    hosts = [torch.full((len(moved) + 2, *c.shape[1:]), float("nan"), dtype=c.dtype) for c in caches]
    flagged = tables.clone()
    for (i, b), h in zip(moved, host_ids.tolist()):
        dev = int(tables[i, b])
        for c, hc in zip(caches, hosts):
            hc[h] = c[dev]
        flagged[i, b] = h | HOST_BLOCK
    for (i, b) in moved:
        for c in caches:
            c[int(tables[i, b])] = float("nan")
    assert moved, "the split moved no block"
    return flagged, hosts


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nsa_reads_host_blocks_in_place_bit_identical(mode, dtype):
    cfg = NSAConfig(compress_block=32, compress_stride=16, select_block=64, top_n=4, init_blocks=1, local_blocks=1,
                    window=48)
    g = torch.Generator().manual_seed(11)
    for dim, kv_heads, group, bs in ((16, 2, 2, 16), (64, 2, 4, 16), (128, 1, 8, 32), (64, 2, 2, 8)):
        lens = [300, 65, 1, 181]
        tables, total = shuffled_block_tables(lens, bs, g)
        slots = compressed_slots_per_block(cfg, bs)
        k, v = (torch.randn(total, bs, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
        ck, cv = (torch.randn(total, slots, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
        q = (torch.randn(len(lens), kv_heads * group, dim, generator=g) * 2).to(dtype)
        gates = torch.rand(len(lens), kv_heads * group, 3, generator=g)
        lens_t, rows = torch.tensor(lens, dtype=torch.int32), torch.arange(len(lens))
        _mode(mode)

        def run(tab, caches, host=None):
            out = torch.empty(q.shape, dtype=dtype)
            sel = torch.empty(len(lens), kv_heads, cfg.top_n, dtype=torch.int32)
            touched = torch.empty(len(lens), kv_heads, dtype=torch.int64)
            native_nsa.nsa_decode(q, *caches, gates, out, rows, tab, lens_t, cfg, dim**-0.5, selected=sel,
                                  touched=touched, host=host)
            return out, sel, touched

        want = run(tables, (k, v, ck, cv))
        flagged, host = split_pools(tables, lens, bs, [k, v, ck, cv], g)
        got = run(flagged, (k, v, ck, cv), tuple(host))
        for a, b in zip(want, got):
            assert torch.equal(a, b), (dim, bs, mode)
        with pytest.raises(ValueError, match="names a host block"):
            run(flagged, (k, v, ck, cv))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_reads_host_blocks_in_place_bit_identical(mode, dtype):
    g = torch.Generator().manual_seed(12)
    for dim, kv_heads, group, bs, P, summary in ((16, 2, 2, 16, 8, "quest"), (64, 2, 4, 16, 16, "mean"),
                                                 (128, 1, 8, 32, 32, "quest")):
        cfg = TopKConfig(budget=4 * P, block=P, init_blocks=1, local_blocks=1, summary=summary)
        lens = [400, 33, 1, 150]
        tables, total = shuffled_block_tables(lens, bs, g)
        k, v = (torch.randn(total, bs, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
        summ = torch.randn(total, bs // P, cfg.summary_rows, kv_heads, dim, generator=g).to(dtype)
        q = (torch.randn(len(lens), kv_heads * group, dim, generator=g) * 2).to(dtype)
        lens_t, rows = torch.tensor(lens, dtype=torch.int32), torch.arange(len(lens))
        _mode(mode)

        def run(tab, host=None):
            out, lse = torch.empty(q.shape, dtype=dtype), torch.empty(q.shape[:2])
            sel = torch.empty(len(lens), kv_heads, cfg.num_blocks, dtype=torch.int32)
            touched = torch.empty(len(lens), kv_heads, dtype=torch.int64)
            native_topk.topk_decode(q, k, v, summ, out, lse, rows, tab, lens_t, cfg, dim**-0.5, selected=sel,
                                    touched=touched, host=host)
            return out, lse, sel, touched

        want = run(tables)
        flagged, host = split_pools(tables, lens, bs, [k, v, summ], g)
        got = run(flagged, tuple(host))
        for a, b in zip(want, got):
            assert torch.equal(a, b), (dim, bs, mode)
        with pytest.raises(ValueError, match="names a host block"):
            run(flagged)


def test_the_loops_under_test_are_the_ones_built():
    """The dot mode runs the dot loop only where this build has it (else the cases above ran the
    AVX2 loop twice, said here rather than skipped silently)."""
    lib = kernels().lib
    assert lib is not None
    built = bool(lib.sparse_attend_dot_available())
    assert native_topk.set_dot_path(True) == built


def test_gather_pools_reads_each_row_from_its_pool():
    dev = torch.arange(12.0).view(6, 2)
    host = -torch.arange(8.0).view(4, 2) - 1
    base = 100
    idx = torch.tensor([0, base + 3, 5, base, 2])
    got = gather_pools(dev, host, idx, base)
    assert torch.equal(got, torch.stack([dev[0], host[3], dev[5], host[0], dev[2]]))
    assert torch.equal(gather_pools(dev, None, torch.tensor([1, 4]), base), dev[[1, 4]])
