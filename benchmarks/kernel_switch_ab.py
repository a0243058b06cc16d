"""Engine-level A/B of one native-kernel switch: greedy decode with the switch on and off, in one
process on one engine, the two alternating round by round (on/off, then off/on), so both sides see
the same drift of a shared machine.

    python benchmarks/kernel_switch_ab.py --switch mxfp8-placed --batch 2
    python benchmarks/kernel_switch_ab.py --model-preset qwen3-0.6b --switch mxfp8-placed --batch 1

The switches are the ones the kernels expose for tests and A/B timing (`attention/native`); each
round generates --tokens tokens for each of --batch prompts of --prompt-len tokens (prefill
included in the time; keep the prompt short next to the tokens). Reports output tok/s per round,
the medians, their ratio (on / off) and the per-round ratios. Greedy tokens may differ between the
two sides: the loops sum in different orders, and a random-weight model has near ties.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import PRESETS, machine_info, markdown_table, preset_checkpoint  # noqa: E402


def _switches() -> dict:
    from cuttle.attention.native import moe, mxfp8

    return {
        "mxfp8-placed": mxfp8.set_placed_loops,  # AVX2 placed loops (1-2 rows; the experts' one-token tile)
        "mxfp8-bf16-dot": mxfp8.set_bf16_dot,  # the bf16-dot MXFP8 decode loop (AVX512-BF16 + VBMI builds)
        "mxfp8-gfni": mxfp8.set_gfni_decode,  # GFNI byte decode in the bf16-dot loop
        "mxfp8-fast": mxfp8.set_fast_path,  # every vector MXFP8 loop against the scalar one
        "experts-bf16-dot": moe.set_bf16_dot,  # the routed experts' bf16-dot tiles
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-preset", default="qwen3-moe-small", choices=sorted(PRESETS))
    ap.add_argument("--switch", default="mxfp8-placed", choices=sorted(_switches()))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="mxfp8", help="'none' for bf16 linears")
    ap.add_argument("--no-lm-head", action="store_true", help="leave the lm_head in --dtype")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.batch < 1 or args.tokens < 1 or args.rounds < 1:
        ap.error("--batch, --tokens and --rounds must be at least 1")

    from cuttle.engine import LLM, SamplingParams

    setter = _switches()[args.switch]
    if not setter(True):
        sys.exit(f"--switch {args.switch}: not available on this CPU or build")
    quant = None if args.quantization == "none" else args.quantization
    llm = LLM(preset_checkpoint(args.model_preset), dtype=args.dtype, quantization=quant,
              quantize_lm_head=bool(quant) and not args.no_lm_head, enable_prefix_caching=False,
              max_model_len=args.prompt_len + args.tokens + 16)
    reqs = [{"prompt_token_ids": [100 + 7 * i + j % 50 for j in range(args.prompt_len)]} for i in range(args.batch)]
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate(reqs, sp, use_tqdm=False)  # warm-up: kernel builds, graph capture
    rates: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list] = {}
    try:
        for r in range(args.rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                setter(on)
                t = time.perf_counter()
                outs = llm.generate(reqs, sp, use_tqdm=False)
                rates[on].append(args.batch * args.tokens / (time.perf_counter() - t))
                tokens[on] = [o.outputs[0].token_ids for o in outs]
    finally:
        setter(True)
    med = {on: statistics.median(v) for on, v in rates.items()}
    per_round = sorted(a / b for a, b in zip(rates[True], rates[False]))
    print(f"{args.model_preset}, {args.switch}, batch {args.batch}, {args.tokens} tokens, quantization {quant}, "
          f"lm_head {'MXFP8' if quant and not args.no_lm_head else args.dtype}")
    print(markdown_table(["switch", "tok/s by round", "median"],
                         [[("on" if on else "off"), ", ".join(f"{v:.1f}" for v in rates[on]), f"{med[on]:.1f}"]
                          for on in (True, False)]))
    print(f"on / off: {med[True] / med[False]:.3f} (medians); rounds {per_round[0]:.2f}-{per_round[-1]:.2f}; "
          f"same greedy tokens: {tokens[True] == tokens[False]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "rates_on": rates[True], "rates_off": rates[False],
                       "ratio_of_medians": med[True] / med[False]}, f, indent=1)


if __name__ == "__main__":
    main()
