"""Micro-benchmark (run by hand, not a test): the torch backend's single-segment step on a
Qwen3-0.6B-like shape (16 q heads, 8 KV heads, head_dim 128, bf16, block 16).

    python tests/attention/bench_single_segment.py [--attention-dir DIR] [--api v1|v2] [--threads N]

--attention-dir imports `cuttle.attention` from another checkout (e.g. `git archive HEAD attention`
unpacked elsewhere), so before/after numbers come from the same process layout on the same
machine; --api v1 calls the old `forward(q, ...) -> o`. Prints the minimum and the median
milliseconds of begin_step and of one layer's forward (K/V write + attention). With --threads 1
the clock is the thread's CPU time, which a busy machine disturbs much less than wall time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import types

ap = argparse.ArgumentParser()
ap.add_argument("--attention-dir")
ap.add_argument("--api", choices=["v1", "v2"], default="v2")
ap.add_argument("--reps", type=int, default=30)
ap.add_argument("--threads", type=int, default=0)
ap.add_argument("--only", default="", help="run the cases whose name contains this")
args = ap.parse_args()
if args.attention_dir:
    import cuttle  # noqa: F401  (the namespace package)

    pkg = types.ModuleType("cuttle.attention")
    pkg.__path__ = [args.attention_dir]
    sys.modules["cuttle.attention"] = pkg

import torch  # noqa: E402

from cuttle.attention.metadata import AttentionMetadata  # noqa: E402
from cuttle.attention.torch_backend import TorchAttentionBackend  # noqa: E402

H, HKV, D, BS = 16, 8, 128, 16
if args.threads:
    torch.set_num_threads(args.threads)
clock = time.thread_time if args.threads == 1 else time.perf_counter


def batch(cached: list[int], new: list[int]):
    g = torch.Generator().manual_seed(0)
    nblocks = [-(-(c + n) // BS) for c, n in zip(cached, new)]
    perm = torch.randperm(sum(nblocks), generator=g).tolist()
    tables, slots = [], []
    for b, nb in enumerate(nblocks):
        t = [perm.pop() for _ in range(nb)]
        tables.append(t)
        slots += [t[i // BS] * BS + i % BS for i in range(cached[b], cached[b] + new[b])]
    T = sum(new)
    width = max(nblocks)
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for b, t in enumerate(tables):
        bt[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    seq_lens = [c + n for c, n in zip(cached, new)]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=bt, slot_mapping=torch.tensor(slots, dtype=torch.int64), block_size=BS,
        max_query_len=max(new), max_seq_len=max(seq_lens), query_lens_cpu=list(new), seq_lens_cpu=seq_lens,
    )
    kc = torch.randn(sum(nblocks), BS, HKV, D, generator=g).bfloat16()
    vc = torch.randn(sum(nblocks), BS, HKV, D, generator=g).bfloat16()
    q = torch.randn(T, H, D, generator=g).bfloat16()
    k = torch.randn(T, HKV, D, generator=g).bfloat16()
    v = torch.randn(T, HKV, D, generator=g).bfloat16()
    return q, k, v, kc, vc, meta


def timed_ms(fn, reps: int) -> tuple[float, float]:
    """(min, median) over `reps` calls after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append((clock() - t0) * 1e3)
    return min(times), statistics.median(times)


CASES = {
    "decode b=1 ctx=1024": ([1023], [1]),
    "decode b=64 ctx=1024": ([1023] * 64, [1] * 64),
    "prefill 4x128 (native rows)": ([0] * 4, [128] * 4),
    "prefill 1x1024 (SDPA)": ([0], [1024]),
    "chunk 512 after 512 (SDPA, mask)": ([512], [512]),
}
for native in (True, False):
    for name, (cached, new) in CASES.items():
        if (not native and "native" in name) or args.only not in name:
            continue
        q, k, v, kc, vc, meta = batch(cached, new)
        be = TorchAttentionBackend(native=native)
        if args.api == "v2":
            fwd = lambda: be.forward(0, q, k, v, kc, vc, meta, D**-0.5)  # noqa: E731
        else:
            fwd = lambda: be.forward(q, k, v, kc, vc, meta, D**-0.5)  # noqa: E731
        plan = timed_ms(lambda: be.begin_step(meta), args.reps)
        be.begin_step(meta)
        layer = timed_ms(fwd, args.reps)
        print(f"native={int(native)} {name:34s} begin_step min/med {plan[0]:7.3f} {plan[1]:7.3f} ms"
              f"  forward min/med {layer[0]:8.3f} {layer[1]:8.3f} ms", flush=True)
