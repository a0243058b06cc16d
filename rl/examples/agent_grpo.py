"""GRPO of the embedded tiny coding model on multi-turn tool tasks in the sandbox.

    python -m cuttle.rl.examples.agent_grpo                      # writes /tmp/cuttle-agent-grpo/
    python -m cuttle.rl.examples.agent_grpo --steps 4 --warm-start-steps 0 --out /tmp/run

The embedded model was trained on stdlib source, never on chats: left alone it does not write a
tool call (`<tool_call>` never comes out of it), so every episode ends at its first answer with
reward 0 and GRPO has no signal. The route taken here, stated in every output:
1. **Warm start** (`--warm-start-steps`, supervised): cross-entropy on the first turn of the fix
   script for synthetic tasks, a `read_file` call of the buggy file written exactly as the
   product's template writes a call of the product's own `read_file` schema, after the product's
   own system prompt with every tool schema. It teaches the format, not the task.
2. **GRPO** with `AgentRollout.step` (multi-turn episodes, the sandbox's tools, partial rollouts
   with `--partial`), reward = the hidden tests on a fresh copy of the final workspace (1.0) plus
   a shaped `--format-bonus` (default 0.2) when the episode's first turn is one well-formed call of
   an existing tool (no malformed block). The bonus is what the tiny model can reach; the hidden
   tests are what a real model would be trained on.
Each step: sample, reward, one trainer step (per-token versions, mismatch against the behaviour
logprobs), push the weights into the same engine. Outputs in `--out`: `log.jsonl` (per step:
reward, format rate, turns, tool calls by kind, tokens, finishes, straggler wait, mismatch),
`reward.png` and `summary.json` (first / last mean reward and the step-to-step noise).
Owns the example only; every piece it uses is `cuttle.rl`'s public API (plus the trainer's row
scoring for the warm start's cross-entropy).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.rl.agent import AgentConfig, AgentGroup, AgentRollout, agent_batch, episode_stats
from cuttle.rl.batch import TrainBatch
from cuttle.rl.chat import ChatTokens
from cuttle.rl.environment import sandbox_factory
from cuttle.rl.examples.grpo_tiny import noise, plot
from cuttle.rl.losses import loss_config
from cuttle.rl.trainer import Trainer, TrainerConfig
from cuttle.rl.types import Trajectory
from cuttle.sandbox.tasks import make_task
from cuttle.sandbox.tools import agent_tool_schemas

SPEC_SEEDS = range(0, 48)  # synthetic tasks for GRPO; the warm start uses others (SFT_SEEDS)
SFT_SEEDS = range(1000, 1016)


def first_call(seed: int) -> str:
    """The fix script's first turn: read the file that holds the bug, as the template writes a call."""
    task = make_task({"kind": "synthetic", "seed": seed})
    path = next(p for p, text in task.files.items() if task.metadata["mutant"] in text)
    return f'<tool_call>\n{{"name": "read_file", "arguments": {json.dumps({"path": path})}}}\n</tool_call>'


def warm_start(trainer: Trainer, llm: LLM, runner: AgentRollout, steps: int, batch_size: int, rng: random.Random) -> list[float]:
    """Supervised steps on (product prompt, one well-formed read_file call): returns the losses."""
    tok = llm.get_tokenizer()
    chat = ChatTokens(tok, agent_tool_schemas(), llm.engine.eos_token_ids)
    examples = []
    for seed in SFT_SEEDS:
        task = make_task({"kind": "synthetic", "seed": seed})
        _, ids = chat.start([{"role": "system", "content": runner.config.system_prompt}, {"role": "user", "content": task.prompt}])
        t = Trajectory.start(ids)
        turn = tok.encode(first_call(seed), add_special_tokens=False) + [chat.end_of_turn_id]
        t.token_ids += turn
        t.loss_mask += [1] * len(turn)
        t.logprobs += [0.0] * len(turn)
        t.weight_versions += [0] * len(turn)
        examples.append(t)
    losses = []
    trainer.model.train()
    for _ in range(steps):
        chosen = rng.sample(examples, batch_size)
        packed = TrainBatch.from_trajectories(chosen, [0.0] * len(chosen), list(range(len(chosen)))).packed()
        trainer.optimizer.zero_grad(set_to_none=True)
        total, n = 0.0, packed.num_trained_tokens
        for a, b in trainer._rows(packed):
            lp, _, _ = trainer._row_logprobs(packed, a, b)
            loss = -lp.sum() / n
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(trainer.params, 1.0)
        trainer.optimizer.step()
        losses.append(total)
    trainer.optimizer.state.clear()  # the RL phase starts its own moments
    return losses


def well_formed_first_turn(e) -> bool:  # noqa: ANN001 - an Episode
    return bool(e.turns) and len(e.turns[0].calls) >= 1 and not e.turns[0].malformed and \
        all(c.name in {s["function"]["name"] for s in agent_tool_schemas()} for c in e.turns[0].calls)


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description="GRPO of the embedded model on multi-turn sandbox tool tasks")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--groups", type=int, default=2, help="groups each step returns")
    ap.add_argument("--extra", type=int, default=0, help="groups started beyond --groups (stragglers carried with --partial)")
    ap.add_argument("--partial", action="store_true", help="carry unfinished groups into the next step")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--max-tokens-per-turn", type=int, default=48)
    ap.add_argument("--warm-start-steps", type=int, default=40)
    ap.add_argument("--warm-start-lr", type=float, default=1e-3)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--format-bonus", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "cuttle-agent-grpo"))
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()

    llm = LLM(dtype="float32", max_model_len=4096, num_kv_blocks=1024)
    trainer = Trainer(llm.engine.config.model, TrainerConfig(loss=loss_config("grpo"), lr=args.warm_start_lr,
                                                               max_tokens_per_row=4096))
    cfg = AgentConfig(max_turns=args.max_turns, max_tokens_per_turn=args.max_tokens_per_turn, max_total_tokens=4000,
                      turn_wait_s=0.2)
    runner = AgentRollout(llm, sandbox_factory(), cfg)
    sft_losses = warm_start(trainer, llm, runner, args.warm_start_steps, 4, rng) if args.warm_start_steps else []
    for group in trainer.optimizer.param_groups:
        group["lr"] = args.lr
    if sft_losses:
        trainer.push_weights(llm)
    print(f"warm start: {len(sft_losses)} steps, loss {sft_losses[:1]} -> {sft_losses[-1:]}", flush=True)

    rewards: list[float] = []
    log_path = os.path.join(args.out, "log.jsonl")
    try:
        with open(log_path, "w") as log:
            for step in range(1, args.steps + 1):
                specs = [{"kind": "synthetic", "seed": rng.choice(SPEC_SEEDS)}
                         for _ in range(args.groups + args.extra - len(runner.carried))]
                params = SamplingParams(temperature=1.0, seed=args.seed * 100_003 + step)
                res = runner.step(specs, args.group_size, params, groups_needed=args.groups, partial=args.partial)
                groups: list[AgentGroup] = res.groups
                eps = [e for g in groups for e in g.episodes]
                fmt = [well_formed_first_turn(e) for e in eps]
                for e, ok in zip(eps, fmt):
                    e.reward_info["hidden_tests_reward"] = e.reward
                    if not e.failed and ok:
                        e.reward += args.format_bonus
                stats = episode_stats(groups)
                rewards.append(stats["reward_mean"])
                record: dict[str, object] = {
                    "step": step, **stats, "format_rate": sum(fmt) / max(1, len(fmt)),
                    "hidden_tests_reward_mean": statistics.fmean(e.reward_info.get("hidden_tests_reward", 0.0) for e in eps),
                    "rollout_seconds": res.seconds, "aborted": len(res.aborted), "carried": res.carried,
                    # time the step spent after its fastest group was complete: what the slowest groups cost it
                    "straggler_wait_seconds": res.seconds - min((max(e.seconds for e in g.episodes) for g in groups), default=0.0),
                }
                batch, counts = agent_batch(groups + res.aborted, scale_by_std=True)
                record.update({f"batch_{k}": v for k, v in counts.items()})
                if batch is not None and batch.advantages.abs().sum() > 0:
                    record.update(trainer.step(batch, current_version=llm.engine.weight_version))
                    trainer.push_weights(llm)
                record["weight_version"] = llm.engine.weight_version
                record["example"] = eps[0].turns[0].text[:200] if eps and eps[0].turns else ""
                record["elapsed_seconds"] = time.perf_counter() - t_start
                log.write(json.dumps(record) + "\n")
                log.flush()
                print(f"step {step:3d}  reward {rewards[-1]:.3f}  format {record['format_rate']:.2f}  "
                      f"turns {stats['turns_mean']:.2f}  loss {record.get('loss', float('nan')):+.4f}  "
                      f"mismatch {record.get('mismatch_max_abs', float('nan')):.1e}  t {record['elapsed_seconds']:.0f}s", flush=True)
    finally:
        runner.close()
    k = max(1, min(3, len(rewards) // 2))
    first, last = statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])
    summary = {"first_mean": first, "last_mean": last, "window": k, "improvement": last - first,
               "step_noise": noise(rewards), "steps": len(rewards), "seconds": time.perf_counter() - t_start,
               "warm_start_steps": len(sft_losses), "warm_start_loss_first": sft_losses[0] if sft_losses else None,
               "warm_start_loss_last": sft_losses[-1] if sft_losses else None, "format_bonus": args.format_bonus,
               "groups": args.groups, "group_size": args.group_size, "lr": args.lr, "partial": args.partial}
    summary["improved_beyond_noise"] = summary["improvement"] > summary["step_noise"] > 0
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot(rewards, os.path.join(args.out, "reward.png"),
         f"agent GRPO, embedded model, warm start {len(sft_losses)} steps, reward = hidden tests + {args.format_bonus} "
         f"format bonus: first {first:.3f} -> last {last:.3f} (noise {summary['step_noise']:.3f})")
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
