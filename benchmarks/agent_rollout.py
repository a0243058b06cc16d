"""Agent rollout benchmark: multi-turn coding episodes in the sandbox, 1 in-process engine vs 2 Ray
rollout workers on this machine, and with injected stragglers, synchronous steps (wait for every
group) vs over-sampling (abort the slowest) vs partial rollouts (carry them into the next step).

    python benchmarks/agent_rollout.py                         # full delays (straggling calls 5-20 s)
    python benchmarks/agent_rollout.py --quick                 # ~10 min: 3 steps, delays x0.5, 8 engine tokens/turn
    python benchmarks/agent_rollout.py --systems ray2 --modes sync partial --delay-scale 0.5

Two policies, labelled as such in every table and in the JSON:
* `scripted`: the embedded model never writes a tool call by itself, so the rollout system is
  measured with a scripted policy over the real engine: turn i of an episode is the fix script's
  turn i for its synthetic task (read the buggy file, edit the bug away, run the tests, submit:
  tool calls in the model's own Hermes format), and for each turn the engine really runs on the
  trajectory's ids (prefill of the history, cache hits, then as many decode steps as the scripted
  turn has tokens, `ignore_eos`), so sampling costs what the model would cost to write that turn;
  the tokens placed in the trajectory are the script's (their logprobs are not recorded: nothing
  here trains). `--engine-tokens-per-turn N` caps those decode steps at N (the engine still
  prefills the real history): on a loaded 2-core CPU writing a 60-token turn takes seconds, which
  a GPU engine does in milliseconds, so the cap keeps the step dominated by what this benchmark
  is about, the environments and the stragglers; the cap is printed and stored with the results. Tools, workspaces and rewards are the real sandbox's (hidden tests on a fresh copy).
* `model`: the embedded model's own single-turn episodes on the same tasks (it answers without a
  tool call and the episode ends), the real token-in/token-out path end to end.

Stragglers: with `--straggle p` (default 0.1), each tool call sleeps U(5, 20) s x `--delay-scale`
before running with probability p (drawn per episode and call from a seeded RNG, so every mode
sees the same kind of tails). Each step must return `--groups` groups of `--group-size`:
* `sync`: `--groups` groups started, wait for all;
* `oversample`: `--groups + --extra` started, return at `--groups` complete, abort the rest;
* `partial`: `--groups + --extra` in flight (new ones top the carried up), return at `--groups`
  complete, the rest carried into the next step (never aborted, never waited for); after the
  first step that is `--groups` new groups per step, as in `sync`, with `--extra` carried ones.
Reported per (policy, system, mode): steps/min, trajectories/min (returned ones), sampled
tokens/s, environment-busy seconds (tool calls + grading) per step, trajectories aborted, and the
step rate against `sync` with stragglers on the same system (the ratio the issue targets, >= 2x).
Nothing trains between steps (a trainer's time between steps would only help partial rollouts:
the stragglers' calls keep running meanwhile).

Systems: `inproc` (one `AgentRollout` over one engine in this process), `ray2` (2 `RolloutWorker`
actors of one CPU each, every worker's engine behind an `EngineSampler`: its groups' turns decode
in one continuous batch), `ray2_locked` (the same workers with the engine behind the worker's lock,
one group's turn at a time: the control for batching inside a worker, measured without stragglers
only). `--straggler-systems` picks the systems measured with stragglers too.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, markdown_table  # noqa: E402

from cuttle.engine.sampling_params import SamplingParams  # noqa: E402
from cuttle.rl.agent import AgentConfig, AgentGroup, AgentRollout  # noqa: E402
from cuttle.rl.types import Sample  # noqa: E402

ASSISTANT = "<|im_start|>assistant"
NUM_TASKS = 64  # synthetic task seeds cycled through


def tool_call(name: str, **arguments: Any) -> str:
    """A tool call exactly as the embedded model's template writes one."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def fix_script(seed: int) -> list[str]:
    from cuttle.sandbox.tasks import make_task

    task = make_task({"kind": "synthetic", "seed": seed})
    m = task.metadata
    path = next(p for p, text in task.files.items() if m["mutant"] in text)
    return [tool_call("read_file", path=path),
            tool_call("edit_file", path=path, old_str=m["mutant"], new_str=m["original"]),
            tool_call("run_tests"), tool_call("submit")]


class ScriptedOverEngine:
    """A `TokenSampler`: the script's turns, with the engine run for each turn as described above.
    `llm` is an `LLM` (in process: one caller) or an `EngineSampler` (a Ray worker: every group
    thread at once, the turns batched continuously in the engine)."""

    def __init__(self, llm: Any, engine_tokens: int | None = None):
        from cuttle.rl.engine_sampler import EngineSampler
        from cuttle.sandbox.tasks import make_task

        self.engine_tokens = engine_tokens
        self.llm, self.tok = llm, llm.get_tokenizer()
        self.thread_safe = isinstance(llm, EngineSampler)
        self.eos_token_ids = llm.engine.eos_token_ids
        self.end_of_turn = self.tok.encode("<|im_end|>", add_special_tokens=False)[0]
        self.scripts = {make_task({"kind": "synthetic", "seed": s}).prompt: s for s in range(NUM_TASKS)}
        self.cache: dict[int, list[str]] = {}

    def _turn(self, ids: list[int]) -> tuple[list[int], str]:
        text = self.tok.decode(ids, skip_special_tokens=False)
        seed = next(s for p, s in self.scripts.items() if p in text)
        script = self.cache.setdefault(seed, fix_script(seed))
        body = script[min(text.count(ASSISTANT) - 1, len(script) - 1)]
        return self.tok.encode(body, add_special_tokens=False) + [self.end_of_turn], body

    def generate_tokens(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        turns = [self._turn(ids) for ids in prompts]
        lens = [min(len(t), params.max_tokens) for t, _ in turns]
        sps = [SamplingParams(n=params.n, temperature=params.temperature, ignore_eos=True,
                              max_tokens=k if self.engine_tokens is None else min(k, self.engine_tokens)) for k in lens]
        # the cost of writing these turns
        self.llm.generate(prompts, sps) if self.thread_safe else self.llm.generate(prompts, sps, use_tqdm=False)
        version = self.llm.engine.weight_version
        out = []
        for (t, body), k in zip(turns, lens):
            ids = t[:k]
            finish = "stop" if len(ids) == len(t) else "length"
            out.append([Sample(list(ids), [0.0] * len(ids), finish, version, text=body) for _ in range(params.n)])
        return out

    def update_weights(self, named_tensors: Any, in_flight: str = "abort") -> int:
        return self.llm.update_weights(named_tensors, in_flight)

    def stats(self) -> dict[str, Any]:
        return self.llm.stats()


class StragglerEnv:
    """A sandbox environment whose tool calls sometimes sleep first (an injected straggler)."""

    def __init__(self, env: Any, delays: list[float]):
        self.env, self.delays, self.calls = env, delays, 0
        self.task_id, self.prompt = env.task_id, env.prompt
        self.lock = threading.Lock()

    def call(self, name: str, arguments: dict[str, Any]) -> tuple[bool, str]:
        with self.lock:
            i, self.calls = self.calls, self.calls + 1
        if i < len(self.delays) and self.delays[i] > 0:
            time.sleep(self.delays[i])
        return self.env.call(name, arguments)

    def reward(self) -> tuple[float, dict[str, Any]]:
        t0 = time.monotonic()
        r, info = self.env.reward()
        info["grade_seconds"] = time.monotonic() - t0
        return r, info

    def close(self) -> None:
        self.env.close()


class StragglerFactory:
    """Environments for specs {"kind": "synthetic", "seed", "uid", "delays": [[per call] per member]};
    the k-th environment made for a spec uid gets member k's delays (a group runs on one worker)."""

    def __init__(self) -> None:
        self.made: dict[str, int] = {}
        self.lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # shipped to Ray workers: each gets its own counters
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()

    def __call__(self, spec: dict[str, Any]) -> StragglerEnv:
        from cuttle.rl.environment import SandboxEnvironment

        with self.lock:
            k = self.made.get(spec["uid"], 0)
            self.made[spec["uid"]] = k + 1
        delays = spec.get("delays", [])
        return StragglerEnv(SandboxEnvironment({"kind": "synthetic", "seed": spec["seed"]}),
                            delays[k] if k < len(delays) else [])


def make_llm(threads: int | None = None) -> Any:
    from cuttle.engine import LLM

    if threads:
        torch.set_num_threads(threads)
    return LLM(dtype="float32", max_model_len=4096, num_kv_blocks=1024)


ENGINE_TOKENS: int | None = None  # set by main before the workers are made (shipped by value)


def scripted_worker() -> tuple[Any, Any, set[int]]:
    from cuttle.rl.engine_sampler import EngineSampler

    s = ScriptedOverEngine(EngineSampler(make_llm(threads=1)), ENGINE_TOKENS)
    return s, s.tok, s.eos_token_ids


def scripted_worker_locked() -> tuple[Any, Any, set[int]]:
    s = ScriptedOverEngine(make_llm(threads=1), ENGINE_TOKENS)  # not thread-safe: the worker locks it
    return s, s.tok, s.eos_token_ids


def model_worker() -> Any:
    return make_llm(threads=1)  # the worker serves it through an EngineSampler


class LockedLLM:
    """An in-process LLM handed to a worker as a plain (not thread-safe) sampler: the worker's lock
    makes its engine sample one group's turn at a time (what workers did before EngineSampler)."""

    def __init__(self, llm: Any):
        self.llm = llm

    def generate_tokens(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        from cuttle.rl.rollout import generate_tokens

        return generate_tokens(self.llm, prompts, params)

    def update_weights(self, named_tensors: Any, in_flight: str = "abort") -> int:
        return self.llm.update_weights(named_tensors, in_flight)

    def stats(self) -> dict[str, Any]:
        return self.llm.stats()


def model_worker_locked() -> tuple[Any, Any, set[int]]:
    llm = make_llm(threads=1)
    return LockedLLM(llm), llm.get_tokenizer(), llm.engine.eos_token_ids


class SpecStream:
    """The same sequence of specs for every mode: spec k is task k % NUM_TASKS with delays from Random(k)."""

    def __init__(self, tag: str, group_size: int, calls: int, p: float, lo: float, hi: float, scale: float):
        self.tag = tag  # the factories outlive a mode: uids must not repeat across modes
        self.k, self.group_size, self.calls, self.p, self.lo, self.hi, self.scale = 0, group_size, calls, p, lo, hi, scale

    def take(self, n: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(n):
            rng = random.Random(self.k)
            delays = [[rng.uniform(self.lo, self.hi) * self.scale if rng.random() < self.p else 0.0
                       for _ in range(self.calls)] for _ in range(self.group_size)]
            out.append({"kind": "synthetic", "seed": self.k % NUM_TASKS, "uid": f"{self.tag}/{self.k}", "delays": delays})
            self.k += 1
        return out


def account(groups: list[AgentGroup]) -> dict[str, float]:
    eps = [e for g in groups for e in g.episodes]
    return {
        "trajectories": float(len(eps)),
        "sampled_tokens": float(sum(sum(e.trajectory.loss_mask) for e in eps if e.trajectory is not None)),
        "env_busy_s": sum(r.seconds for e in eps for t in e.turns for r in t.results)
        + sum(e.reward_info.get("grade_seconds", 0.0) for e in eps),
        "reward_mean": sum(e.reward for e in eps) / max(1, len(eps)),
        "turns_mean": sum(len(e.turns) for e in eps) / max(1, len(eps)),
    }


def run_mode(system: str, policy: str, mode: str, args: argparse.Namespace, straggle: float,
             shared: dict[str, Any]) -> dict[str, Any]:
    stream = SpecStream(f"{policy}/{system}/{mode}/{straggle}", args.group_size, 3, straggle, 5.0, 20.0, args.delay_scale)
    g = args.groups
    started = g if mode == "sync" else g + args.extra
    partial = mode == "partial"

    def new_groups(carried: int) -> int:
        return g if mode == "sync" else started - carried
    params = SamplingParams(temperature=1.0)  # turn lengths: the policy's AgentConfig
    totals = {"trajectories": 0.0, "sampled_tokens": 0.0, "env_busy_s": 0.0, "aborted": 0.0, "started": 0.0}
    rewards, turns, step_s = [], [], []
    t0 = time.perf_counter()
    if system == "inproc":
        runner: Any = shared["inproc"][policy]
        for _ in range(args.steps):
            specs = stream.take(new_groups(len(runner.carried)))
            totals["started"] += len(specs)
            res = runner.step(specs, args.group_size, params, groups_needed=g, partial=partial)
            acc = account(res.groups)
            totals["aborted"] += sum(len(a.episodes) for a in res.aborted)
            step_s.append(res.seconds)
            for k in ("trajectories", "sampled_tokens", "env_busy_s"):
                totals[k] += acc[k]
            rewards.append(acc["reward_mean"])
            turns.append(acc["turns_mean"])
        wall = time.perf_counter() - t0
        left = len(runner.drop_carried())
    else:
        rollout = shared["ray"][(policy, system)]
        for _ in range(args.steps):
            specs = stream.take(new_groups(rollout.carried))
            totals["started"] += len(specs)
            res = rollout.run_step(specs, args.group_size, params, groups_needed=g, partial=partial, timeout_s=900)
            acc = account(res.groups)
            totals["aborted"] += len(res.aborted) * args.group_size
            step_s.append(res.seconds)
            for k in ("trajectories", "sampled_tokens", "env_busy_s"):
                totals[k] += acc[k]
            rewards.append(acc["reward_mean"])
            turns.append(acc["turns_mean"])
        wall = time.perf_counter() - t0
        left = rollout.drop_carried()
        rollout.drain(timeout_s=120)
    return {
        "policy": policy, "system": system, "mode": mode, "stragglers": straggle > 0, "steps": args.steps,
        "groups_per_step": g, "groups_started_per_step": totals["started"] / args.steps, "wall_s": wall,
        "steps_per_min": 60 * args.steps / wall, "trajectories_per_min": 60 * totals["trajectories"] / wall,
        "sampled_tokens_per_s": totals["sampled_tokens"] / wall, "env_busy_s_per_step": totals["env_busy_s"] / args.steps,
        "aborted_trajectories": totals["aborted"], "carried_at_end": left, "step_seconds": step_s,
        "reward_mean": sum(rewards) / len(rewards), "turns_mean": sum(turns) / len(turns),
    }


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['policy']}\n{r['system']}\n{r['mode']}{' +str' if r['stragglers'] else ''}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(rows) * 2), 4.5))
    for ax, key, name in ((axes[0], "steps_per_min", "steps / min"), (axes[1], "trajectories_per_min", "trajectories / min")):
        colors = ["tab:gray" if not r["stragglers"] else {"sync": "tab:red", "oversample": "tab:blue",
                                                          "partial": "tab:green"}[r["mode"]] for r in rows]
        ax.bar(range(len(rows)), [r[key] for r in rows], color=colors)
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylabel(name)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 steps, delays x0.5, engine tokens per scripted turn capped at 8")
    ap.add_argument("--steps", type=int, default=None, help="steps per mode (default 6; --quick 3)")
    ap.add_argument("--groups", type=int, default=4, help="groups each step must return")
    ap.add_argument("--extra", type=int, default=4, help="groups started beyond --groups (oversample, partial)")
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--straggle", type=float, default=0.1, help="probability that a tool call straggles")
    ap.add_argument("--delay-scale", type=float, default=None, help="x the 5-20 s delays (default 1; --quick 0.5)")
    ap.add_argument("--engine-tokens-per-turn", type=int, default=None,
                    help="cap on the engine's decode steps per scripted turn (default: the whole turn; --quick 8)")
    ap.add_argument("--max-tokens", type=int, default=48, help="max tokens of the model policy's turn")
    ap.add_argument("--systems", nargs="+", default=["inproc", "ray2"], choices=["inproc", "ray2", "ray2_locked"],
                    help="ray2_locked: 2 workers whose engine serves one group's turn at a time (the old lock)")
    ap.add_argument("--straggler-systems", nargs="+", default=["inproc", "ray2"], choices=["inproc", "ray2"],
                    help="systems measured with stragglers too (ray2_locked never is: it is the batching control)")
    ap.add_argument("--modes", nargs="+", default=["sync", "oversample", "partial"], choices=["sync", "oversample", "partial"])
    ap.add_argument("--policies", nargs="+", default=["scripted", "model"], choices=["scripted", "model"])
    ap.add_argument("--out", default="/tmp/cuttle-agent-rollout")
    args = ap.parse_args(argv)
    args.steps = args.steps or (3 if args.quick else 6)
    args.delay_scale = args.delay_scale if args.delay_scale is not None else (0.5 if args.quick else 1.0)
    if args.engine_tokens_per_turn is None and args.quick:
        args.engine_tokens_per_turn = 8
    global ENGINE_TOKENS
    ENGINE_TOKENS = args.engine_tokens_per_turn
    os.makedirs(args.out, exist_ok=True)
    info = machine_info()
    print(info)
    from cuttle.rl.environment import sandbox_factory  # noqa: F401 - fail early without the sandbox

    shared: dict[str, Any] = {"inproc": {}, "ray": {}}
    # turn_wait_s: in process, episodes whose calls are back go on without a straggling one
    cfgs = {"scripted": AgentConfig(max_turns=6, max_tokens_per_turn=512, max_total_tokens=4096, turn_wait_s=0.1),
            "model": AgentConfig(max_turns=6, max_tokens_per_turn=args.max_tokens, max_total_tokens=4096, turn_wait_s=0.1)}
    rows: list[dict[str, Any]] = []
    plan: list[tuple[str, str, str, float]] = []
    for policy in args.policies:
        for system in args.systems:
            plan.append((policy, system, "sync", 0.0))  # the system without stragglers
            # the model policy makes no tool calls: nothing can straggle; ray2_locked is the control
            # of worker batching, measured without stragglers only
            if policy == "scripted" and system in args.straggler_systems:
                plan += [(policy, system, m, args.straggle) for m in args.modes]
    try:
        if "inproc" in args.systems:
            llm = make_llm()
            s = ScriptedOverEngine(llm, args.engine_tokens_per_turn)
            shared["inproc"]["scripted"] = AgentRollout(s, StragglerFactory(), cfgs["scripted"], tokenizer=s.tok, eos_token_ids=s.eos_token_ids)
            shared["inproc"]["model"] = AgentRollout(llm, StragglerFactory(), cfgs["model"])
        if any(s.startswith("ray2") for s in args.systems):
            import ray

            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        for policy, system, mode, straggle in plan:
            if system.startswith("ray2") and (policy, system) not in shared["ray"]:
                from cuttle.rl.ray_rollout import RayRollout

                for other in shared["ray"].values():  # 2 workers of one CPU each: one policy's at a time
                    other.shutdown()
                factory = {("scripted", "ray2"): scripted_worker, ("scripted", "ray2_locked"): scripted_worker_locked,
                           ("model", "ray2"): model_worker, ("model", "ray2_locked"): model_worker_locked}[(policy, system)]
                shared["ray"] = {(policy, system): RayRollout(2, factory,
                                                    StragglerFactory(), cfgs[policy], num_cpus=1)}
            row = run_mode(system, policy, mode, args, straggle, shared)
            rows.append(row)
            print(f"{policy:8s} {system:6s} {mode:10s} stragglers={straggle > 0!s:5s} steps/min {row['steps_per_min']:.2f}  "
                  f"traj/min {row['trajectories_per_min']:.1f}  tok/s {row['sampled_tokens_per_s']:.1f}  "
                  f"step s {[round(x, 1) for x in row['step_seconds']]}", flush=True)
    finally:
        for runner in shared["inproc"].values():
            runner.close()
        for rollout in shared["ray"].values():
            rollout.shutdown()
        if shared["ray"]:
            import ray

            ray.shutdown()
    for r in rows:
        base = next((b for b in rows if b["policy"] == r["policy"] and b["system"] == r["system"] and b["mode"] == "sync"
                     and b["stragglers"] == r["stragglers"]), None)
        r["vs_sync"] = r["steps_per_min"] / base["steps_per_min"] if base else math.nan
    headers = ["policy", "system", "mode", "stragglers", "steps/min", "traj/min", "sampled tok/s", "env busy s/step",
               "aborted traj", "carried at end", "reward", "turns", "step rate vs sync"]
    table = markdown_table(headers, [[r["policy"], r["system"], r["mode"], "yes" if r["stragglers"] else "no",
                                      r["steps_per_min"], r["trajectories_per_min"], r["sampled_tokens_per_s"],
                                      r["env_busy_s_per_step"], int(r["aborted_trajectories"]), r["carried_at_end"],
                                      r["reward_mean"], r["turns_mean"], r["vs_sync"]] for r in rows])
    print(table)
    with open(os.path.join(args.out, "agent_rollout.json"), "w") as f:
        json.dump({"args": vars(args), "machine": info, "rows": rows}, f, indent=2)
    plot(rows, os.path.join(args.out, "agent_rollout.png"),
         f"agent rollouts, {args.groups} groups x {args.group_size} per step, stragglers p={args.straggle} "
         f"U(5,20)s x{args.delay_scale}; scripted policy over the real engine (decode cap {args.engine_tokens_per_turn}); "
         "model = embedded model single-turn")
    print(f"wrote {args.out}/agent_rollout.json and agent_rollout.png")
    return rows


if __name__ == "__main__":
    main()
