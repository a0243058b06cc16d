"""What an in-place weight update (`LLM.update_weights`, an RL trainer's sync) costs the engine, by
the size of what it writes: one norm tensor, one layer's routed experts (HF names, as a bucket of a
trainer's sync would hold them), every tensor of the checkpoint. Each figure is the median of
`--repeats` updates of the same tensors (their values unchanged, so the outputs too), timed around
the call: checks, writes, and the repacking the engine does after it.

    python benchmarks/weight_update.py [--model-preset qwen3-moe-small] [--dtype bfloat16] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from safetensors import safe_open

from cuttle.engine import LLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import PRESETS, markdown_table, preset_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-preset", default="qwen3-moe-small", choices=sorted(PRESETS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    path = preset_checkpoint(args.model_preset)
    llm = LLM(path, dtype=args.dtype, num_kv_blocks=64, skip_tokenizer_init=True)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        every = [(n, f.get_tensor(n)) for n in f.keys()]
    buckets = {
        "one norm tensor": [(n, t) for n, t in every if n == "model.norm.weight"],
        "layer 0's experts": [(n, t) for n, t in every if n.startswith("model.layers.0.mlp.experts.")],
        "every tensor": every,
    }
    rows = []
    for label, tensors in buckets.items():
        if not tensors:
            continue
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            llm.update_weights(tensors)
            times.append(time.perf_counter() - t0)
        rows.append([label, len(tensors), f"{statistics.median(times) * 1e3:.1f}"])
        print(rows[-1], flush=True)
    print(f"{args.model_preset}, {args.dtype}, medians of {args.repeats}")
    print(markdown_table(["update", "tensors", "ms"], rows))


if __name__ == "__main__":
    main()
