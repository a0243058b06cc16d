"""The whole engine comparison (issue 7) in one command: offline throughput, then serving sweeps
for cuttle, vLLM and llama.cpp on the same checkpoint, with results, plots and markdown tables.

    python benchmarks/run_all.py                     # qwen3-0.6b-shaped random checkpoint, standard sizes
    python benchmarks/run_all.py --full              # the large serving workloads (hours on 2 cores)
    python benchmarks/run_all.py --quick             # smoke run: few requests, short outputs
    python benchmarks/run_all.py --engines cuttle --serving-model embedded --quick

Steps: (1) `throughput.py --model-preset P --json` as a subprocess; (2) per engine, its server is
launched through `peers.servers.launch` (a peer that is not installed is reported as skipped, and
the run goes on), then `serving.py`'s datasets run against it: `random` at fixed concurrencies
(>= 3 levels), `random` at Poisson rates set from the first engine's (cuttle's) measured capacity (the same offered
rates for every engine), `shared-prefix` and `coding-agent`. Everything lands in
benchmarks/results/<date>/: one JSON per engine and workload, PNG plots, summary.md.

Owns the choice of workloads and their sizes; how a request is measured is serving.py's, how a
peer is started is peers/servers.py's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zlib
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import serving
from common import PRESETS, markdown_table
from serving import ServingConfig

ENGINES = ("cuttle", "vllm", "llamacpp")
# llama-cpp-python's server takes prompts as strings only; the others take token ids, which skip
# tokenization and so measure the engine rather than its tokenizer
PROMPT_FORMAT = {"llamacpp": "text"}
RATE_FRACTIONS = (0.25, 0.5, 0.9)  # Poisson rates as fractions of the capacity measured on cuttle


def workloads(size: str) -> dict[str, Any]:
    """Sizes of every workload. Requests per concurrency level grow with the level, so each level
    runs long enough to reach its steady state; a coding-agent session's last turn stays under
    4096 tokens (the presets' context and llama.cpp's n_ctx). `standard` is sized so the three
    engines finish in about half an hour on 2 cores with the 0.6B preset; `full` takes hours there."""
    if size == "standard":
        return dict(concurrencies=[1, 4, 16], per_slot=2, min_requests=4, input_len="128:256", output_len="64",
                    rate_requests=24, prefix=dict(num_requests=24, num_prefixes=4, prefix_len=512, suffix_len="32:64", concurrency=8),
                    agent=dict(num_sessions=6, turns=3, context_len=1024, tool_output_len="64:128", concurrency=6))
    if size == "quick":
        return dict(concurrencies=[1, 2, 4], per_slot=2, min_requests=4, input_len="32:128", output_len="16",
                    rate_requests=8, prefix=dict(num_requests=8, num_prefixes=2, prefix_len=256, suffix_len="16:32", concurrency=4),
                    agent=dict(num_sessions=4, turns=3, context_len=512, tool_output_len="32:64", concurrency=4))
    return dict(concurrencies=[1, 8, 32], per_slot=4, min_requests=8, input_len="128:512", output_len="128",
                rate_requests=64, prefix=dict(num_requests=64, num_prefixes=4, prefix_len=1024, suffix_len="32:128", concurrency=16),
                agent=dict(num_sessions=16, turns=5, context_len=1536, tool_output_len="128:256", concurrency=16))


def run_throughput(args: argparse.Namespace, out_dir: str) -> str:
    """Runs throughput.py; returns the markdown table it printed (or why there is none)."""
    cmd = [sys.executable, os.path.join(HERE, "throughput.py"), "--model-preset", args.model_preset,
           "--json", os.path.join(out_dir, "throughput.json")] + (["--quick"] if args.quick else [])
    print(f"\n## offline throughput\n$ {' '.join(cmd)}", flush=True)
    with open(os.path.join(out_dir, "throughput.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:  # shown live and kept
            sys.stdout.write(line)
            log.write(line)
        rc = proc.wait()
    if rc != 0:
        msg = f"throughput.py failed (exit {rc}); see {out_dir}/throughput.log"
        print(msg + "; going on with serving", flush=True)
        return msg
    with open(os.path.join(out_dir, "throughput.log")) as f:
        return "".join(line for line in f if line.startswith("|"))


def serving_model(args: argparse.Namespace) -> str:
    if args.serving_model == "embedded":
        from cuttle.engine.default_model import default_model_path

        return default_model_path()
    if args.serving_model == "preset":
        from common import preset_checkpoint

        return preset_checkpoint(args.model_preset)
    return args.serving_model


def run_engine(engine: str, model_path: str, args: argparse.Namespace, w: dict[str, Any], out_dir: str,
               rates: list[float] | None) -> tuple[dict[str, dict[str, Any]], list[float] | None]:
    """All workloads against one engine's server: {workload name: serving result JSON}."""
    from peers.servers import PeerUnavailable, free_port, launch

    done: dict[str, dict[str, Any]] = {}
    try:
        with launch(engine, model_path, free_port(), log=os.path.join(out_dir, f"{engine}-server.log")) as (base_url, model_name):
            common = dict(base_url=base_url, model=model_name, label=engine, output_len=w["output_len"],
                          prompt_format=args.prompt_format or PROMPT_FORMAT.get(engine, "token-ids"),
                          tokenizer=model_path if os.path.isfile(os.path.join(model_path, "tokenizer.json")) else None,
                          slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, timeout_s=args.timeout)

            def one(name: str, levels: list[ServingConfig]) -> None:
                merged: dict[str, Any] | None = None
                for i, cfg in enumerate(levels):
                    cfg.warmup = 2 if i == 0 else 0
                    # each workload and level its own prompts: the server's prefix cache outlives a level
                    cfg.seed = args.seed * 1_000_003 + zlib.crc32(f"{name}:{i}".encode())
                    out = serving.run(cfg)
                    merged = out if merged is None else {**merged, "results": merged["results"] + out["results"]}
                merged["config"]["workload"] = name
                merged["config"]["model_path"] = model_path
                done[name] = merged
                with open(os.path.join(out_dir, f"{engine}-{name}.json"), "w") as f:
                    json.dump(merged, f, indent=1)

            one("random-concurrency", [
                ServingConfig(**common, dataset="random", input_len=w["input_len"], arrival="concurrency", concurrencies=[c],
                              num_requests=max(w["min_requests"], w["per_slot"] * c)) for c in w["concurrencies"]])
            if rates is None:  # the first engine (cuttle) sets the offered rates for everyone
                top = done["random-concurrency"]["results"][-1]["request_throughput"]
                rates = [round(top * f, 3) for f in RATE_FRACTIONS] if top > 0 else None
            if rates:
                one("random-rate", [ServingConfig(**common, dataset="random", input_len=w["input_len"], arrival="poisson",
                                                  request_rates=[r], num_requests=w["rate_requests"]) for r in rates])
            p = dict(w["prefix"])
            c = p.pop("concurrency")
            one("shared-prefix", [ServingConfig(**common, dataset="shared-prefix", arrival="concurrency", concurrencies=[c], **p)])
            a = dict(w["agent"])
            c = a.pop("concurrency")
            one("coding-agent", [ServingConfig(**common, dataset="coding-agent", arrival="concurrency", concurrencies=[c], **a)])
    except PeerUnavailable as e:
        print(f"{engine}: skipped: {e}", flush=True)
    except Exception as e:  # noqa: BLE001 - one engine that breaks must not cost the others' results
        print(f"{engine}: failed: {type(e).__name__}: {e}", flush=True)
    return done, rates


def report(all_runs: dict[str, dict[str, dict[str, Any]]], out_dir: str) -> str:
    """Markdown tables (one per workload, a row per engine per load level) and one PNG per workload."""
    from plot_serving import plot

    parts = []
    names = []
    for runs in all_runs.values():
        names += [n for n in runs if n not in names]
    for name in names:
        runs = [(engine, r[name]) for engine, r in all_runs.items() if name in r]
        rows = [row for engine, r in runs for row in serving.table_rows(r, engine)]
        cfg = runs[0][1]["config"]
        slo = f"goodput: req/s with TTFT <= {cfg['slo_ttft_ms']} ms and TPOT <= {cfg['slo_tpot_ms']} ms"
        parts.append(f"### {name}\n\nlatencies in ms; {slo}\n\n" + markdown_table(serving.TABLE_HEADERS, rows))
        png = os.path.join(out_dir, f"{name}.png")
        plot([r for _, r in runs], png, title=f"{name} ({os.path.basename(cfg['model_path'])})")
        parts[-1] += f"\n\nplot: {png}"
    return "\n\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: few requests, short prompts and outputs")
    ap.add_argument("--full", action="store_true", help="the large serving workloads (hours on 2 cores)")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)}")
    ap.add_argument("--model-preset", default="qwen3-0.6b", choices=sorted(PRESETS), help="throughput.py's checkpoint (and serving's, by default)")
    ap.add_argument("--serving-model", default="preset", help="'preset' (the same checkpoint), 'embedded' (cuttle's tiny coder) or a path")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--prompt-format", default=None, choices=["token-ids", "text"], help="default: token ids, text for llamacpp")
    ap.add_argument("--request-rates", type=serving._floats, default=None, help="Poisson rates (default: fractions of the first engine's capacity)")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=200.0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="longest silence in a stream before a request fails (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "results", time.strftime("%Y-%m-%d")))
    args = ap.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    if unknown := set(engines) - set(ENGINES):
        ap.error(f"unknown engines {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    os.makedirs(args.out, exist_ok=True)
    from common import machine_info

    info = machine_info()
    print(f"machine: {info}\nresults: {args.out}", flush=True)
    throughput = "skipped (--skip-throughput)" if args.skip_throughput else run_throughput(args, args.out)
    model_path = serving_model(args)
    w = workloads("quick" if args.quick else "full" if args.full else "standard")
    print(f"\n## serving: {model_path}", flush=True)
    all_runs: dict[str, dict[str, dict[str, Any]]] = {}
    rates = args.request_rates
    for engine in engines:
        print(f"\n### {engine}", flush=True)
        runs, rates = run_engine(engine, model_path, args, w, args.out, rates)
        if runs:
            all_runs[engine] = runs
    if not all_runs:
        print("no engine ran", flush=True)
        sys.exit(1)
    md = f"## offline throughput ({args.model_preset})\n\n{throughput}\n\n## serving ({model_path})\n\n" + report(all_runs, args.out)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(f"machine: {info}\ncommand: {' '.join(sys.argv)}\n\n{md}\n")
    print("\n" + md, flush=True)


if __name__ == "__main__":
    main()
