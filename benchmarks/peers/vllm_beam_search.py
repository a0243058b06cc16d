"""vLLM's (CPU build) offline beam search, run INSIDE .peers/vllm by benchmarks/beam_search.py.

    .peers/vllm/bin/python benchmarks/peers/vllm_beam_search.py --model CKPT --prompts P.json --width 4 --output-len 32

P.json: a JSON list of token-id prompts. Prints one JSON line on stdout, last: {"engine": "vllm",
"greedy_s", "beam_s", "beams": [[best beam's generated ids], ...]}. `greedy_s`: the same prompts
decoded greedily in one batch, the same `--output-len` (the beam search's natural yardstick).
"""
from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--width", type=int, required=True)
    ap.add_argument("--output-len", type=int, required=True)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    with open(args.prompts) as f:
        reqs: list[list[int]] = json.load(f)

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    max_len = max(map(len, reqs)) + args.output_len + 16
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=max_len, max_num_seqs=64, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=r) for r in reqs]
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    beam = BeamSearchParams(beam_width=args.width, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    llm.beam_search(prompts[:1], BeamSearchParams(beam_width=args.width, max_tokens=2, ignore_eos=True))
    t = time.perf_counter()
    llm.generate(prompts, greedy, use_tqdm=False)
    greedy_s = time.perf_counter() - t
    t = time.perf_counter()
    outs = llm.beam_search(prompts, beam)
    beam_s = time.perf_counter() - t
    best = [o.sequences[0].tokens[len(r):] for o, r in zip(outs, reqs)]
    print(json.dumps({"engine": "vllm", "version": vllm.__version__, "greedy_s": greedy_s, "beam_s": beam_s, "beams": best}))


if __name__ == "__main__":
    main()
