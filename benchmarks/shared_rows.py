"""The reference trainer with and without shared prompt rows (rl/shared_rows.py, docs/rl.md
"Shared prompt rows"): one GRPO step (forward + backward + AdamW) and one scoring pass over G
samples of a prompt, on the embedded default model in float32.

    python benchmarks/shared_rows.py [--groups 2] [--samples 8] [--prompt 512] [--completion 64]
"""
from __future__ import annotations

import argparse
import random
import time

from cuttle.engine.default_model import DEFAULT_MODEL_DIR
from cuttle.rl import TrainBatch, Trajectory
from cuttle.rl.trainer import Trainer, TrainerConfig
from cuttle.rl.types import Sample


def batch(groups: int, samples: int, prompt: int, completion: int, vocab: int) -> TrainBatch:
    rng = random.Random(0)
    trajs, adv, gids = [], [], []
    for g in range(groups):
        ids = [rng.randrange(3, vocab) for _ in range(prompt)]
        for s in range(samples):
            t = Trajectory.start(ids)
            t.append_sample(Sample([rng.randrange(3, vocab) for _ in range(completion)], [-5.0] * completion, "length", 0))
            trajs.append(t)
            adv.append(1.0 if s % 2 else -1.0)
            gids.append(g)
    return TrainBatch.from_trajectories(trajs, adv, gids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    per_seq = args.prompt + args.completion
    for share in (False, True):
        # one row per group either way: the packed row holds G copies of the prompt, the shared one
        trainer = Trainer(DEFAULT_MODEL_DIR, TrainerConfig(share_prefixes=share, max_tokens_per_row=args.samples * per_seq))
        b = batch(args.groups, args.samples, args.prompt, args.completion, trainer.model.cfg.vocab_size)
        trainer.score(b)  # warm
        score_s, step_s = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            trainer.score(b)
            score_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            trainer.step(b)
            step_s.append(time.perf_counter() - t)
        print(f"share_prefixes={share!s:5s}: score {min(score_s):.3f} s, step {min(step_s):.3f} s "
              f"(best of {args.repeats}; {args.groups} groups x {args.samples} samples, prompt {args.prompt}, "
              f"completion {args.completion})", flush=True)


if __name__ == "__main__":
    main()
