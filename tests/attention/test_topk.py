"""Training-free top-k attention (issue 16): the option's parsing and refusals, the reference's
rule (budget >= context is dense causal attention; forced sink and local blocks; never a block
after the query; one selection per GQA group), the native decode kernel (vector and scalar paths,
fp32 and bf16) against the reference over the paged cache, with its own count of the keys it read
and a poisoning check that it read nothing else, and the Triton kernel (`triton_topk.py`, in the
interpreter: a subprocess of this file, `python test_topk.py --triton`, with TRITON_INTERPRET=1 set
before triton is imported) on the same cases.

Every kernel case lays sequences out in shuffled physical blocks, fills the raw cache and the block
summaries through `TopKBackend` (prefill on the reference path), then runs one step (decode rows,
or decode rows beside prefill chunks) and compares each row with `topk_attend` over the unpaged
sequence.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

if __name__ == "__main__" and "--triton" in sys.argv and "--cuda" not in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from cuttle.attention.metadata import AttentionMetadata, KVSegment, SeqLayout  # noqa: E402
from cuttle.attention.native import kernels  # noqa: E402
from cuttle.attention.native import topk as native_topk  # noqa: E402
from cuttle.attention.topk import (  # noqa: E402
    TopKConfig, block_scores, parse_sparse_attention, select_blocks, summarize, summarize_sequence, topk_attend,
)
from cuttle.attention.topk_backend import TopKBackend, summary_slots_per_block  # noqa: E402
from cuttle.attention.torch_backend import TorchAttentionBackend  # noqa: E402


# ---- the option ------------------------------------------------------------------------------

def test_spec_string_and_dict():
    cfg = parse_sparse_attention("topk:budget=512,block=32,dense_layers=1,summary=mean")
    assert cfg == TopKConfig(budget=512, block=32, dense_layers=1, summary="mean")
    assert parse_sparse_attention("topk") == TopKConfig()
    assert parse_sparse_attention({"method": "topk", "budget": 256, "block": 16}) == TopKConfig(budget=256, block=16)
    assert parse_sparse_attention(None) is None
    assert parse_sparse_attention(cfg.spec()) == cfg


@pytest.mark.parametrize("spec,match", [
    ("quest:budget=64", r"sparse_attention\.method = 'quest'"),
    ("topk:budget=100,block=64", r"sparse_attention\.budget = 100: must be a multiple of block"),
    ("topk:block=48", r"sparse_attention\.block = 48: must be a power of two"),
    ("topk:budget=x", r"sparse_attention\.budget = 'x': must be an integer"),
    ("topk:summary=max", r"sparse_attention\.summary = 'max'"),
    ("topk:budget=128,block=64", r"sparse_attention\.budget = 128: holds 2 blocks"),
    ("topk:local_blocks=0", r"sparse_attention\.local_blocks = 0"),
    ("topk:dense_layers=-1", r"sparse_attention\.dense_layers = -1"),
    ("topk:top_n=4", r"sparse_attention\.top_n is not a field"),
    ("topk:budget", r"not key=value"),
    ({"method": "topk", "budget": 2048, "window": 3}, r"sparse_attention\.window is not a field"),
    (42, r"sparse_attention must be"),
])
def test_bad_specs_name_the_field(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_sparse_attention(spec)


# ---- the reference's rule --------------------------------------------------------------------

def _seq(n, heads=4, kv_heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, heads, dim, generator=g) * 1.5, torch.randn(n, kv_heads, dim, generator=g) * 1.5,
            torch.randn(n, kv_heads, dim, generator=g))


def _dense(q, k, v, scale):
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("mhd,lhd->hml", q, k.repeat_interleave(group, 1)) * scale
    s = s.masked_fill(torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hml,lhd->mhd", s.softmax(-1), v.repeat_interleave(group, 1)), torch.logsumexp(s, -1).T


@pytest.mark.parametrize("summary", ["quest", "mean"])
def test_budget_at_least_the_context_is_dense_attention(summary):
    q, k, v = _seq(100)
    cfg = TopKConfig(budget=128, block=16, summary=summary)
    o, lse = topk_attend(q, k, v, torch.arange(100), cfg, 0.25)
    o_ref, lse_ref = _dense(q, k, v, 0.25)
    assert (o - o_ref).abs().max() <= 1e-5 and (lse - lse_ref).abs().max() <= 1e-5
    # and a smaller budget is not (the test can fail)
    o_small, _ = topk_attend(q, k, v, torch.arange(100), TopKConfig(budget=48, block=16, summary=summary), 0.25)
    assert (o_small - o_ref).abs().max() > 1e-2


@pytest.mark.parametrize("summary", ["quest", "mean"])
def test_forced_blocks_causality_and_group_sharing(summary):
    q, k, v = _seq(300, heads=8, kv_heads=2, seed=1)
    cfg = TopKConfig(budget=96, block=16, init_blocks=1, local_blocks=2, summary=summary)
    pos = torch.arange(300)
    chosen = select_blocks(block_scores(q, summarize_sequence(k, cfg)[: 300 // 16], cfg, 0.25), pos, cfg, group=4)
    assert chosen.shape == (300, 2, 300 // 16 + 1)  # one selection per KV head: heads of a group share it
    cur = pos // 16
    for t in range(300):
        c = int(cur[t])
        for h in range(2):
            picked = chosen[t, h].nonzero().flatten().tolist()
            assert len(picked) == min(cfg.num_blocks, c + 1)
            assert max(picked) == c and all(j <= c for j in picked)
            if c + 1 > cfg.num_blocks:
                assert 0 in picked and c - 1 in picked  # sink and the block before the query's own


def test_quest_bound_is_an_upper_bound_of_every_key_score():
    q, k, _ = _seq(256, seed=2)
    k[16:32] = k[16]  # a block of one repeated key: there the bound is exact
    cfg = TopKConfig(budget=64, block=16, summary="quest")
    bound = block_scores(q, summarize_sequence(k, cfg), cfg, 1.0)  # [M, H, 16]
    exact = torch.einsum("mhd,lhd->mhl", q, k.repeat_interleave(2, 1)).reshape(256, 4, 16, 16).amax(-1)
    assert bool((bound >= exact - 1e-4).all())
    assert (bound[:, :, 1] - exact[:, :, 1]).abs().max() <= 1e-4 and (bound - exact).abs().max() > 1.0


# ---- the native decode kernel over the paged cache -------------------------------------------

@dataclass(frozen=True)
class Case:
    name: str
    heads: int
    kv_heads: int
    cfg: TopKConfig
    block_size: int
    lengths: tuple[int, ...]  # keys of each sequence after the step
    step: tuple[int, ...]  # query rows of each sequence in the step (1 = decode)
    dim: int = 16


Q16 = TopKConfig(budget=64, block=16, init_blocks=1, local_blocks=2, summary="quest")
M8 = TopKConfig(budget=32, block=8, init_blocks=1, local_blocks=1, summary="mean")
Q32 = TopKConfig(budget=128, block=32, init_blocks=0, local_blocks=1, summary="quest")
CASES = [
    Case("gqa2-quest-B16", 4, 2, Q16, 16, (3, 17, 64, 65, 130, 333), (1,) * 6),
    Case("mha-mean-B16>P", 4, 4, M8, 16, (7, 33, 100, 257), (1,) * 4),  # 2 summaries per raw block
    Case("mqa8-quest-B8<P", 8, 1, Q32, 8, (31, 129, 300), (1,) * 3),  # a block spans 4 raw blocks
    Case("gqa4-dim64", 8, 2, Q16, 16, (90, 200), (1, 1), 64),
    Case("gqa2-mixed", 4, 2, Q16, 16, (7, 60, 90, 200), (1, 5, 1, 33)),  # decode rows beside prefill chunks
]


def build(case: Case, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    """The reference fills the caches on the CPU; `device` takes the step (metadata, inputs,
    caches) to where the kernel under test runs."""
    cfg, g = case.cfg, torch.Generator().manual_seed(seed)
    bs, hkv, dim = case.block_size, case.kv_heads, case.dim
    seqs = [dict(q=torch.randn(n, case.heads, dim, generator=g) * 1.5, k=torch.randn(n, hkv, dim, generator=g) * 1.5,
                 v=torch.randn(n, hkv, dim, generator=g)) for n in case.lengths]
    nblocks = [-(-n // bs) for n in case.lengths]
    total = sum(nblocks) + 2
    perm = torch.randperm(total, generator=g).tolist()
    tables, at = [], 0
    for nb in nblocks:
        tables.append(perm[at : at + nb])
        at += nb
    k_cache = torch.full((total, bs, hkv, dim), float("nan"), dtype=dtype)  # unwritten slots are NaN
    v_cache = k_cache.clone()
    summ = torch.full((total, summary_slots_per_block(cfg, bs), cfg.summary_rows, hkv, dim), float("nan"), dtype=dtype)

    def step(rows, on: str = "cpu"):
        layouts = [SeqLayout(hi - lo, [KVSegment(tables[b], hi, causal=True)]) for b, lo, hi in rows]
        meta = AttentionMetadata.build(layouts, bs, on)
        return meta, {f: torch.cat([seqs[b][f][lo:hi] for b, lo, hi in rows]).to(on, dtype) for f in ("q", "k", "v")}

    prefill = [(b, 0, n - s) for b, (n, s) in enumerate(zip(case.lengths, case.step)) if n - s > 0]
    if prefill:
        meta, x = step(prefill)
        ref = TopKBackend(cfg, TorchAttentionBackend(native=False), bs, [summ], native=False)
        ref.begin_step(meta)
        ref.forward(0, x["q"], x["k"], x["v"], k_cache, v_cache, meta, dim**-0.5)
    meta, x = step([(b, n - s, n) for b, (n, s) in enumerate(zip(case.lengths, case.step))], device)
    k_cache, v_cache, summ = k_cache.to(device), v_cache.to(device), summ.to(device)
    want = []
    for b, (n, s) in enumerate(zip(case.lengths, case.step)):
        sq = {f: t.to(dtype).float() for f, t in seqs[b].items()}
        want.append(topk_attend(sq["q"][n - s :], sq["k"], sq["v"], torch.arange(n - s, n), cfg, dim**-0.5))
    return meta, x, (k_cache, v_cache, summ), want


def run_case(case: Case, dtype: torch.dtype, mode: str) -> float:
    meta, x, (k_cache, v_cache, summ), want = build(case, dtype)
    backend = TopKBackend(case.cfg, TorchAttentionBackend(native=False), case.block_size, [summ])
    assert backend.native, "the native library did not build"
    native_topk.set_fast_path(mode != "scalar")
    native_topk.set_dot_path(mode == "dot")
    try:
        backend.begin_step(meta)
        out, lse = backend.forward(0, x["q"], x["k"], x["v"], k_cache, v_cache, meta, case.dim**-0.5)
    finally:
        native_topk.set_fast_path(True)
        native_topk.set_dot_path(True)
    o_ref, lse_ref = torch.cat([o for o, _ in want]), torch.cat([l for _, l in want])
    if dtype == torch.float32:
        return max((out.cpu() - o_ref).abs().max().item(), (lse.cpu() - lse_ref).abs().max().item())
    ref = TopKBackend(case.cfg, TorchAttentionBackend(native=False), case.block_size, [summ], native=False)
    ref.begin_step(meta)
    o2, l2 = ref.forward(0, x["q"], x["k"], x["v"], k_cache, v_cache, meta, case.dim**-0.5)
    return max((out.float() - o2.float()).abs().max().item(), (lse - l2).abs().max().item())


@pytest.mark.parametrize("mode", ["dot", "avx2", "scalar"])
def test_native_decode_equals_reference(mode):
    """dot: the bf16-dot loop where the build has it (bf16 rows at head_dim 64-256; the others take
    the AVX2 loop), avx2: that loop off, scalar: every vector loop off (csrc/sparse_attend.c)."""
    for case in CASES:
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            err = run_case(case, dtype, mode)
            assert err <= tol, (case.name, dtype, err)


def test_bf16_dot_loop_equals_the_fp32_loops():
    """bf16 q and caches at the head dims the dot loop takes, fp32 output: the same blocks and the
    same o and log-sum-exp as the scalar loops within fp32 rounding, dense rows (context within
    the budget) and sparse ones."""
    from sparse_helpers import shuffled_block_tables

    if not native_topk.set_dot_path(True):
        pytest.skip("this kernel build has no AVX512-BF16 (the dot loop is not compiled in)")
    g = torch.Generator().manual_seed(5)
    for dim, kv_heads, group, bs, summary in ((64, 4, 4, 16, "quest"), (128, 2, 2, 32, "mean"), (256, 2, 1, 16, "quest")):
        cfg = TopKConfig(budget=128, block=bs, init_blocks=1, local_blocks=1, summary=summary)
        lens = [700, 100, 1, 129]
        tables, total = shuffled_block_tables(lens, bs, g)
        k, v = (torch.randn(total, bs, kv_heads, dim, generator=g).bfloat16() for _ in range(2))
        summ = summarize(k.transpose(1, 2), cfg)[:, None]  # one summary per raw block (block == bs)
        q = (torch.randn(len(lens), kv_heads * group, dim, generator=g) * 2).bfloat16()
        lens_t, rows = torch.tensor(lens, dtype=torch.int32), torch.arange(len(lens))
        outs = {}
        lib = kernels().lib
        for mode in ("dot", "dot-no-prefetch", "scalar"):
            native_topk.set_fast_path(mode != "scalar")
            lib.sparse_attend_set_prefetch(int(mode == "dot"))
            try:
                out, lse = torch.empty(q.shape), torch.empty(q.shape[:2])
                sel = torch.empty(len(lens), kv_heads, cfg.num_blocks, dtype=torch.int32)
                native_topk.topk_decode(q, k, v, summ.contiguous(), out, lse, rows, tables, lens_t, cfg, dim**-0.5, selected=sel)
                outs[mode] = out, lse, sel
            finally:
                native_topk.set_fast_path(True)
                lib.sparse_attend_set_prefetch(1)
        assert all(torch.equal(a, b) for a, b in zip(outs["dot"], outs["dot-no-prefetch"])), dim  # the same bits
        assert torch.equal(outs["dot"][2], outs["scalar"][2]), dim
        for i in range(2):
            err = (outs["dot"][i] - outs["scalar"][i]).abs().max().item()
            assert err <= 1e-5, (dim, bs, i, err)


def test_native_selection_and_counter():
    case = CASES[0]
    meta, x, (k_cache, v_cache, summ), _ = build(case, torch.float32)
    backend = TopKBackend(case.cfg, TorchAttentionBackend(native=False), case.block_size, [summ])
    backend.begin_step(meta)
    backend.forward(0, x["q"], x["k"], x["v"], k_cache, v_cache, meta, case.dim**-0.5)
    plan = backend.plan(meta, x["q"], k_cache)
    n = len(case.lengths)
    sel = torch.empty(n, case.kv_heads, case.cfg.num_blocks, dtype=torch.int32)
    touched = torch.empty(n, case.kv_heads, dtype=torch.int64)
    out = torch.empty_like(x["q"])
    native_topk.topk_decode(x["q"], k_cache, v_cache, summ, out, None, plan.native_rows, plan.native_tables, plan.native_lens,
                            case.cfg, case.dim**-0.5, selected=sel, touched=touched)
    for b, length in enumerate(case.lengths):
        k = k_cache[plan.seqs[b][3]].reshape(-1, case.kv_heads, case.dim)[:length]
        q = x["q"][b : b + 1]
        want = select_blocks(block_scores(q, summarize_sequence(k, case.cfg), case.cfg, case.dim**-0.5),
                             torch.tensor([length - 1]), case.cfg, q.shape[1] // case.kv_heads)[0]
        for h in range(case.kv_heads):
            picked = [j for j in sel[b, h].tolist() if j >= 0]
            assert sorted(picked) == want[h].nonzero().flatten().tolist()
            assert touched[b, h].item() == sum(min(16, length - 16 * j) for j in picked)
            assert touched[b, h].item() == (length if length <= 64 else 48 + (length - 1) % 16 + 1)


def test_decode_reads_only_the_chosen_blocks():
    """A 64k context, Qwen3-like block of 64 and budget 2048: 2048 keys read (the own block full),
    and poisoning every other key leaves the output bit-identical."""
    cfg = TopKConfig(budget=2048, block=64, summary="quest")
    context, bs, hkv, dim = 65536, 64, 2, 16
    g = torch.Generator().manual_seed(3)
    nb = context // bs
    k = torch.randn(nb, bs, hkv, dim, generator=g)
    v = torch.randn(nb, bs, hkv, dim, generator=g)
    table = torch.randperm(nb, generator=g).to(torch.int32)
    kl = k[table.long()].reshape(context, hkv, dim)
    summ_cache = torch.empty(nb, 1, 2, hkv, dim)  # block j's summary in the raw block holding it (one slot: B = P)
    summ_cache[table.long(), 0] = summarize_sequence(kl, cfg)
    q = torch.randn(1, hkv * 2, dim, generator=g)
    rows, lens = torch.zeros(1, dtype=torch.int64), torch.tensor([context], dtype=torch.int32)
    sel = torch.empty(1, hkv, cfg.num_blocks, dtype=torch.int32)
    touched = torch.empty(1, hkv, dtype=torch.int64)
    out = torch.empty_like(q)
    native_topk.topk_decode(q, k, v, summ_cache, out, None, rows, table[None], lens, cfg, 0.25, selected=sel, touched=touched)
    assert touched[0].tolist() == [2048, 2048]
    keep = torch.zeros(context, dtype=torch.bool)
    for h in range(hkv):
        for j in sel[0, h].tolist():
            keep[64 * j : 64 * j + 64] = True
    vl = v[table.long()].reshape(context, hkv, dim)
    kl[~keep], vl[~keep] = float("nan"), float("nan")
    k[table.long()], v[table.long()] = kl.view(nb, bs, hkv, dim), vl.view(nb, bs, hkv, dim)
    out2 = torch.empty_like(q)
    native_topk.topk_decode(q, k, v, summ_cache, out2, None, rows, table[None], lens, cfg, 0.25)
    assert torch.equal(out, out2) and not out.isnan().any()


# ---- Triton, in the interpreter (a subprocess of this file) -----------------------------------

def run_triton(case: Case, device: str = "cpu") -> float:
    meta, x, (k_cache, v_cache, summ), want = build(case, torch.float32, device=device)
    backend = TopKBackend(case.cfg, TorchAttentionBackend(native=False), case.block_size, [summ], kernel="triton")
    backend.begin_step(meta)
    out, lse = backend.forward(0, x["q"], x["k"], x["v"], k_cache, v_cache, meta, case.dim**-0.5)
    o_ref, lse_ref = torch.cat([o for o, _ in want]), torch.cat([l for _, l in want])
    return max((out.cpu() - o_ref).abs().max().item(), (lse.cpu() - lse_ref).abs().max().item())


def test_triton_interpreted_equals_reference():
    from sparse_helpers import check_triton_subprocess  # here: the subprocess itself runs without tests/ on its path

    check_triton_subprocess(__file__, {c.name for c in CASES})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on a GPU machine: tests/gpu/run_checks.sh)")
def test_triton_compiled_equals_reference():
    from sparse_helpers import check_triton_subprocess

    check_triton_subprocess(__file__, {c.name for c in CASES}, cuda=True)


def test_triton_backend_is_chosen_beside_non_torch_backends():
    summ = torch.zeros(4, 1, 1, 2, 16)
    assert TopKBackend(M8, TorchAttentionBackend(native=False), 16, [summ]).kernel == "torch"

    class Other:
        name = "triton"

    assert TopKBackend(M8, Other(), 16, [summ]).kernel == "triton"
    with pytest.raises(ValueError, match="top-k kernel"):
        TopKBackend(M8, Other(), 16, [summ], kernel="cuda")


if __name__ == "__main__" and "--triton" in sys.argv:
    # --cuda (a GPU machine; tests/gpu/run_checks.sh): the kernel compiled, the step on the GPU
    for case in CASES:
        print(json.dumps({"case": case.name, "err": run_triton(case, "cuda" if "--cuda" in sys.argv else "cpu")}),
              flush=True)
