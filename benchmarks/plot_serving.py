"""Plots of serving benchmark results: output throughput, TTFT p50/p99 and TPOT p50 against load,
one line per result file (one engine each), for `serving.py --json` outputs.

    python benchmarks/plot_serving.py cuttle.json vllm.json llamacpp.json -o serving.png

Owns drawing only; the numbers come from the JSON as written. The x axis is the offered load
(request rate, or concurrency for fixed-concurrency sweeps), so engines line up on the same x.
"""
from __future__ import annotations

import argparse
import json
from typing import Any


def _x(level: dict[str, Any]) -> float:
    return float(level["concurrency"] if level["arrival"] == "concurrency" else level["rate"])


def _nan(v: float | None) -> float:
    return float("nan") if v is None else v


def plot(runs: list[dict[str, Any]], path: str, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    # (axis label, summary key, statistic, also draw p99): the tail is what an agent waits on
    panels = [("output tok/s", "output_throughput", None, False), ("TTFT (ms)", "ttft_ms", "p50", True),
              ("TPOT (ms)", "tpot_ms", "p50", False), ("E2E (ms)", "e2e_ms", "p50", True)]
    xlabel = "load"
    for run in runs:
        cfg = run["config"]
        label = cfg.get("label") or cfg.get("model")
        res = sorted(run["results"], key=lambda r: _x(r["level"]))
        if not res:
            continue
        xs = [_x(r["level"]) for r in res]
        xlabel = "concurrency" if res[0]["level"]["arrival"] == "concurrency" else "request rate (req/s)"
        for ax, (_, key, stat, tail) in zip(axes, panels):
            ys = [_nan(r[key] if stat is None else r[key][stat]) for r in res]
            line, = ax.plot(xs, ys, "-", marker="o", label=label if stat is None else f"{label} {stat}")
            if tail:
                ax.plot(xs, [_nan(r[key]["p99"]) for r in res], "--", marker="x", color=line.get_color(), label=f"{label} p99")
    for ax, (name, _, _, _) in zip(axes, panels):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    datasets = sorted({run["config"]["dataset"] for run in runs})
    fig.suptitle(title or f"serving: {', '.join(datasets)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="serving.py --json files, one per engine")
    ap.add_argument("-o", "--out", required=True, help="PNG path")
    ap.add_argument("--title", default=None)
    a = ap.parse_args()
    runs = []
    for p in a.results:
        with open(p) as f:
            runs.append(json.load(f))
    plot(runs, a.out, a.title)


if __name__ == "__main__":
    main()
