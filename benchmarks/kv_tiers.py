"""KV tiers: multi-turn coding-agent sessions whose KV is several times the device pool, side by side
in one run: (a) the device pool only (evicted KV is recomputed), (b) the pool + a host tier
(evicted KV is copied down and back, engine/kv/tiers.py).

Workload: the serving benchmark's `coding-agent` dataset (benchmarks/serving.py `make_dataset`:
synthetic token ids of exact lengths, built locally, no network): one repository context shared by
every session, then per turn a tool output and the model's reply appended to the history. Sessions
run round by round, each round one `generate` over every session's next turn with at most
`--max-num-seqs` sessions resident, so the others' histories are pushed out of the pool between
their turns. Reported per mode: wall time, throughput (prompt + generated tokens / s), prefill
tokens computed, bytes moved each way, tier hits.

Resume probe (the issue's TTFT targets), in each mode: a `--probe-len`-token session is prefilled,
resumed once while it is still in the device pool (a device hit), the workload runs (pushing it
out), and it is resumed again: from the host tier in (b), recomputed in (a). A resume appends 64
new tokens and asks for one token, so its time is the TTFT. The tier's copy rate is the resume's
bytes host -> device over the time the step waited for them; it is set against the copy worker's
start-up measurement (the engine's cost model) and a plain memcpy, both in the same run.

    python benchmarks/kv_tiers.py --quick --json kv.json --plot kv.png
    python benchmarks/kv_tiers.py --sessions 16 --turns 4 --context-len 2048

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
from common import DEFAULT_CACHE_DIR, copy_bandwidth_gbs, machine_info, markdown_table, preset_checkpoint  # noqa: E402
from serving import PromptBuilder, ServingConfig, make_dataset  # noqa: E402

MODES = ("pool", "pool+host")
RESUME_NEW = 64  # new tokens a resumed turn appends


def sessions(args) -> list[list[tuple[list[int], int]]]:
    cfg = ServingConfig(dataset="coding-agent", num_sessions=args.sessions, turns=args.turns, context_len=args.context_len,
                        tool_output_len=args.tool_output_len, output_len=str(args.output_len))
    data = make_dataset(cfg, PromptBuilder("token-ids"), seed=args.seed)
    return [[(list(t.new_units), t.output_len) for t in s.turns] for s in data]


def kv_stats(llm) -> dict:
    s = llm.stats()
    keys = ("prefill_tokens_computed", "generated_tokens", "prompt_tokens", "cached_tokens", "kv_host_hit_blocks",
            "kv_bytes_device_to_host", "kv_bytes_host_to_device", "kv_transfer_blocked_s", "kv_offloaded_blocks", "preemptions")
    return {k: float(s.get(k, 0)) for k in keys}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def resume(llm, history: list[int], rng: random.Random) -> tuple[float, dict, list[int]]:
    from cuttle.engine import SamplingParams

    prompt = history + [rng.randrange(100, 8000) for _ in range(RESUME_NEW)]
    before = kv_stats(llm)
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t, delta(kv_stats(llm), before), prompt


def run_mode(path: str, mode: str, args, work) -> dict:
    from cuttle.engine import LLM, SamplingParams

    kw = dict(num_host_kv_blocks=args.host_blocks) if mode == "pool+host" else {}
    llm = LLM(path, dtype=args.dtype, num_kv_blocks=args.device_blocks, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_batched_tokens, max_model_len=args.probe_len + 4 * RESUME_NEW, **kw)
    rng = random.Random(args.seed + 1)
    probe = [rng.randrange(100, 8000) for _ in range(args.probe_len)]
    llm.generate([probe], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    t_dev, d_dev, _ = resume(llm, probe, rng)  # still in the device pool

    before = kv_stats(llm)
    t0 = time.perf_counter()
    history = [[] for _ in work]
    rounds = []
    for r in range(len(work[0])):
        prompts = [h + turns[r][0] for h, turns in zip(history, work)]
        params = [SamplingParams(temperature=0, max_tokens=turns[r][1], ignore_eos=True) for turns in work]
        tr = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        rounds.append(time.perf_counter() - tr)
        history = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    wall = time.perf_counter() - t0
    d_work = delta(kv_stats(llm), before)

    t_back, d_back, _ = resume(llm, probe, rng)  # pushed out: host tier in (b), recomputed in (a)
    stats = llm.stats()
    out = {
        "mode": mode, "device_blocks": args.device_blocks, "host_blocks": args.host_blocks if mode == "pool+host" else 0,
        "workload": {"wall_s": wall, "rounds_s": rounds, **d_work,
                     "tokens_per_s": (d_work["prompt_tokens"] + d_work["generated_tokens"]) / wall},
        "probe": {"len": args.probe_len, "ttft_device_hit_s": t_dev, "device_hit": d_dev, "ttft_resumed_s": t_back,
                  "resumed": d_back},
        "copy_worker_gbps": stats.get("kv_copy_bandwidth_gbps"),
        "bytes_per_block": llm.engine.runner.kv.block_bytes,
    }
    if d_back["kv_transfer_blocked_s"] > 0 and d_back["kv_bytes_host_to_device"] > 0:
        out["probe"]["tier_gbps"] = d_back["kv_bytes_host_to_device"] / d_back["kv_transfer_blocked_s"] / 1e9
    del llm
    return out


def plot(results: list[dict], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    pool, host = results
    labels = ["device hit", "host tier (b)", "recompute (a)"]
    vals = [host["probe"]["ttft_device_hit_s"], host["probe"]["ttft_resumed_s"], pool["probe"]["ttft_resumed_s"]]
    ax1.bar(labels, vals, color=["#4c72b0", "#55a868", "#c44e52"])
    ax1.set_yscale("log")
    ax1.set_ylabel("TTFT of the resumed turn (s, log)")
    ax1.set_title(f"resume a {host['probe']['len']}-token session")
    for i, v in enumerate(vals):
        ax1.text(i, v, f"{v:.2f}", ha="center", va="bottom")
    ax2.bar([r["mode"] for r in results], [r["workload"]["prefill_tokens_computed"] for r in results], color=["#c44e52", "#55a868"])
    ax2.set_ylabel("prefill tokens computed (workload)")
    ax2.set_title("coding-agent sessions")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-preset", default="qwen3-0.6b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quick", action="store_true", help="a few minutes on a 2-core CPU")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--context-len", type=int, default=2048)
    ap.add_argument("--tool-output-len", default="128:384")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--probe-len", type=int, default=4096)
    ap.add_argument("--device-blocks", type=int, default=None, help="default: the probe and its resumes plus 8 blocks")
    ap.add_argument("--host-blocks", type=int, default=None, help="default: the workload's KV and the probe, whole")
    ap.add_argument("--max-num-seqs", type=int, default=2)
    ap.add_argument("--max-batched-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help="where preset checkpoints are built")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    if args.quick:
        # the resumed session shrinks to 1k tokens here: a 4k recompute alone takes minutes on 2 cores
        args.sessions, args.turns, args.context_len, args.tool_output_len, args.output_len = 6, 3, 256, "64:128", 8
        args.probe_len = 1024
    bs = 16
    work = sessions(args)
    total_tokens = args.context_len + sum(sum(len(u) + o for u, o in s) - args.context_len for s in work)
    if args.device_blocks is None:
        args.device_blocks = (args.probe_len + 4 * RESUME_NEW) // bs + 8
    if args.host_blocks is None:
        args.host_blocks = (total_tokens + args.probe_len) // bs + 64
    path = preset_checkpoint(args.model_preset, args.cache_dir)
    memcpy = copy_bandwidth_gbs(1 << 28) / 2  # it counts read + write bytes; a tier's bytes are one way
    load = os.getloadavg()
    print(f"{args.model_preset} {args.dtype}: {args.sessions} sessions x {args.turns} turns, unique KV "
          f"{total_tokens + args.probe_len} tokens = {(total_tokens + args.probe_len) / (args.device_blocks * bs):.1f}x the device pool "
          f"({args.device_blocks} blocks); load average {load[0]:.1f} on {os.cpu_count()} cores", flush=True)
    results = []
    for mode in MODES:
        t = time.perf_counter()
        results.append(run_mode(path, mode, args, work))
        print(f"  {mode}: {time.perf_counter() - t:.0f} s", flush=True)
    pool, host = results
    ttft_dev = host["probe"]["ttft_device_hit_s"]
    ttft_host = host["probe"]["ttft_resumed_s"]
    ttft_rec = pool["probe"]["ttft_resumed_s"]
    rows = []
    for r in results:
        w = r["workload"]
        rows.append([r["mode"], f"{w['wall_s']:.1f}", f"{w['tokens_per_s']:.0f}", f"{w['prefill_tokens_computed']:.0f}",
                     f"{w['kv_bytes_device_to_host'] / 1e9:.2f}", f"{w['kv_bytes_host_to_device'] / 1e9:.2f}",
                     f"{w['kv_host_hit_blocks']:.0f}", f"{r['probe']['ttft_device_hit_s']:.2f}", f"{r['probe']['ttft_resumed_s']:.2f}"])
    print()
    print(markdown_table(["mode", "workload s", "tok/s", "prefill tok computed", "GB dev->host", "GB host->dev", "host hit blocks",
                          "TTFT device hit (s)", "TTFT resumed (s)"], rows))
    tier = host["probe"].get("tier_gbps")
    worker = host["copy_worker_gbps"]
    targets = {
        "ttft_vs_recompute": ttft_rec / ttft_host, "ttft_vs_device_hit": ttft_host / ttft_dev,
        "prefill_ratio_b_over_a": host["workload"]["prefill_tokens_computed"] / pool["workload"]["prefill_tokens_computed"],
    }
    print()
    print(f"resume {args.probe_len} tokens: host tier {ttft_host:.2f} s, recompute {ttft_rec:.2f} s ({targets['ttft_vs_recompute']:.1f}x; target >= 20x), "
          f"device hit {ttft_dev:.2f} s ({targets['ttft_vs_device_hit']:.2f}x of it; target <= 1.25x)")
    print(f"prefill tokens computed (b)/(a): {targets['prefill_ratio_b_over_a']:.3f} (target <= 0.2)")
    if tier is not None:
        print(f"copy: the resume moved {host['probe']['resumed']['kv_bytes_host_to_device'] / 1e9:.2f} GB at {tier:.2f} GB/s = "
              f"{tier / worker:.0%} of the copy worker's start-up {worker:.2f} GB/s, {tier / memcpy:.0%} of a memcpy's {memcpy:.2f} GB/s (one way)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "load_average": load, "model": args.model_preset, "dtype": args.dtype,
                       "args": vars(args), "memcpy_gbps": memcpy, "results": results, "targets": targets}, f, indent=1)
    if args.plot:
        plot(results, args.plot, f"{args.model_preset} {args.dtype}, {args.sessions} sessions x {args.turns} turns, "
                                 f"device pool {args.device_blocks} blocks, load {load[0]:.1f}")


if __name__ == "__main__":
    main()
