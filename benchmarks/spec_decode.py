"""What speculative decoding by prompt lookup (`speculative_config`, engine/spec_decode.py) buys at
batch 1 (or `--batch N` prompts at once), and what it costs where nothing matches: the engine with
and without drafts, side by side in one process, rounds interleaved (this VM's memory rate
drifts), medians reported.

Workloads (`ignore_eos`):
  * `code`: the embedded model (a small model trained on code) continuing code prompts that end
    where a part of the prompt recurs (a second definition, a loop over the same names): how
    often a trained coder's continuation is found in its context;
  * `loop`: a preset's random checkpoint, greedy, on a periodic prompt (greedy random models fall
    into loops of their own): the upper end;
  * `rejected`: the same checkpoint sampling at temperature 1 (seeded), every step given k drafts
    (copies of its last token, in place of the proposer's) that are almost never kept (the kept
    column says): the cost of computing k rows that are thrown away, the worst case;
  * `nomatch`: random prompt tokens sampled at temperature 1: hardly anything to propose, the
    proposer's own overhead.
Draft models (engine/draft_model.py, `{"model": ...}`), on the preset's random checkpoint, greedy,
random prompts. Their speed-up depends on how often a trained draft agrees with its trained
target, which random checkpoints cannot show (and no weights can be downloaded here); these two
bound the machinery instead:
  * `draft-self`: the checkpoint as its own draft: (nearly) every draft kept, each draft costing a
    full forward of the model, so tokens/s measures what the drafting rounds cost beside the
    k + 1 tokens a step they buy;
  * `draft-sampled`: the embedded model as its own draft on the code prompts, sampling at
    temperature 1 (seeded): the draft samples with the uniforms the target will draw, so the
    same distribution keeps (nearly) every draft; the kept column is the figure (greedy drafts
    were kept only where the sample was the argmax);
  * `draft-tiny`: a 2-layer random draft of the preset's vocabulary (hidden 128), nearly free.
    How often it is kept is an artifact of random weights (random tied-embedding models greedily
    repeat tokens, so the draft and the target often agree; docs/benchmarks.md), so the row shows
    what the machinery gives at that acceptance, not what a draft model is worth.
Per row: output tok/s without and with drafts, their ratio, drafts proposed / kept per output
token, tokens per step. The copy bandwidth is measured in the same run (the batch-1 bound).

    python benchmarks/spec_decode.py [--model-preset qwen3-0.6b] [--k 4] [--rounds 5] [--batch 1]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (PRESETS, DEFAULT_CACHE_DIR, copy_bandwidth_gbs, machine_info, make_random_checkpoint,  # noqa: E402
                    markdown_table, preset_checkpoint)

CODE = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __repr__(self):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    for path in argv:\n        if os.path.isdir(path):\n",
    "for key, value in sorted(items.items()):\n    print(key, value)\n\nfor key, value in sorted(other.items()):\n",
]


def run_once(llm, prompts: list, out_len: int, temperature: float = 0.0, batch: int = 1) -> tuple[float, int, int, int, int]:
    """(seconds, output tokens, steps, drafts, kept) of generating `prompts`, `batch` at a time."""
    from cuttle.engine import SamplingParams

    engine = llm.engine
    before = dict(engine.counters)
    sp = SamplingParams(temperature=temperature, seed=1, max_tokens=out_len, ignore_eos=True)
    t = time.perf_counter()
    n = 0
    for i in range(0, len(prompts), batch):
        n += sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts[i:i + batch], sp, use_tqdm=False))
    dt = time.perf_counter() - t
    c = engine.counters
    return (dt, n, c["steps"] - before["steps"], c["spec_draft_tokens"] - before["spec_draft_tokens"],
            c["spec_accepted_tokens"] - before["spec_accepted_tokens"])


def compare(path: str, prompts: list, temperature: float, spec: dict, dtype: str, out_len: int, rounds: int, batch: int = 1,
            **kw) -> dict:
    from cuttle.engine import LLM

    reject = spec.pop("reject", False)
    engines = {"off": LLM(path, dtype=dtype, num_kv_blocks=512, **kw),
               "on": LLM(path, dtype=dtype, num_kv_blocks=512, speculative_config=spec, **kw)}
    if reject:
        proposer = engines["on"].engine.scheduler.spec
        # k copies of the last token: a random model sampled at temperature 1 over its whole
        # vocabulary hardly ever repeats a token at once, so the draft rows are computed for nothing
        proposer.propose = lambda seq, limit: [seq.token_ids[-1]] * proposer.room(seq, limit)
    for llm in engines.values():
        run_once(llm, prompts[:1], 8)  # warm-up: kernel graphs of the sizes that come first
    rates: dict[str, list[float]] = {"off": [], "on": []}
    last: dict[str, tuple] = {}
    for _ in range(rounds):
        for name, llm in engines.items():
            last[name] = r = run_once(llm, prompts, out_len, temperature, batch)
            rates[name].append(r[1] / r[0])
    engines.clear()
    gc.collect()  # the next workload's pair in the memory these held
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    _, n, steps, drafts, kept = last["on"]
    return {"off_tok_s": off, "on_tok_s": on, "ratio": on / off, "rounds": rates, "drafts_per_token": drafts / n,
            "kept_per_token": kept / n, "acceptance": kept / drafts if drafts else 0.0, "tokens_per_step": n / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-preset", default="qwen3-0.6b", choices=sorted(PRESETS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workloads", default="code,loop,rejected,nomatch,draft-self,draft-sampled,draft-tiny")
    ap.add_argument("--batch", type=int, default=1, help="prompts run at once (each workload gets this many prompts)")
    ap.add_argument("--disable-by-batch-size", default="default",
                    help="speculative_config.disable_by_batch_size: an integer, 'none' (drafts at every batch size) "
                         "or 'default' (the engine's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from cuttle.engine.default_model import DEFAULT_MODEL_DIR

    out: dict = {"machine": machine_info(), "args": vars(args), "copy_gbs": copy_bandwidth_gbs(), "rows": {}}
    rng = random.Random(0)
    path = preset_checkpoint(args.model_preset)
    n = max(2, args.batch)
    periodic = [list(range(100 + 7 * i, 164 + 7 * i)) * 3 for i in range(n)]
    noise = [[rng.randrange(1000, 30000) for _ in range(192)] for _ in range(n)]
    code = [CODE[i % len(CODE)] + " " * (i // len(CODE)) for i in range(max(len(CODE), args.batch))]
    ids = {"skip_tokenizer_init": True}
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    if args.disable_by_batch_size != "default":
        spec["disable_by_batch_size"] = None if args.disable_by_batch_size == "none" else int(args.disable_by_batch_size)
    preset_config = PRESETS[args.model_preset][0]
    tiny = {**preset_config, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}
    work = {  # model, its label, prompts, temperature, speculative_config, engine options
        "code": (DEFAULT_MODEL_DIR, "embedded model", code, 0.0, spec, {}),
        "loop": (path, args.model_preset, periodic, 0.0, spec, ids),
        "rejected": (path, args.model_preset, noise, 1.0, {**spec, "reject": True}, ids),
        "nomatch": (path, args.model_preset, noise, 1.0, spec, ids),
        "draft-self": (path, args.model_preset, noise, 0.0, {**spec, "method": "draft_model", "model": path}, ids),
        "draft-sampled": (DEFAULT_MODEL_DIR, "embedded model", code, 1.0, {**spec, "method": "draft_model", "model": DEFAULT_MODEL_DIR},
                          {}),
        "draft-tiny": (path, args.model_preset, noise, 0.0, {**spec, "method": "draft_model", "model": "tiny"}, ids),
    }
    rows = []
    for name in args.workloads.split(","):
        model, label, prompts, temperature, spec_config, kw = work[name]
        if spec_config.get("model") == "tiny":
            spec_config = {**spec_config, "model": make_random_checkpoint(
                os.path.join(DEFAULT_CACHE_DIR, f"{args.model_preset}-tiny-draft"), tiny)}
        if spec_config.get("method") == "draft_model":
            spec_config = {k: v for k, v in spec_config.items() if not k.startswith("prompt_lookup")}
        r = out["rows"][name] = compare(model, prompts, temperature, spec_config, args.dtype, args.output_len, args.rounds,
                                        args.batch, **kw)
        rows.append([name, label, f"{r['off_tok_s']:.1f}", f"{r['on_tok_s']:.1f}", f"{r['ratio']:.2f}x",
                     f"{r['drafts_per_token']:.2f} / {r['kept_per_token']:.2f}", f"{r['acceptance']:.2f}", f"{r['tokens_per_step']:.2f}"])
        print(rows[-1], flush=True)
    print(f"copy bandwidth {out['copy_gbs']:.1f} GB/s, k = {args.k}, {args.dtype}, batch {args.batch}, "
          f"medians of {args.rounds} interleaved rounds")
    print(markdown_table(["workload", "model", "tok/s off", "tok/s on", "on / off", "drafts / kept per token", "kept / drafts",
                          "tokens / step"], rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
