"""NSA kernels over the paged caches against the torch reference (issue 16, acceptance 4 and 5).

Every case builds sequences in shuffled physical blocks, fills the raw and compressed caches
through the NSA backend (prefill on the reference path), then runs one step (decode rows, or
decode rows mixed with prefill chunks) on the kernel under test and compares each row with
`nsa_attend` over the unpaged sequence. The native CPU kernel runs here; the Triton kernel runs in
a subprocess of this same file (`python test_nsa_kernels.py --triton`) with TRITON_INTERPRET=1
set before triton is imported. The counter test reads the native kernel's own count of KV tokens
it loaded, and a poisoning check proves nothing else was read.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

if __name__ == "__main__" and "--triton" in sys.argv and "--cuda" not in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from cuttle.attention.metadata import AttentionMetadata, KVSegment, SeqLayout  # noqa: E402
from cuttle.attention.nsa import NSAConfig, compress, compress_windows, nsa_attend  # noqa: E402
from cuttle.attention.nsa_backend import NSABackend, compressed_slots_per_block  # noqa: E402
from cuttle.attention.torch_backend import TorchAttentionBackend  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    heads: int
    kv_heads: int
    cfg: NSAConfig
    block_size: int
    lengths: tuple[int, ...]  # keys of each sequence after the step
    step: tuple[int, ...]  # query rows of each sequence in the step (1 = decode)
    dim: int = 16


A = NSAConfig(compress_block=8, compress_stride=4, select_block=16, top_n=3, init_blocks=1, local_blocks=1, window=24)
B = NSAConfig(compress_block=16, compress_stride=8, select_block=32, top_n=4, init_blocks=1, local_blocks=2, window=40)
C = NSAConfig(compress_block=16, compress_stride=16, select_block=16, top_n=5, init_blocks=2, local_blocks=1, window=0,
              compress_fn="mean")
CASES = [
    Case("gqa2-decode", 4, 2, A, 16, (3, 17, 50, 130, 201), (1, 1, 1, 1, 1)),
    Case("mha-decode", 4, 4, B, 16, (9, 31, 32, 33, 160), (1, 1, 1, 1, 1)),
    Case("mqa8-decode-block8", 8, 1, B, 8, (15, 16, 100, 257), (1, 1, 1, 1)),  # B < d: one slot per block
    Case("gqa2-window0-mean", 4, 2, C, 32, (5, 48, 99), (1, 1, 1)),
    Case("gqa2-mixed", 4, 2, A, 16, (7, 60, 90, 140), (1, 5, 1, 33)),  # decode rows beside prefill chunks
    # head dims the bf16-dot loop of csrc/sparse_attend.c takes (64 / 128 / 256)
    Case("gqa2-dim64", 4, 2, A, 16, (20, 130), (1, 1), 64),
    Case("gqa4-dim128-block8", 8, 2, B, 8, (70, 161), (1, 1), 128),
]


def build(case: Case, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    """Caches filled through the backend's reference path up to each sequence's step, the step's
    metadata and inputs, and the reference output of every step row. The reference runs on the
    CPU; `device` takes the step (metadata, inputs, caches) to where the kernel under test runs."""
    cfg, g = case.cfg, torch.Generator().manual_seed(seed)
    bs, hkv, dim = case.block_size, case.kv_heads, case.dim
    seqs = []
    for n in case.lengths:
        seqs.append(dict(q=torch.randn(n, case.heads, dim, generator=g) * 1.5, k=torch.randn(n, hkv, dim, generator=g) * 1.5,
                         v=torch.randn(n, hkv, dim, generator=g), gates=torch.rand(n, case.heads, 3, generator=g)))
    weight = None if cfg.compress_fn == "mean" else torch.randn(hkv, cfg.compress_block * dim, dim, generator=g) * 0.1
    nblocks = [-(-n // bs) for n in case.lengths]
    total = sum(nblocks) + 2
    perm = torch.randperm(total, generator=g).tolist()
    tables, at = [], 0
    for nb in nblocks:
        tables.append(perm[at : at + nb])
        at += nb
    slots = compressed_slots_per_block(cfg, bs)
    k_cache = torch.full((total, bs, hkv, dim), float("nan"), dtype=dtype)  # unwritten slots are NaN
    v_cache, ck_cache, cv_cache = k_cache.clone(), k_cache[:, :slots].clone(), k_cache[:, :slots].clone()
    caches = (k_cache, v_cache, ck_cache, cv_cache)

    def compressor(wk, wv):
        w = None if weight is None else weight.to(wk.device)
        return compress_windows(wk, w, cfg), compress_windows(wv, w, cfg)

    def step(rows: list[tuple[int, int, int]], on: str = "cpu"):  # (seq, first key, keys after the step)
        layouts = [SeqLayout(hi - lo, [KVSegment(tables[b], hi, causal=True)]) for b, lo, hi in rows]
        meta = AttentionMetadata.build(layouts, bs, on)
        cat = {f: torch.cat([seqs[b][f][lo:hi] for b, lo, hi in rows]).to(on) for f in ("q", "k", "v", "gates")}
        return meta, cat

    prefill = [(b, 0, n - s) for b, (n, s) in enumerate(zip(case.lengths, case.step)) if n - s > 0]
    if prefill:
        meta, x = step(prefill)
        ref_backend = NSABackend(cfg, TorchAttentionBackend(native=False), bs, native=False)
        ref_backend.begin_step(meta)
        ref_backend.forward_nsa(0, x["q"].to(dtype), x["k"].to(dtype), x["v"].to(dtype), x["gates"], caches, meta,
                                dim**-0.5, compressor)
    meta, x = step([(b, n - s, n) for b, (n, s) in enumerate(zip(case.lengths, case.step))], device)
    caches = tuple(c.to(device) for c in caches)
    want = []
    for b, (n, s) in enumerate(zip(case.lengths, case.step)):
        sq = {f: t.to(dtype).float() if f != "gates" else t for f, t in seqs[b].items()}
        ck, cv = compress(sq["k"], weight, cfg), compress(sq["v"], weight, cfg)
        pos = torch.arange(n - s, n)
        o, idx = nsa_attend(sq["q"][n - s :], sq["k"], sq["v"], ck.to(dtype).float(), cv.to(dtype).float(),
                            sq["gates"][n - s :], pos, cfg, dim**-0.5)
        want.append((o, idx))
    return meta, x, caches, compressor, want


def run_kernel(case: Case, kernel: str, dtype: torch.dtype, device: str = "cpu") -> float:
    meta, x, caches, compressor, want = build(case, dtype, device=device)
    backend = NSABackend(case.cfg, TorchAttentionBackend(native=False), case.block_size, kernel=kernel)
    if kernel == "torch":
        assert backend.native, "the native library did not build"
    backend.begin_step(meta)
    args = (x["q"].to(dtype), x["k"].to(dtype), x["v"].to(dtype), x["gates"], caches, meta, case.dim**-0.5, compressor)
    out = backend.forward_nsa(0, *args)
    if dtype == torch.float32:
        return (out.cpu() - torch.cat([o for o, _ in want])).abs().max().item()  # NaN (a slot nothing wrote) fails
    # bf16 caches: against the reference path of the backend on the same cached (rounded) entries
    ref = NSABackend(case.cfg, TorchAttentionBackend(native=False), case.block_size, native=False)
    ref.begin_step(meta)
    return (out.float() - ref.forward_nsa(0, *args).float()).abs().max().item()


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def test_native_decode_equals_reference():
    import pytest

    from cuttle.attention.native import topk as native_topk

    # the bf16-dot loop (AVX512-BF16 builds; bf16 rows at head_dim 64-256), the AVX2 loop (where the
    # CPU has it) and the scalar loops (csrc/sparse_attend.c)
    for mode in ("dot", "avx2", "scalar"):
        native_topk.set_fast_path(mode != "scalar")
        native_topk.set_dot_path(mode == "dot")
        try:
            for case in CASES:
                for dtype in (torch.float32, torch.bfloat16):
                    err = run_kernel(case, "torch", dtype)
                    if not err <= TOL[dtype]:
                        pytest.fail(f"{case.name} {dtype} {mode}: max error {err}")
        finally:
            native_topk.set_fast_path(True)
            native_topk.set_dot_path(True)


def test_prefill_rows_take_the_native_kernel():
    """Every row of a step mixing decode rows and prefill chunks is planned onto the native kernel,
    each with its own key count (the reference path is only for what the kernel does not take);
    test_native_decode_equals_reference checks those rows against the reference."""
    case = next(c for c in CASES if c.name == "gqa2-mixed")
    meta, x, caches, compressor, want = build(case, torch.float32)
    backend = NSABackend(case.cfg, TorchAttentionBackend(native=False), case.block_size)
    assert backend.native, "the native library did not build"
    backend.begin_step(meta)
    plan = backend.plan(meta, x["q"], caches[0])
    assert plan.torch_seqs == [] and plan.native_rows.tolist() == list(range(x["q"].shape[0]))
    lens = [n - s + j + 1 for n, s in zip(case.lengths, case.step) for j in range(s)]
    assert plan.native_lens.tolist() == lens
    reference = NSABackend(case.cfg, TorchAttentionBackend(native=False), case.block_size, native=False)
    assert reference.plan(meta, x["q"], caches[0]).native_rows is None


def test_bf16_dot_loop_equals_the_fp32_loops():
    """bf16 q and caches at the head dims the dot loop takes, fp32 output: the same blocks chosen
    and the same output as the scalar loops within fp32 rounding (the dot loop sums q . k exactly
    multiplied, then scales; the others scale q first), for raw blocks larger and smaller than
    the compression stride."""
    import pytest

    from cuttle.attention.native import nsa as native_nsa
    from cuttle.attention.native import topk as native_topk
    from sparse_helpers import shuffled_block_tables

    if not native_topk.set_dot_path(True):
        pytest.skip("this kernel build has no AVX512-BF16 (the dot loop is not compiled in)")
    cfg = NSAConfig(compress_block=32, compress_stride=16, select_block=64, top_n=4, init_blocks=1, local_blocks=2,
                    window=100)
    g = torch.Generator().manual_seed(3)
    for dim, kv_heads, group, bs in ((64, 4, 4, 16), (128, 2, 2, 64), (256, 2, 1, 8), (128, 1, 8, 32)):
        lens = [900, 77, 1, 129]
        tables, total = shuffled_block_tables(lens, bs, g)
        slots = compressed_slots_per_block(cfg, bs)
        k, v = (torch.randn(total, bs, kv_heads, dim, generator=g).bfloat16() for _ in range(2))
        ck, cv = (torch.randn(total, slots, kv_heads, dim, generator=g).bfloat16() for _ in range(2))
        q = (torch.randn(len(lens), kv_heads * group, dim, generator=g) * 2).bfloat16()
        gates = torch.rand(len(lens), kv_heads * group, 3, generator=g)
        lens_t, rows = torch.tensor(lens, dtype=torch.int32), torch.arange(len(lens))
        outs = {}
        for mode in ("dot", "scalar"):
            native_topk.set_fast_path(mode == "dot")
            try:
                out = torch.empty(q.shape)
                sel = torch.empty(len(lens), kv_heads, cfg.top_n, dtype=torch.int32)
                native_nsa.nsa_decode(q, k, v, ck, cv, gates, out, rows, tables, lens_t, cfg, dim**-0.5, selected=sel)
                outs[mode] = out, sel
            finally:
                native_topk.set_fast_path(True)
        assert torch.equal(outs["dot"][1], outs["scalar"][1]), dim
        err = (outs["dot"][0] - outs["scalar"][0]).abs().max().item()
        assert err <= 1e-5, (dim, bs, err)


def test_native_selection_equals_reference():
    from cuttle.attention.native import nsa as native_nsa

    for case in CASES[:3]:
        meta, x, caches, compressor, want = build(case, torch.float32)
        backend = NSABackend(case.cfg, TorchAttentionBackend(native=False), case.block_size)
        backend.begin_step(meta)
        backend.forward_nsa(0, x["q"], x["k"], x["v"], x["gates"], caches, meta, case.dim**-0.5, compressor)
        plan = backend.plan(meta, x["q"], caches[0])
        sel = torch.empty(len(case.lengths), case.kv_heads, case.cfg.top_n, dtype=torch.int32)
        out = torch.empty_like(x["q"])
        native_nsa.nsa_decode(x["q"], *caches, x["gates"], out, plan.native_rows, plan.native_tables,
                              plan.native_lens, case.cfg, case.dim**-0.5, selected=sel)
        for b, (_, idx) in enumerate(want):
            assert sel[b].tolist() == idx[0].tolist(), case.name  # same blocks, same rank order


def _counter_setup(context: int, cfg: NSAConfig, kv_heads: int = 2, group: int = 2, dim: int = 16, bs: int = 64):
    g = torch.Generator().manual_seed(1)
    nb = -(-context // bs)
    slots = compressed_slots_per_block(cfg, bs)
    k = torch.randn(nb, bs, kv_heads, dim, generator=g)
    v = torch.randn(nb, bs, kv_heads, dim, generator=g)
    ck = torch.randn(nb, slots, kv_heads, dim, generator=g)
    cv = torch.randn(nb, slots, kv_heads, dim, generator=g)
    q = torch.randn(1, kv_heads * group, dim, generator=g)
    gates = torch.rand(1, kv_heads * group, 3, generator=g)
    table = torch.randperm(nb, generator=g).to(torch.int32)[None]
    return q, (k, v, ck, cv), gates, table


def test_decode_step_touches_compressed_plus_selected_plus_window():
    from cuttle.attention.native import nsa as native_nsa

    cfg = NSAConfig()  # l=32, d=16, l'=64, n=16, w=512: the paper's defaults
    for context in (1000, 8192, 65536):
        q, caches, gates, table = _counter_setup(context, cfg)
        rows, lens = torch.zeros(1, dtype=torch.int64), torch.tensor([context], dtype=torch.int32)
        touched = torch.zeros(1, 2, dtype=torch.int64)
        sel = torch.empty(1, 2, cfg.top_n, dtype=torch.int32)
        out = torch.empty_like(q)
        native_nsa.nsa_decode(q, *caches, gates, out, rows, table, lens, cfg, 0.25, selected=sel, touched=touched)
        nc = (context - 32) // 16 + 1
        blocks = [b for b in sel[0, 0].tolist() if b >= 0]
        selected_keys = sum(min(64, context - 64 * b) for b in blocks)
        assert touched[0].tolist() == [nc + selected_keys + min(512, context)] * 2
        if context == 65536:
            # 4095 compressed + 16 * 64 selected + 512 window; the paper's Table 4 rounds the
            # compressed count to s / d (4096) and says 5632
            assert touched[0, 0].item() == 4095 + 1024 + 512 == 5631
            # nothing else was read: poison every other raw key and value, same output
            keep = torch.zeros(65536, dtype=torch.bool)
            for h in range(2):
                for b in sel[0, h].tolist():
                    keep[64 * b : 64 * b + 64] = True
            keep[-512:] = True
            k, v, ck, cv = caches
            phys = table[0].long()
            kl, vl = k[phys].view(65536, 2, 16), v[phys].view(65536, 2, 16)
            kl[~keep], vl[~keep] = float("nan"), float("nan")
            k[phys], v[phys] = kl.view(-1, 64, 2, 16), vl.view(-1, 64, 2, 16)
            out2 = torch.empty_like(q)
            native_nsa.nsa_decode(q, k, v, ck, cv, gates, out2, rows, table, lens, cfg, 0.25)
            assert torch.equal(out, out2)


# ---- Triton, in the interpreter (a subprocess of this file) -----------------------------------

def test_triton_interpreted_equals_reference():
    from sparse_helpers import check_triton_subprocess  # here: the subprocess itself runs without tests/ on its path

    check_triton_subprocess(__file__, {c.name for c in CASES})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on a GPU machine: tests/gpu/run_checks.sh)")
def test_triton_compiled_equals_reference():
    from sparse_helpers import check_triton_subprocess

    check_triton_subprocess(__file__, {c.name for c in CASES}, cuda=True)


if __name__ == "__main__" and "--triton" in sys.argv:
    # --cuda (a GPU machine; tests/gpu/run_checks.sh): the kernel compiled, the step on the GPU
    for case in CASES:
        err = run_kernel(case, "triton", torch.float32, "cuda" if "--cuda" in sys.argv else "cpu")
        print(json.dumps({"case": case.name, "err": err}), flush=True)
