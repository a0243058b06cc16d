"""GRPO of the embedded tiny coding model on multi-turn tool tasks in the sandbox.

    python -m cuttle.rl.examples.agent_grpo                      # ~20 minutes, writes /tmp/cuttle-agent-grpo/
    python -m cuttle.rl.examples.agent_grpo --steps 4 --warm-start-steps 0 --out /tmp/run

The embedded model was trained on stdlib source and a few canned tool chats: it cannot copy a
string from its prompt into a call (measured after a warm start: ~10 nats per copied token), so on
open tasks every episode earns 0 and GRPO has no signal. The route taken here, stated in every
output:
1. **Tasks it can solve** (rl/examples/agent_tasks.py): the *narrow guided* set, synthetic
   repository tasks of one package whose bug is one of four one-operator edits in two files; the
   short prompt names the edit as the `edit_file` arguments, so the fix is that call, then
   `submit`. Reward = the hidden tests on a fresh copy of the final workspace (1.0 or 0.0), as for
   any sandbox task. A policy that ignores the prompt and writes one of the four fixes earns ~1/4;
   one that reads which operator the prompt names earns 1.
2. **Only the tools the tasks need** (`--tools`, default edit_file,submit: the product's schemas,
   two of them): a 434-token prompt instead of 1,368, inside the 512 tokens the model was trained on.
3. **Warm start** (`--warm-start-steps`, supervised): cross-entropy on the sampled turns of
   scripted fix trajectories of other narrow tasks (disjoint seeds), made by the agent loop itself
   (the same system prompt and tool schemas, the real sandbox's tool results between the turns).
4. **GRPO** with `AgentRollout.step` (multi-turn episodes, partial rollouts with `--partial`); an
   optional shaped `--format-bonus` (default 0) when the first turn is one well-formed call of an
   offered tool.
Each step: sample, reward, one trainer step (per-token versions, mismatch against the behaviour
logprobs), push the weights into the same engine. `--budget-minutes` bounds the whole run (model
load, task set, warm start and GRPO): no step starts that would end past it. Outputs in `--out`:
`log.jsonl` (per step: reward, right-edit and format rates, turns, tool calls by kind, tokens,
finishes, straggler wait, mismatch), `reward.png` and `summary.json` (first / last 3-step means
with their spread, the step-to-step noise, and a two-proportion z over their episodes).
Owns the example only; every piece it uses is `cuttle.rl`'s public API (plus the trainer's row
scoring for the warm start's cross-entropy).
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
from collections import Counter

import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.rl.agent import AgentConfig, AgentGroup, AgentRollout, Episode, agent_batch, episode_stats
from cuttle.rl.batch import TrainBatch
from cuttle.rl.examples.agent_tasks import ScriptedFix, guided_env, guided_fix, guided_seeds
from cuttle.rl.examples.grpo_tiny import noise
from cuttle.rl.losses import loss_config
from cuttle.rl.trainer import Trainer, TrainerConfig
from cuttle.rl.types import Trajectory

SFT_SEED_START = 100_000  # warm-start tasks come from here on, GRPO tasks from 0: never the same task


def scripted_trajectories(llm: LLM, seeds: list[int], tools: tuple[str, ...]) -> list[Trajectory]:
    """The scripted fix of every warm-start task, run through the agent loop in the sandbox with the
    run's tools: the exact token streams (prompt, the fix's turns, the template and tool results
    between them) a policy that solves them would produce. Each must earn reward 1."""
    tok = llm.get_tokenizer()
    cfg = AgentConfig(max_turns=4, max_tokens_per_turn=512, tools=tools)  # the script's turns whole
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


def well_formed_first_turn(e: Episode, tools: tuple[str, ...]) -> bool:
    return bool(e.turns) and len(e.turns[0].calls) >= 1 and not e.turns[0].malformed and \
        all(c.name in tools for c in e.turns[0].calls)


def first_edit(e: Episode) -> dict | str | None:
    """The arguments of the episode's first edit_file call: None when it made none, "?" when they
    are not a JSON object."""
    call = next((c for t in e.turns for c in t.calls if c.name == "edit_file"), None)
    if call is None:
        return None
    try:
        args = json.loads(call.arguments)
    except json.JSONDecodeError:
        return "?"
    return args if isinstance(args, dict) else "?"


def edit_outcome(e: Episode) -> str:
    """'right': the first edit_file call has the prompt's exact arguments; 'wrong': it has others
    (the wrong fix, path or string); 'none': no edit_file call."""
    args = first_edit(e)
    if args is None:
        return "none"
    _, path, old, new = guided_fix(int(e.spec["seed"]))
    return "right" if args == {"path": path, "old_str": old, "new_str": new} else "wrong"


def edit_choice(e: Episode) -> str:
    """The old_str of the first edit_file call: which fix the policy chose ("-" none, "?" unreadable)."""
    args = first_edit(e)
    return "-" if args is None else "?" if isinstance(args, str) else str(args.get("old_str", "?"))


def compare(rewards: list[float], per_step: list[list[float]], k: int) -> dict[str, float]:
    """First vs last `k` steps: means, their spread across steps, the step-to-step noise, and a
    two-proportion z over the episodes of those steps (rewards are 0/1)."""
    first, last = rewards[:k], rewards[-k:]
    a = [r for s in per_step[:k] for r in s]
    b = [r for s in per_step[-k:] for r in s]
    pa, pb = statistics.fmean(a), statistics.fmean(b)
    pooled = (sum(a) + sum(b)) / (len(a) + len(b))
    se = math.sqrt(pooled * (1 - pooled) * (1 / len(a) + 1 / len(b)))
    return {"window": k, "first_mean": statistics.fmean(first), "last_mean": statistics.fmean(last),
            "first_spread": statistics.pstdev(first), "last_spread": statistics.pstdev(last),
            "improvement": statistics.fmean(last) - statistics.fmean(first), "step_noise": noise(rewards),
            "first_episodes": len(a), "last_episodes": len(b),
            "z_last_vs_first": (pb - pa) / se if se > 0 else 0.0}


def linear_fit(rewards: list[float]) -> dict[str, float]:
    """Least-squares line through (step, reward): slope per step, its standard error and t."""
    n = len(rewards)
    xs = range(1, n + 1)
    mx, my = statistics.fmean(xs), statistics.fmean(rewards)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, rewards)) / sxx
    resid = [y - (my + slope * (x - mx)) for x, y in zip(xs, rewards)]
    se = math.sqrt(sum(e * e for e in resid) / (n - 2) / sxx) if n > 2 else 0.0
    return {"slope_per_step": slope, "slope_se": se, "slope_t": slope / se if se > 0 else 0.0,
            "fit_first": my + slope * (1 - mx), "fit_last": my + slope * (n - mx)}


def plot_run(rewards: list[float], path: str, title: str) -> None:
    """Reward per step with a 10-step moving mean, and the prompt-blind ceiling (always one fix: 1/4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(rewards) + 1))
    mean10 = [statistics.fmean(rewards[max(0, i - 9): i + 1]) for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.plot(steps, rewards, marker="o", ms=3, lw=0.8, alpha=0.7, label="reward (hidden tests), mean of the step's 16 episodes")
    ax.plot(steps, mean10, lw=2, label="10-step moving mean")
    ax.axhline(0.25, ls="--", c="grey", lw=1, label="prompt-blind ceiling: always the same one of the 4 fixes")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward (0 .. 1)")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description="GRPO of the embedded model on multi-turn sandbox tool tasks")
    ap.add_argument("--steps", type=int, default=60, help="GRPO steps at most (--budget-minutes may stop earlier)")
    ap.add_argument("--budget-minutes", type=float, default=20.0,
                    help="wall clock for the whole run, setup and warm start included; 0: no limit")
    ap.add_argument("--groups", type=int, default=4, help="groups each step returns")
    ap.add_argument("--extra", type=int, default=0, help="groups started beyond --groups (stragglers carried with --partial)")
    ap.add_argument("--partial", action="store_true", help="carry unfinished groups into the next step")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--filter-truncated", action="store_true",
                    help="compact filtering: leave episodes cut by --max-turns out of the loss (off: the edit decides the "
                         "reward whatever the last turn is, so those episodes are trained on)")
    ap.add_argument("--tasks", type=int, default=48, help="narrow guided tasks GRPO draws from")
    ap.add_argument("--tools", default="edit_file,submit", help="the tools offered (comma-separated)")
    ap.add_argument("--max-turns", type=int, default=2)
    ap.add_argument("--max-tokens-per-turn", type=int, default=64)
    ap.add_argument("--warm-start-steps", type=int, default=30)
    ap.add_argument("--warm-start-lr", type=float, default=2e-3)
    ap.add_argument("--warm-start-batch", type=int, default=4)
    ap.add_argument("--warm-start-tasks", type=int, default=48, help="scripted trajectories (disjoint from --tasks)")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--lr-warmup-steps", type=int, default=5,
                    help="GRPO steps of linear lr warm-up: Adam's first steps after fresh moments move every weight "
                         "by ~lr whatever its gradient (measured: one step at 1e-3 broke the warm-started call format)")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (the trainer scores at the same)")
    ap.add_argument("--format-bonus", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "cuttle-agent-grpo"))
    args = ap.parse_args(argv)
    for name in ("steps", "groups", "group_size", "tasks", "max_turns", "max_tokens_per_turn", "warm_start_batch", "warm_start_tasks"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    tools = tuple(t.strip() for t in args.tools.split(","))
    cfg = AgentConfig(max_turns=args.max_turns, max_tokens_per_turn=args.max_tokens_per_turn, max_total_tokens=4000,
                      turn_wait_s=0.2, tools=tools)  # refuses unknown tool names
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    budget = args.budget_minutes * 60 if args.budget_minutes > 0 else math.inf

    task_seeds = guided_seeds(0, args.tasks, only_narrow=True)
    by_bug: dict[str, list[int]] = {}
    for s in task_seeds:
        by_bug.setdefault(guided_fix(s)[2], []).append(s)
    bugs = sorted(by_bug)
    sft_seeds = guided_seeds(SFT_SEED_START, args.warm_start_tasks, only_narrow=True) if args.warm_start_steps else []
    assert task_seeds[-1] < SFT_SEED_START, "GRPO and warm-start tasks overlap"
    llm = LLM(dtype="float32", max_model_len=4096, num_kv_blocks=1024)
    trainer = Trainer(llm.engine.config.model, TrainerConfig(loss=loss_config("grpo"), lr=args.warm_start_lr,
                                                               max_tokens_per_row=4096, temperature=args.temperature))
    runner = AgentRollout(llm, guided_env, cfg)
    examples = scripted_trajectories(llm, sft_seeds, tools) if args.warm_start_steps else []
    t_sft = time.perf_counter()
    sft_losses = warm_start(trainer, examples, args.warm_start_steps, args.warm_start_batch, rng) if args.warm_start_steps else []
    if sft_losses:
        trainer.push_weights(llm)
    setup_seconds = time.perf_counter() - t_start
    print(f"setup {setup_seconds:.0f}s (warm start {time.perf_counter() - t_sft:.0f}s: {len(sft_losses)} steps, "
          f"loss {sft_losses[:1]} -> {sft_losses[-1:]})", flush=True)

    rewards: list[float] = []
    per_step: list[list[float]] = []
    step_seconds: list[float] = []
    trainer_steps = 0
    log_path = os.path.join(args.out, "log.jsonl")
    try:
        with open(log_path, "w") as log:
            for step in range(1, args.steps + 1):
                t_step = time.perf_counter()
                if step_seconds and t_step - t_start + max(step_seconds[-3:]) > budget:
                    print(f"stopping before step {step}: it would end past --budget-minutes {args.budget_minutes}", flush=True)
                    break
                # each group's task: one of the four bugs uniformly, then a task with it, so a policy that
                # ignores the prompt earns 1/4 whichever fix it prefers
                specs = [{"kind": "guided", "seed": rng.choice(by_bug[rng.choice(bugs)])}
                         for _ in range(args.groups + args.extra - len(runner.carried))]
                params = SamplingParams(temperature=args.temperature, seed=args.seed * 100_003 + step)
                res = runner.step(specs, args.group_size, params, groups_needed=args.groups, partial=args.partial)
                groups: list[AgentGroup] = res.groups
                eps = [e for g in groups for e in g.episodes]
                fmt = [well_formed_first_turn(e, tools) for e in eps]
                edits = [edit_outcome(e) for e in eps]
                hidden = [e.reward for e in eps if not e.failed]
                for e, ok in zip(eps, fmt):
                    if not e.failed and ok:
                        e.reward += args.format_bonus
                stats = episode_stats(groups)
                rewards.append(statistics.fmean(hidden) if hidden else 0.0)
                per_step.append(hidden)
                record: dict[str, object] = {
                    "step": step, **stats, "hidden_tests_reward_mean": rewards[-1],
                    "format_rate": sum(fmt) / max(1, len(fmt)),
                    **{f"edit_{k}_rate": edits.count(k) / max(1, len(edits)) for k in ("right", "wrong", "none")},
                    "groups_with_variance": sum(len(set(g.rewards)) > 1 for g in groups),
                    # which bug each group's prompt names, and which fix (old_str) each first edit call wrote
                    "task_bugs": dict(Counter(guided_fix(int(g.spec["seed"]))[2] for g in groups)),
                    "edit_choices": dict(Counter(edit_choice(e) for e in eps)),
                    "rollout_seconds": res.seconds, "aborted": len(res.aborted), "carried": res.carried,
                    # time the step spent after its fastest group was complete: what the slowest groups cost it
                    "straggler_wait_seconds": res.seconds - min((max(e.seconds for e in g.episodes) for g in groups), default=0.0),
                }
                batch, counts = agent_batch(groups + res.aborted, scale_by_std=True, filter_truncated=args.filter_truncated)
                record.update({f"batch_{k}": v for k, v in counts.items()})
                if batch is not None and batch.advantages.abs().sum() > 0:
                    trainer_steps += 1
                    for group in trainer.optimizer.param_groups:
                        group["lr"] = args.lr * min(1.0, trainer_steps / max(1, args.lr_warmup_steps))
                    record["lr"] = trainer.optimizer.param_groups[0]["lr"]
                    record.update(trainer.step(batch, current_version=llm.engine.weight_version))
                    trainer.push_weights(llm)
                record["weight_version"] = llm.engine.weight_version
                record["example"] = eps[0].turns[0].text[:200] if eps and eps[0].turns else ""
                step_seconds.append(time.perf_counter() - t_step)
                record["step_seconds"] = step_seconds[-1]
                record["elapsed_seconds"] = time.perf_counter() - t_start
                log.write(json.dumps(record) + "\n")
                log.flush()
                print(f"step {step:3d}  reward {rewards[-1]:.3f}  right edit {record['edit_right_rate']:.2f}  "
                      f"wrong edit {record['edit_wrong_rate']:.2f}  format {record['format_rate']:.2f}  "
                      f"loss {record.get('loss', float('nan')):+.4f}  mismatch {record.get('mismatch_max_abs', float('nan')):.1e}  "
                      f"{step_seconds[-1]:.0f}s  t {record['elapsed_seconds']:.0f}s", flush=True)
    finally:
        runner.close()
    summary: dict[str, object] = {
        **(compare(rewards, per_step, max(1, min(3, len(rewards) // 2))) if rewards else {}),
        "window_10": compare(rewards, per_step, 10) if len(rewards) >= 20 else None,
        "linear_fit": linear_fit(rewards) if len(rewards) >= 3 else None,
        "steps": len(rewards), "seconds": time.perf_counter() - t_start, "setup_seconds": setup_seconds,
        "grpo_step_seconds_mean": statistics.fmean(step_seconds) if step_seconds else None,
        "warm_start_steps": len(sft_losses), "warm_start_loss_first": sft_losses[0] if sft_losses else None,
        "warm_start_loss_last": sft_losses[-1] if sft_losses else None, "format_bonus": args.format_bonus,
        "groups": args.groups, "group_size": args.group_size, "lr": args.lr, "lr_warmup_steps": args.lr_warmup_steps,
        "trainer_steps": trainer_steps, "tools": list(tools),
        "temperature": args.temperature, "partial": args.partial, "budget_minutes": args.budget_minutes,
        "filter_truncated": args.filter_truncated, "tasks": len(task_seeds), "bugs": {b: len(v) for b, v in by_bug.items()}}
    # the rise counts when the last 10 steps' episodes beat the first 10's beyond chance (z > 2) and
    # the line through all steps rises beyond its own error (t > 2)
    w, fit = summary["window_10"], summary["linear_fit"]
    summary["improved_beyond_noise"] = bool(w and fit and w["z_last_vs_first"] > 2 and fit["slope_t"] > 2)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if rewards:
        w = summary["window_10"] or summary
        plot_run(rewards, os.path.join(args.out, "reward.png"),
                 f"agent GRPO of the embedded model: narrow guided tasks, tools {'+'.join(tools)}, warm start {len(sft_losses)} "
                 f"steps, {args.groups}x{args.group_size} episodes/step, lr {args.lr:g}"
                 f"{f', +{args.format_bonus} format bonus in training' if args.format_bonus else ''}\n"
                 f"first {w['window']} steps {w['first_mean']:.3f} -> last {w['window']} {w['last_mean']:.3f} "
                 f"(z {w['z_last_vs_first']:.1f}); step noise {summary['step_noise']:.3f}; {summary['seconds'] / 60:.1f} min in all")
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
