"""What `batch_invariant=True` costs, and that it holds: engines without and with the switch, side by
side in one process on a preset's random checkpoint.

Per variant (bf16 weights; MXFP8 linears + experts + lm_head; fp32) and per setting: offline
output tok/s (N requests), batch-1 decode tok/s, the prefill time of one long prompt (alone: one
chunk, which the default engine attends with SDPA above 256 tokens and the invariant one with the
native rows), the time of a resumed turn (64 new tokens after that prompt, a prefix-cache hit: a
short chunk over a long cached context, which the default engine also sends to SDPA), each the
median of interleaved rounds (a fresh long prompt each round); and whether a probe request's
greedy tokens and top-2 logprobs are bit-identical alone and beside the other requests. The
machine's copy bandwidth is measured in the same run; the default engine of the same run is the
baseline of every ratio.

    python benchmarks/batch_invariance.py --model-preset qwen3-moe-small
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import PRESETS, copy_bandwidth_gbs, machine_info, markdown_table, preset_checkpoint  # noqa: E402
from throughput import decode_b1, prompts  # noqa: E402

VARIANTS = {
    "bf16": dict(dtype="bfloat16"),
    "mxfp8": dict(dtype="bfloat16", quantization="mxfp8", quantize_lm_head=True),
    "fp32": dict(dtype="float32"),
}


def offline(llm, reqs: list[list[int]], out_len: int) -> float:
    from cuttle.engine import SamplingParams

    t = time.perf_counter()
    outs = llm.generate(reqs, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True), use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def prefill_s(llm, prompt: list[int]) -> float:
    from cuttle.engine import SamplingParams

    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - t


def resumed_turn_s(llm, history: list[int], turn: list[int]) -> float:
    """A turn after a cached history: its chunk attends the whole history."""
    from cuttle.engine import SamplingParams

    t = time.perf_counter()
    llm.generate([history + turn], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - t


def identical_beside_others(llm, probe: list[int], others: list[list[int]]) -> bool:
    from cuttle.engine import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=32, logprobs=2, ignore_eos=True)

    def result(batch: list[list[int]]):
        o = llm.generate(batch, sp, use_tqdm=False)[-1].outputs[0]
        return o.token_ids, [sorted((t, lp.logprob) for t, lp in row.items()) for row in o.logprobs]

    return result([probe]) == result(others + [probe])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-preset", default="qwen3-moe-small", choices=sorted(PRESETS))
    ap.add_argument("--variants", default="bf16,mxfp8,fp32", help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--long-prompt", type=int, default=2048, help="tokens of the prefill-time prompt")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",")]
    if unknown := set(variants) - set(VARIANTS):
        ap.error(f"unknown variants {sorted(unknown)}")
    from cuttle.engine import LLM
    from cuttle.engine.config import ModelConfig

    path = preset_checkpoint(args.model_preset)
    vocab = ModelConfig.from_pretrained(path).vocab_size
    reqs = prompts(args.num_requests, args.prompt_len, vocab)
    long_prompts = prompts(args.rounds, args.long_prompt, vocab, seed=1)  # one per round: each is cached after
    turn = prompts(1, 64, vocab, seed=3)[0]
    probe = prompts(1, 300, vocab, seed=2)[0]  # past the default engine's 256-token native chunks
    info = machine_info()
    bw = copy_bandwidth_gbs()
    print(f"{info.get('cpu', '?')}, {info.get('threads', '?')} threads; copy {bw:.1f} GB/s", flush=True)
    rows = []
    for v in variants:
        engines = {}
        for inv in (False, True):
            engines[inv] = LLM(path, max_model_len=args.long_prompt + 96, max_num_seqs=args.num_requests,
                               max_num_batched_tokens=max(2048, args.long_prompt), batch_invariant=inv, **VARIANTS[v])
            offline(engines[inv], reqs[:2], 4)  # warm-up: packing, graph captures at batch 2 and 1
            offline(engines[inv], reqs[:1], 4)
        figures: dict[bool, dict[str, list[float]]] = {inv: {"offline": [], "b1": [], "prefill": [], "turn": []} for inv in engines}
        for r in range(args.rounds):
            for inv, llm in engines.items():
                figures[inv]["offline"].append(offline(llm, reqs, args.output_len))
                figures[inv]["b1"].append(decode_b1(llm, reqs[0], args.output_len))
                figures[inv]["prefill"].append(prefill_s(llm, long_prompts[r]))
                figures[inv]["turn"].append(resumed_turn_s(llm, long_prompts[r], turn))
        med = {inv: {k: statistics.median(x) for k, x in f.items()} for inv, f in figures.items()}
        engines.clear()
        gc.collect()
        for inv in (False, True):
            m = med[inv]
            # its own engine, without the prefix cache: the probe's second run must be computed again
            llm = LLM(path, enable_prefix_caching=False, batch_invariant=inv, **VARIANTS[v])
            off = med[False]
            rows.append([v, "on" if inv else "off", f"{m['offline']:.1f}", f"{m['b1']:.1f}", f"{m['prefill']:.2f}",
                         f"{m['turn'] * 1e3:.0f}", "yes" if identical_beside_others(llm, probe, reqs[:7]) else "no",
                         "" if not inv else f"{m['offline'] / off['offline']:.2f}x / {m['b1'] / off['b1']:.2f}x / "
                                            f"{off['prefill'] / m['prefill']:.2f}x / {off['turn'] / m['turn']:.2f}x"])
            print(" | ".join(rows[-1]), flush=True)
            del llm
            gc.collect()
    print()
    print(f"{args.model_preset}, {args.num_requests} requests x ({args.prompt_len} prompt, {args.output_len} output), "
          f"long prompt {args.long_prompt}, medians of {args.rounds} interleaved rounds; copy {bw:.1f} GB/s")
    print(markdown_table(["variant", "batch_invariant", "offline out tok/s", "batch-1 tok/s", f"prefill {args.long_prompt} (s)",
                          "resumed 64-token turn (ms)", "identical beside others",
                          "on / off (offline / b1 / prefill / turn speed)"], rows))


if __name__ == "__main__":
    main()
