"""GRPO on the embedded tiny coding model: learn to write function bodies that parse and return.

    python -m cuttle.rl.examples.grpo_tiny                       # 40 steps, writes /tmp/cuttle-grpo-tiny/
    python -m cuttle.rl.examples.grpo_tiny --steps 10 --loss dapo --out /tmp/run

Each step samples `--prompts` function headers (name, arguments, docstring) in groups of
`--group-size` from the running engine, scores every completion with `python_function_reward`
(0.5 if the body parses and does something, +0.5 if it returns a value: verifiable, no sandbox),
takes one AdamW step of the reference trainer on the chosen loss and pushes the new weights into
the same engine (weight_version + 1). Writes `log.jsonl` (one line per step: rewards, loss, grad
norm, mismatch, timings, one sample), `reward.png` (the reward curve) and `summary.json` (mean
reward of the first and last 5 steps and the step-to-step noise).
Owns the example only; every piece it uses is `cuttle.rl`'s public API.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import tempfile
import time

import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.rl import TrainBatch, assign_rewards, compute_advantages, drop_zero_variance, loss_config, python_function_reward, sample_groups
from cuttle.rl.trainer import Trainer, TrainerConfig

# (name, arguments, docstring): small, stdlib-flavoured functions whose bodies fit in a few lines
FUNCTIONS = [
    ("add", "a, b", "Return the sum of a and b."),
    ("is_even", "n", "Return True if n is even."),
    ("first", "items", "Return the first element of items."),
    ("clamp", "x, lo, hi", "Clamp x to the range [lo, hi]."),
    ("count", "items, value", "Return how many times value occurs in items."),
    ("join_words", "words", "Join words with single spaces."),
    ("square", "x", "Return x squared."),
    ("maximum", "a, b", "Return the larger of a and b."),
    ("last", "items", "Return the last element of items."),
    ("is_empty", "s", "Return True if the string s is empty."),
    ("double", "x", "Return twice x."),
    ("to_upper", "s", "Return s in upper case."),
    ("area", "width, height", "Return the area of a rectangle."),
    ("average", "values", "Return the arithmetic mean of values."),
    ("has_key", "mapping, key", "Return True if key is in mapping."),
    ("reverse", "s", "Return the string s reversed."),
    ("is_positive", "n", "Return True if n is greater than zero."),
    ("head", "lines, n", "Return the first n lines."),
    ("contains", "items, x", "Return True if x is one of items."),
    ("abs_diff", "a, b", "Return the absolute difference of a and b."),
    ("get_name", "obj", "Return the name attribute of obj."),
    ("strip_all", "lines", "Return the lines with surrounding whitespace removed."),
    ("total", "numbers", "Return the sum of numbers."),
    ("parse_int", "text", "Convert text to an integer."),
]


def prompt_text(name: str, args: str, doc: str) -> str:
    # Ends with three spaces: the model's BPE writes a body line as "\n   " + " return", so the
    # prompt stops exactly at a token boundary it has seen in training.
    return f'def {name}({args}):\n    """{doc}"""\n   '


def noise(series: list[float]) -> float:
    """Step-to-step noise of a per-step mean: std of consecutive differences / sqrt(2), which a
    steady trend barely affects (a plain std would count the improvement itself as noise)."""
    diffs = [b - a for a, b in zip(series, series[1:])]
    return statistics.pstdev(diffs) / math.sqrt(2) if len(diffs) > 1 else 0.0


def plot(rewards: list[float], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(rewards) + 1))
    window = [statistics.fmean(rewards[max(0, i - 4) : i + 1]) for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, marker="o", ms=3, lw=1, label="mean reward per step")
    ax.plot(steps, window, lw=2, label="5-step moving mean")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward (0 .. 1)")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description="GRPO on the embedded tiny coding model (verifiable function-body reward)")
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded model)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=8, help="groups (prompts) per step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--loss", default="grpo", choices=["grpo", "dr_grpo", "dapo", "gspo"])
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--engine-dtype", default="float32", help="the sampler's dtype (the trainer is float32)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "cuttle-grpo-tiny"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)

    llm = LLM(args.model, dtype=args.engine_dtype, max_model_len=256, max_num_seqs=args.prompts * args.group_size)
    model_path = llm.engine.config.model
    tok = llm.get_tokenizer()
    cfg = loss_config(args.loss)
    trainer = Trainer(model_path, TrainerConfig(loss=cfg, lr=args.lr, temperature=args.temperature, max_tokens_per_row=512))
    rng = random.Random(args.seed)
    log_path = os.path.join(args.out, "log.jsonl")
    rewards: list[float] = []
    t_start = time.perf_counter()
    with open(log_path, "w") as log:
        for step in range(1, args.steps + 1):
            chosen = rng.sample(FUNCTIONS, args.prompts)
            texts = [prompt_text(*f) for f in chosen]
            sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed * 100_003 + step,
                                stop=["\ndef ", "\nclass ", "\n@"])
            t0 = time.perf_counter()
            groups = sample_groups(llm, [tok.encode(t) for t in texts], args.group_size, sp, metadata=[{"prefix": t} for t in texts])
            t_sample = time.perf_counter() - t0
            assign_rewards(groups, python_function_reward)
            all_r = [r for g in groups for r in g.rewards]
            rewards.append(statistics.fmean(all_r))
            kept = drop_zero_variance(groups) if cfg.drop_zero_variance else groups
            record: dict[str, object] = {
                "step": step, "reward_mean": rewards[-1], "reward_std": statistics.pstdev(all_r),
                "frac_reward_1": sum(r == 1.0 for r in all_r) / len(all_r),
                "completion_tokens_mean": statistics.fmean(len(s.token_ids) for g in groups for s in g.samples),
                "groups_with_signal": sum(max(g.rewards) > min(g.rewards) for g in groups),
                "weight_version": groups[0].samples[0].weight_version, "sample_seconds": t_sample,
            }
            if kept:
                batch = TrainBatch.from_groups(kept, compute_advantages(kept, cfg.scale_adv_by_std))
                record.update(trainer.step(batch))
                t1 = time.perf_counter()
                trainer.push_weights(llm)
                record["sync_seconds"] = time.perf_counter() - t1
            best = max((s for g in groups for s in g.samples), key=lambda s: s.reward)
            record["example"] = texts[0] + groups[0].samples[0].text
            record["best_example_reward"] = best.reward
            record["elapsed_seconds"] = time.perf_counter() - t_start
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(f"step {step:3d}  reward {rewards[-1]:.3f}  loss {record.get('loss', float('nan')):+.4f}  "
                  f"mismatch max {record.get('mismatch_max_abs', float('nan')):.2e}  "
                  f"t {record['elapsed_seconds']:.0f}s", flush=True)

    k = min(5, len(rewards))
    first, last = statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])
    summary = {"first5_mean": first, "last5_mean": last, "improvement": last - first, "step_noise": noise(rewards),
               "steps": len(rewards), "seconds": time.perf_counter() - t_start, "loss": args.loss, "lr": args.lr,
               "prompts": args.prompts, "group_size": args.group_size}
    summary["improved_beyond_noise"] = summary["improvement"] > summary["step_noise"]
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot(rewards, os.path.join(args.out, "reward.png"),
         f"GRPO ({args.loss}) on the embedded model: first-5 {first:.3f} -> last-5 {last:.3f} (noise {summary['step_noise']:.3f})")
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
