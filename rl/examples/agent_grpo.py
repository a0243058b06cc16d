"""GRPO of the embedded tiny coding model on multi-turn tool tasks in the sandbox.

    python -m cuttle.rl.examples.agent_grpo                      # writes /tmp/cuttle-agent-grpo/
    python -m cuttle.rl.examples.agent_grpo --steps 4 --warm-start-steps 0 --out /tmp/run

The embedded model was trained on stdlib source, never on chats: left alone it does not write a
tool call (`<tool_call>` never comes out of it), so every episode ends at its first answer with
reward 0 and GRPO has no signal. The route taken here, stated in every output:
1. **Tasks it can solve**: the *guided* task set (rl/examples/agent_tasks.py), synthetic
   repository tasks whose prompt names the file and the exact line to change; the fix is one
   `edit_file` call copying the prompt's strings, then `submit`. Reward = the hidden tests on a
   fresh copy of the final workspace (1.0 or 0.0), as for any sandbox task.
2. **Warm start** (`--warm-start-steps`, supervised): cross-entropy on the sampled turns of
   scripted fix trajectories of other guided tasks (`SFT_SEEDS`, disjoint from the GRPO tasks),
   made by the agent loop itself (product system prompt and tool schemas, the real sandbox's tool
   results between the turns): it teaches the call format and the copy, not these tasks.
3. **GRPO** with `AgentRollout.step` (multi-turn episodes, partial rollouts with `--partial`); an
   optional shaped `--format-bonus` (default 0) when the first turn is one well-formed call of an
   existing tool.
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
from cuttle.rl.examples.agent_tasks import ScriptedFix, guided_env, guided_seeds
from cuttle.rl.examples.grpo_tiny import noise, plot
from cuttle.rl.losses import loss_config
from cuttle.rl.trainer import Trainer
from cuttle.rl.trainer import TrainerConfig
from cuttle.rl.types import Trajectory
from cuttle.sandbox.tools import agent_tool_schemas

SPEC_SEEDS = guided_seeds(0, 48)  # guided tasks for GRPO; the warm start uses others (SFT_SEEDS)
SFT_SEEDS = guided_seeds(1000, 16)


def scripted_trajectories(llm: LLM, seeds: list[int]) -> list[Trajectory]:
    """The scripted fix of every SFT task, run through the agent loop in the sandbox: the exact
    token streams (prompt, the fix's turns, the template and tool results between them) a policy
    that solves them would produce. Each must earn reward 1, or the task set is broken."""
    tok = llm.get_tokenizer()
    cfg = AgentConfig(max_turns=4, max_tokens_per_turn=512)  # the script's turns whole, whatever the run's limits
    runner = AgentRollout(ScriptedFix(tok, seeds), guided_env, cfg, tokenizer=tok,
                          eos_token_ids=llm.engine.eos_token_ids)
    try:
        groups = runner.run([{"kind": "guided", "seed": s} for s in seeds], 1, SamplingParams(temperature=1.0))
    finally:
        runner.close()
    eps = [g.episodes[0] for g in groups]
    bad = [(e.spec, e.finish, e.reward, e.error) for e in eps if e.finish != "submitted" or e.reward != 1.0]
    if bad:
        raise RuntimeError(f"the scripted fix does not solve every warm-start task: {bad[:3]}")
    return [e.trajectory for e in eps]


def warm_start(trainer: Trainer, examples: list[Trajectory], steps: int, batch_size: int, rng: random.Random) -> list[float]:
    """Supervised steps on the scripted trajectories' sampled turns: returns the losses."""
    losses = []
    trainer.model.train()
    for _ in range(steps):
        chosen = rng.sample(examples, min(batch_size, len(examples)))
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
    ap.add_argument("--max-tokens-per-turn", type=int, default=128)
    ap.add_argument("--warm-start-steps", type=int, default=12)
    ap.add_argument("--warm-start-lr", type=float, default=1e-3)
    ap.add_argument("--warm-start-tasks", type=int, default=len(SFT_SEEDS), help=f"scripted trajectories (<= {len(SFT_SEEDS)})")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--format-bonus", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "cuttle-agent-grpo"))
    args = ap.parse_args(argv)
    if not 1 <= args.warm_start_tasks <= len(SFT_SEEDS):
        ap.error(f"--warm-start-tasks must be in 1..{len(SFT_SEEDS)}, got {args.warm_start_tasks}")
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()

    llm = LLM(dtype="float32", max_model_len=4096, num_kv_blocks=1024)
    trainer = Trainer(llm.engine.config.model, TrainerConfig(loss=loss_config("grpo"), lr=args.warm_start_lr,
                                                               max_tokens_per_row=4096))
    cfg = AgentConfig(max_turns=args.max_turns, max_tokens_per_turn=args.max_tokens_per_turn, max_total_tokens=4000,
                      turn_wait_s=0.2)
    runner = AgentRollout(llm, guided_env, cfg)
    examples = scripted_trajectories(llm, SFT_SEEDS[:args.warm_start_tasks]) if args.warm_start_steps else []
    sft_losses = warm_start(trainer, examples, args.warm_start_steps, 4, rng) if args.warm_start_steps else []
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
                specs = [{"kind": "guided", "seed": rng.choice(SPEC_SEEDS)}
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
         f"agent GRPO, embedded model, guided tasks, warm start {len(sft_losses)} steps, reward = hidden tests"
         f"{f' + {args.format_bonus} format bonus' if args.format_bonus else ''}: first {first:.3f} -> last {last:.3f} "
         f"(noise {summary['step_noise']:.3f})")
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
