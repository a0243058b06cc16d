"""KV tiers: multi-turn coding-agent sessions whose KV is several times the device pool, side by side
in one run: (a) the device pool only (evicted KV is recomputed), (b) the pool + a host tier with
copy-in (evicted KV is copied down and back, engine/kv/tiers.py), (c) the pool + the host tier with
read in place (host hits stay where they are; the attention kernel reads them there; the cost
model chooses, `kv_read_in_place="auto"`: on CPU both pools are one RAM, so it reads in place).

Workload: the serving benchmark's `coding-agent` dataset (benchmarks/serving.py `make_dataset`:
synthetic token ids of exact lengths, built locally, no network): one repository context shared by
every session, then per turn a tool output appended to the history and a short reply generated.
Sessions run round by round, one session at a time (`--max-num-seqs`), over a device pool several
times smaller than their KV, so every turn finds its history pushed out by the other sessions.
Reported per mode: wall time, throughput (prompt + generated tokens / s), prefill tokens computed,
bytes moved each way, tier hits, blocks read in place.

Resume probe (the issue's TTFT targets), on one engine with a host tier and a device pool of
about one probe: a `--probe-len`-token session A is prefilled and resumed at once (a device-pool
hit), pushed out to the host tier (every free device block taken through the eviction hook, as an
incoming session's allocation would, without computing one), resumed by copy-in (b), pushed out
again and resumed by read in place (c). Recompute (a) is the same resumed turn with nothing cached,
computed whole (what (a) does for a pushed-out session). A resume appends 64 new tokens and asks for
one token, so its time is the TTFT. The copy's rate is (b)'s bytes host -> device over the time the
step waited for transfers; it is set against a plain one-way memcpy and the copy worker's start-up
figure, both measured in the same run.

    python benchmarks/kv_tiers.py --quick --json kv.json --plot kv.png
    python benchmarks/kv_tiers.py --json kv.json --plot docs/img/kv_tiers.png

fp32 by default: on an AVX2 CPU without AMX bf16 matmuls are several times slower than fp32, and
the tier moves bytes either way (fp32 blocks are twice the bytes, so the copy side is the harder one).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (DEFAULT_CACHE_DIR, PRESETS, copy_bandwidth_gbs, machine_info, make_random_checkpoint,  # noqa: E402
                    markdown_table, preset_checkpoint)
from serving import PromptBuilder, ServingConfig, make_dataset  # noqa: E402

MODES = {"(a) pool": None, "(b) pool+host": "never", "(c) pool+host, read in place": "auto"}
RESUME_NEW = 64  # new tokens a resumed turn appends
BLOCK = 16
KEYS = ("prefill_tokens_computed", "generated_tokens", "prompt_tokens", "cached_tokens", "kv_host_hit_blocks",
        "kv_bytes_device_to_host", "kv_bytes_host_to_device", "kv_transfer_blocked_s", "kv_offloaded_blocks",
        "kv_read_in_place_blocks", "kv_read_in_place_runs", "kv_copy_in_runs", "preemptions")


def kv_shape_checkpoint(preset: str, cache_dir: str) -> str:
    """The preset's KV geometry (layers, heads, KV heads, head_dim: the same bytes per block) with a
    64-wide residual stream and a small vocab: the workload's token and byte counts are the
    preset's (they depend on lengths and KV shape only, replies being fixed-length), at a small
    fraction of its compute. Its times say nothing about the preset's."""
    config, sub = PRESETS[preset]
    small = dict(config, hidden_size=64, intermediate_size=64, vocab_size=8192, eos_token_id=2, bos_token_id=None)
    return make_random_checkpoint(os.path.join(cache_dir, sub + "-kv-shape"), small)


def sessions(args) -> list[list[tuple[list[int], int]]]:
    cfg = ServingConfig(dataset="coding-agent", num_sessions=args.sessions, turns=args.turns, context_len=args.context_len,
                        tool_output_len=args.tool_output_len, output_len=str(args.output_len))
    data = make_dataset(cfg, PromptBuilder("token-ids"), seed=args.seed)
    return [[(list(t.new_units), t.output_len) for t in s.turns] for s in data]


def kv_stats(llm) -> dict:
    s = llm.stats()
    return {k: float(s.get(k, 0)) for k in KEYS}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


CLOCK = time.perf_counter  # --clock cpu: time.process_time (every thread of the process, copy worker included)


def timed(llm, prompt: list[int]) -> tuple[float, dict]:
    """TTFT of one request asking for one token, and what it moved."""
    from cuttle.engine import SamplingParams

    before = kv_stats(llm)
    t = CLOCK()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    return CLOCK() - t, delta(kv_stats(llm), before)


def run_workload(path: str, mode: str, args, work) -> dict:
    from cuttle.engine import LLM, SamplingParams

    read = MODES[mode]
    kw = dict(num_host_kv_blocks=args.host_blocks, kv_read_in_place=read) if read is not None else {}
    llm = LLM(path, dtype=args.dtype, num_kv_blocks=args.device_blocks, max_num_seqs=args.max_num_seqs, num_threads=args.threads,
              max_num_batched_tokens=args.max_batched_tokens, max_model_len=args.device_blocks * BLOCK,
              sparse_attention=args.sparse_attention, **kw)
    llm.generate([[7] * 8], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    before = kv_stats(llm)
    t0 = CLOCK()
    history = [[] for _ in work]
    for r in range(len(work[0])):
        prompts = [h + turns[r][0] for h, turns in zip(history, work)]
        params = [SamplingParams(temperature=0, max_tokens=turns[r][1], ignore_eos=True) for turns in work]
        outs = llm.generate(prompts, params, use_tqdm=False)
        history = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    wall = CLOCK() - t0
    d = delta(kv_stats(llm), before)
    out = {"mode": mode, "wall_s": wall, **d, "tokens_per_s": (d["prompt_tokens"] + d["generated_tokens"]) / wall,
           "final_tokens": [len(h) for h in history]}
    del llm
    return out


def push_out(llm) -> None:
    """Evict every cached block of the device pool as an incoming session's allocation would (take
    every free block, through the eviction hook that offloads them), without computing that
    session: on this machine a second 4k prefill alone would take longer than the time box."""
    pool, tiers = llm.engine.block_manager.pool, llm.engine.tiers
    taken = [pool.take() for _ in range(pool.num_free)]
    for bid in reversed(taken):
        pool.unref(bid)
    tiers.drain()  # the offload copies, done and released
    assert pool.num_free == len(pool)


def run_probe(path: str, args) -> dict:
    """Device hit, copy-in (b), read in place (c) on one tiered engine; recompute (a) first, on the
    same engine while nothing is cached."""
    from cuttle.engine import LLM, SamplingParams

    llm = LLM(path, dtype=args.dtype, num_kv_blocks=args.probe_blocks, num_host_kv_blocks=2 * args.probe_blocks + 16, num_threads=args.threads,
              max_num_seqs=1, max_num_batched_tokens=args.max_batched_tokens, max_model_len=args.probe_len + RESUME_NEW + 16,
              kv_read_in_place="never", sparse_attention=args.sparse_attention)
    tiers = llm.engine.tiers
    rng = random.Random(args.seed + 1)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 8000) for _ in range(n)]

    llm.generate([[7] * 8], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    out: dict = {"len": args.probe_len, "probe_blocks": args.probe_blocks}
    a = tokens(args.probe_len)
    # the resumed turn with nothing cached: what (a) computes for a pushed-out session (it also
    # leaves A's blocks cached for the device hit)
    out["ttft_recompute_s"], out["recompute"] = timed(llm, a + tokens(RESUME_NEW))
    out["ttft_device_hit_s"], out["device_hit"] = timed(llm, a + tokens(RESUME_NEW))
    push_out(llm)  # A goes to the host tier
    out["ttft_copy_in_s"], out["copy_in"] = timed(llm, a + tokens(RESUME_NEW))
    push_out(llm)  # A is already below: nothing is copied down again
    tiers.read_in_place = "auto"  # what (c) runs with: the cost model chooses
    out["ttft_in_place_s"], out["in_place"] = timed(llm, a + tokens(RESUME_NEW))
    moved, blocked = out["copy_in"]["kv_bytes_host_to_device"], out["copy_in"]["kv_transfer_blocked_s"]
    if moved > 0 and blocked > 0:
        out["copy_in_gbps"] = moved / blocked / 1e9
    out["copy_worker_gbps"] = llm.stats().get("kv_copy_bandwidth_gbps")
    out["bytes_per_block"] = llm.engine.runner.kv.block_bytes
    del llm
    return out


def plot(results: list[dict], probe: dict, out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if results else 1, figsize=(12 if results else 6, 4.2), squeeze=False)
    ax1 = axes[0][0]
    labels = ["device hit", "(b) host,\ncopy-in", "(c) host,\nread in place", "(a) recompute"]
    vals = [probe["ttft_device_hit_s"], probe["ttft_copy_in_s"], probe["ttft_in_place_s"], probe["ttft_recompute_s"]]
    ax1.bar(labels, vals, color=["#4c72b0", "#55a868", "#8172b2", "#c44e52"])
    ax1.set_yscale("log")
    ax1.set_ylabel(f"TTFT of the resumed turn ({'CPU ' if CLOCK is time.process_time else ''}s, log)")
    ax1.set_title(f"resume a {probe['len']}-token session (+{RESUME_NEW} new tokens)")
    for i, v in enumerate(vals):
        ax1.text(i, v, f"{v:.2f}", ha="center", va="bottom")
    if not results:
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(out, dpi=120)
        return
    ax2 = axes[0][1]
    ax2.bar([r["mode"].split(" ")[0] for r in results], [r["prefill_tokens_computed"] for r in results],
            color=["#c44e52", "#55a868", "#8172b2"])
    ax2.set_ylabel("prefill tokens computed (workload)")
    ax2.set_title("coding-agent sessions: (a) pool, (b) + host, (c) + read in place")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-preset", default="qwen3-0.6b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quick", action="store_true", help="a few minutes on a 2-core CPU (1k-token probe, smaller workload)")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--context-len", type=int, default=128)
    ap.add_argument("--tool-output-len", default="32:48")
    ap.add_argument("--output-len", type=int, default=2)
    # 4,000 tokens: the resumed turn (+64) stays within the preset's 4,096 positions
    ap.add_argument("--probe-len", type=int, default=4000)
    ap.add_argument("--device-blocks", type=int, default=None, help="workload's device pool (default: its longest session + 4 blocks)")
    ap.add_argument("--host-blocks", type=int, default=None, help="default: the workload's KV, whole")
    ap.add_argument("--max-num-seqs", type=int, default=1)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sparse-attention", default=None,
                    help="top-k sparse attention spec (engine option sparse_attention, e.g. topk:budget=1024,block=64): "
                         "its summaries move and are read in place with the blocks")
    ap.add_argument("--skip-probe", action="store_true")
    ap.add_argument("--skip-workload", action="store_true")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: process CPU time with --threads 1 (a loaded shared machine makes wall time a scheduler measurement)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-shape-only", action="store_true",
                    help="the workload on a checkpoint with the preset's KV shape but a tiny residual stream: "
                         "exact token and byte counts, no meaningful times")
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help="where preset checkpoints are built")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    if args.clock == "cpu":
        global CLOCK
        CLOCK = time.process_time
        args.threads = 1
    if args.quick:
        args.sessions, args.turns, args.context_len, args.tool_output_len = 3, 4, 128, "32:48"
        args.probe_len = 1024
    work = sessions(args)
    lengths = [sum(len(u) + o for u, o in s) for s in work]
    unique = args.context_len + sum(n - args.context_len for n in lengths)
    if args.device_blocks is None:
        args.device_blocks = max(lengths) // BLOCK + 4
    if args.host_blocks is None:
        args.host_blocks = unique // BLOCK + 2 * args.sessions + 16
    args.probe_blocks = (args.probe_len + 2 * RESUME_NEW) // BLOCK + 4
    if args.kv_shape_only and not args.skip_probe:
        raise SystemExit("--kv-shape-only is for the workload's counts: add --skip-probe")
    path = (kv_shape_checkpoint if args.kv_shape_only else preset_checkpoint)(args.model_preset, args.cache_dir)
    memcpy = copy_bandwidth_gbs(1 << 28) / 2  # it counts read + write bytes; a tier's bytes go one way
    load = os.getloadavg()
    print(f"{args.model_preset} {args.dtype}: {args.sessions} sessions x {args.turns} turns, unique KV {unique} tokens = "
          f"{unique / (args.device_blocks * BLOCK):.1f}x the device pool ({args.device_blocks} blocks); "
          f"load average {load[0]:.1f} on {os.cpu_count()} cores", flush=True)
    report: dict = {"machine": machine_info(), "load_average": load, "model": args.model_preset, "dtype": args.dtype,
                    "args": vars(args), "clock": args.clock, "kv_shape_only": args.kv_shape_only, "memcpy_gbps": memcpy, "probe": None, "results": [], "targets": {}}
    targets = report["targets"]

    def save() -> None:
        if args.json:
            report["load_average_end"] = os.getloadavg()
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    probe = None
    if not args.skip_probe:  # first: the TTFT targets
        t = time.perf_counter()
        probe = report["probe"] = run_probe(path, args)
        print(f"  probe: {time.perf_counter() - t:.0f} s (load {os.getloadavg()[0]:.1f})", flush=True)
        rec, dev = probe["ttft_recompute_s"], probe["ttft_device_hit_s"]
        for key, label in (("ttft_copy_in_s", "(b) copy-in"), ("ttft_in_place_s", "(c) read in place")):
            targets[f"{key}_vs_recompute"] = rec / probe[key]
            targets[f"{key}_vs_device_hit"] = probe[key] / dev
            print(f"resume {args.probe_len} tokens from the host tier, {label}: {probe[key]:.2f} s; recompute {rec:.2f} s "
                  f"({rec / probe[key]:.1f}x; target >= 20x); device hit {dev:.2f} s ({probe[key] / dev:.2f}x of it; "
                  "target <= 1.25x)", flush=True)
        ci = probe["copy_in"]
        gbps = probe.get("copy_in_gbps")
        if gbps is not None:
            print(f"copy-in moved {ci['kv_bytes_host_to_device'] / 1e9:.2f} GB host->device (and {ci['kv_bytes_device_to_host'] / 1e9:.2f} "
                  f"GB down) while the step waited {ci['kv_transfer_blocked_s']:.2f} s: {gbps:.2f} GB/s = {gbps / memcpy:.0%} of a one-way "
                  f"memcpy ({memcpy:.2f} GB/s) and {gbps / probe['copy_worker_gbps']:.0%} of the copy worker's start-up "
                  f"{probe['copy_worker_gbps']:.2f} GB/s")
        ip = probe["in_place"]
        print(f"read in place: {ip['kv_read_in_place_blocks']:.0f} blocks read where they lie, "
              f"{ip['kv_bytes_host_to_device'] / 1e9:.2f} GB copied in", flush=True)
        save()
    results = report["results"]
    if not args.skip_workload:
        for mode in MODES:
            t = time.perf_counter()
            results.append(run_workload(path, mode, args, work))
            print(f"  workload {mode}: {time.perf_counter() - t:.0f} s (load {os.getloadavg()[0]:.1f})", flush=True)
            save()
        rows = [[r["mode"], f"{r['wall_s']:.1f}", f"{r['tokens_per_s']:.0f}", f"{r['prefill_tokens_computed']:.0f}",
                 f"{r['kv_bytes_device_to_host'] / 1e9:.2f}", f"{r['kv_bytes_host_to_device'] / 1e9:.2f}",
                 f"{r['kv_host_hit_blocks']:.0f}", f"{r['kv_read_in_place_blocks']:.0f}"] for r in results]
        print()
        print(markdown_table(["mode", "workload s", "tok/s", "prefill tok computed", "GB dev->host", "GB host->dev",
                              "host hit blocks", "read in place"], rows))
        pool, host, in_place = results
        targets["prefill_ratio_b_over_a"] = host["prefill_tokens_computed"] / pool["prefill_tokens_computed"]
        targets["prefill_ratio_c_over_a"] = in_place["prefill_tokens_computed"] / pool["prefill_tokens_computed"]
        print(f"\nprefill tokens computed (b)/(a): {targets['prefill_ratio_b_over_a']:.3f}, (c)/(a): "
              f"{targets['prefill_ratio_c_over_a']:.3f} (target <= 0.2)")
        save()
    if args.plot and probe is not None:
        plot(results, probe, args.plot, f"{args.model_preset} {args.dtype}, {args.sessions} sessions x {args.turns} turns, "
                                        f"device pool {args.device_blocks} blocks, {args.clock} clock, load {load[0]:.1f}")


if __name__ == "__main__":
    main()
