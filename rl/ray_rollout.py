"""Agent rollouts on Ray: rollout workers as actors under a single controller (the driver).

Owns spreading a step's groups over `RolloutWorker` actors, each of which owns a sampler (an
in-process engine, or with `ServedSampler` a client of a running `cuttle serve`) and the sandbox environments of the groups it runs, and the controller's
decisions: where a group goes, when a step is done, what is aborted, what is retried, and which
weights every worker samples with.

* Affinity: a group is the unit of placement. All its members and all their later turns run on
  the worker that got it, so the group's prompt is prefilled once there (one request, `n` =
  members) and every later turn extends ids whose KV that worker's prefix cache holds. Groups go
  to the live worker with the fewest groups outstanding.
* Stragglers: `run_step` may be given more groups than it needs (over-sampling); it returns as
  soon as `groups_needed` have finished and aborts the others (their episodes stop between turns or
  while waiting on a tool, their environments are closed, their engine requests are done: nothing
  stays in KV between turns on the offline engine).
* Partial rollouts: with `run_step(..., partial=True)` the groups still running when enough have
  finished are neither waited for nor aborted: they keep running on their worker (a tool call
  they wait on goes on; their next turns sample with whatever weights the worker has by then, so
  their tokens carry several weight versions, each token its own) and the next `run_step` counts
  them first, before its new specs.
* Failures: a worker that dies mid-step loses no group; its groups are given to the remaining
  workers and run again from the start.
* Weights: `update_weights` puts the tensors in the object store once and loads them into every
  worker, between steps, and checks that all report the same new version (every sample carries
  the version that produced it); `update_lora` does the same with a LoRA adapter, which every
  worker's sampler then samples under (a LoRA trainer's `push_weights(rollout)`).

Within a worker, groups run in threads of a threaded actor, each its own `AgentRollout.run`, so one
group's tool calls overlap another's sampling. An in-process engine is wrapped in `EngineSampler`
(rl/engine_sampler.py): every group's turn joins the engine's running batch at its next step, so
the worker's groups share engine batches (continuous batching). A sampler that says it is
`thread_safe` (`EngineSampler`, `RolloutClient` fronting a `cuttle serve`, which batches on its
side) is called from all group threads at once; any other is serialized by a lock.
`ray` is imported only here; `cuttle.rl` and `cuttle.engine` import without it. Multi-node: the
same code, with `ray.init(address=...)` on the driver and the workers placed by Ray's scheduler.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from cuttle.engine.llm import LLM
from cuttle.engine.sampling_params import SamplingParams
from cuttle.engine.tokenizer import Tokenizer
from cuttle.rl.agent import AgentConfig, AgentGroup, AgentRollout
from cuttle.rl.engine_sampler import EngineSampler
from cuttle.rl.environment import AgentEnvironment, EnvFactory
from cuttle.rl.rollout import TokenSampler, generate_tokens

# builds a worker's sampler: an LLM (served through an EngineSampler), or (sampler, its tokenizer,
# its EOS ids), e.g. (RolloutClient(url), Tokenizer(model path), eos ids) to front a `cuttle serve`
SamplerFactory = Callable[[], LLM | tuple[TokenSampler, Tokenizer, set[int]]]


@dataclass(frozen=True, slots=True)
class ServedSampler:
    """A `SamplerFactory` for a worker that fronts a running `cuttle serve` instead of owning an
    engine: its turns go to the server's `/v1/rl/generate` as token ids (`RolloutClient`, several
    group threads at once; the server batches them), weight updates to `/v1/rl/update_weights`.
    `model` is the served checkpoint's path as the worker sees it, for its tokenizer and chat
    template (the worker never tokenizes a sampled turn: it renders the template's additions)."""

    url: str | tuple[str, ...]
    model: str
    api_key: str | None = None

    def __call__(self) -> tuple[TokenSampler, Tokenizer, set[int]]:
        from cuttle.rl.client import RolloutClient  # httpx: the serve extra, needed only here

        client = RolloutClient(self.url if isinstance(self.url, str) else list(self.url), self.api_key)
        return client, Tokenizer(self.model), client.eos_token_ids


class _LockedSampler:
    """A sampler that is not thread-safe, called by one group thread at a time."""

    accepts_param_lists = True  # rollout.generate_tokens splits a list for the sampler below

    def __init__(self, sampler: TokenSampler):
        self.sampler, self.lock = sampler, threading.Lock()

    def generate_tokens(self, prompts, params):  # noqa: ANN001 - TokenSampler's signature
        with self.lock:
            return generate_tokens(self.sampler, prompts, params)

    @property
    def lora_name(self) -> str | None:
        return getattr(self.sampler, "lora_name", None)


class _CountedEnv:
    """An environment that tells its worker when it is closed (the release check of a step)."""

    def __init__(self, env: AgentEnvironment, worker: RolloutWorker):
        self.env, self.worker = env, worker
        self.task_id, self.prompt = env.task_id, env.prompt

    def call(self, name: str, arguments: dict[str, Any]) -> tuple[bool, str]:
        return self.env.call(name, arguments)

    def reward(self) -> tuple[float, dict[str, Any]]:
        return self.env.reward()

    def close(self) -> None:
        try:
            self.env.close()
        finally:  # counted closed either way: AgentRollout logs and counts a failed close
            with self.worker._lock:
                self.worker.open_envs -= 1


class RolloutWorker:
    """One Ray actor's state: a sampler, environments, the groups it is running."""

    def __init__(self, sampler_factory: SamplerFactory, env_factory: EnvFactory, config: AgentConfig | None = None,
                 niceness: int | None = None):
        # Ray starts worker processes at niceness 15 (its worker_niceness), meant for background
        # tasks: a rollout worker is the foreground work, and on a shared machine a niced worker
        # (and the sandboxes it starts, which inherit it) gets a sliver of a core beside the
        # driver. Back to the driver's priority where the OS lets us; stats() says what we got.
        self.niceness = os.getpriority(os.PRIO_PROCESS, 0)
        if niceness is not None and self.niceness > niceness:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, niceness)
                self.niceness = niceness
            except PermissionError:  # unprivileged: start Ray with RAY_worker_niceness=0 instead
                pass
        made = sampler_factory()
        if isinstance(made, LLM):
            made = EngineSampler(made)
            self.sampler, tok, eos = made, made.get_tokenizer(), made.eos_token_ids
        else:
            self.sampler, tok, eos = made
        self.thread_safe = bool(getattr(self.sampler, "thread_safe", False))
        self.locked = self.sampler if self.thread_safe else _LockedSampler(self.sampler)
        self.stopping: set[int] = set()
        self.running: set[int] = set()
        self.open_envs = 0  # environments alive right now (started and not yet closed)
        self._lock = threading.Lock()
        self.rollout = AgentRollout(self.locked, self._counted(env_factory), config, tokenizer=tok, eos_token_ids=eos)

    def _counted(self, factory: EnvFactory) -> EnvFactory:
        def make(spec: dict[str, Any]) -> _CountedEnv:
            env = _CountedEnv(factory(spec), self)
            with self._lock:
                self.open_envs += 1
            return env
        return make

    def run_group(self, group_id: int, spec: dict[str, Any], group_size: int, params: SamplingParams) -> AgentGroup:
        with self._lock:
            self.running.add(group_id)
        try:
            [group] = self.rollout.run([spec], group_size, params, should_stop=lambda: group_id in self.stopping)
            return group
        finally:
            with self._lock:
                self.running.discard(group_id)
                self.stopping.discard(group_id)

    def abort(self, group_ids: Iterable[int]) -> None:
        with self._lock:
            self.stopping |= set(group_ids) & self.running

    def update_weights(self, tensors: dict[str, torch.Tensor]) -> int:
        if self.thread_safe:  # between engine steps; turns in flight finish under the old weights
            return self.sampler.update_weights(iter(tensors.items()), in_flight="finish")
        with self.locked.lock:  # never in the middle of a turn's sampling
            return self.sampler.update_weights(iter(tensors.items()))

    def update_lora(self, lora_name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
        """LoRA training's sync: the adapter to this worker's sampler, which draws every later turn
        under it (the rollout asks the sampler for `lora_name`)."""
        update = getattr(self.sampler, "update_lora", None)
        if update is None:
            raise ValueError(f"this worker's {type(self.sampler).__name__} takes no LoRA adapter (it has no update_lora)")
        if self.thread_safe:  # between engine steps; turns in flight finish under the adapter they began with
            return update(lora_name, iter(tensors.items()), config, in_flight="finish")
        with self.locked.lock:  # never in the middle of a turn's sampling
            return update(lora_name, iter(tensors.items()), config)

    def reload_weights(self, path: str | None) -> int:
        """The sampler's engine reads its weights from a checkpoint directory (this worker's
        view of the path); returns the new version."""
        reload = getattr(self.sampler, "reload_weights", None)
        if reload is None:
            raise ValueError(f"this worker's {type(self.sampler).__name__} cannot reload weights from a checkpoint "
                             "(no reload_weights): send them with update_weights")
        if self.thread_safe:  # between engine steps; turns in flight finish under the old weights
            return reload(path)
        with self.locked.lock:  # never in the middle of a turn's sampling
            return reload(path)

    def sleep(self, level: int) -> None:
        """The sampler's sleep mode (an engine's, or a served one's through its client); only
        between steps: the engine refuses while turns run."""
        self._sleep_mode("sleep")(level)

    def wake_up(self, tags: list[str] | None) -> None:
        self._sleep_mode("wake_up")(tags)

    def is_sleeping(self) -> bool:
        return bool(self._sleep_mode("is_sleeping")())

    def _sleep_mode(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.sampler, name, None)
        if fn is None:
            raise ValueError(f"this worker's {type(self.sampler).__name__} has no sleep mode (no {name})")
        return fn

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"open_envs": self.open_envs, "running_groups": len(self.running), "niceness": self.niceness,
                               "env_close_errors": self.rollout.env_close_errors}
        if callable(getattr(self.sampler, "stats", None)):
            out.update(self.sampler.stats())
        return out

    def ping(self) -> bool:
        return True


@dataclass(slots=True)
class StepResult:
    groups: list[AgentGroup]  # the first `groups_needed` to finish, in the order they finished
    group_ids: list[int]  # index of each into the specs of the step it was started in
    aborted: list[int]  # specs whose groups were cut because enough had finished
    retried: list[int]  # specs run again after their worker died
    seconds: float
    started_in: list[int] = field(default_factory=list)  # the step each group was started in (1, 2, ...)
    carried: int = 0  # groups left running into the next step (partial rollouts)


@dataclass(slots=True)
class _Flight:
    """A group in flight on a worker."""

    step: int
    spec_index: int
    spec: dict[str, Any]
    group_size: int
    params: SamplingParams
    worker: int = -1
    uid: int = -1  # the worker's handle for aborting it: unique over the controller's life


class RayRollout:
    """The controller: `num_workers` RolloutWorker actors and the step loop over them."""

    def __init__(self, num_workers: int, sampler_factory: SamplerFactory, env_factory: EnvFactory,
                 config: AgentConfig | None = None, num_cpus: float = 1.0, max_groups_per_worker: int = 16):
        if not ray.is_initialized():
            raise RuntimeError("call ray.init() (or ray.init(address=...) for a cluster) before RayRollout")
        actor = ray.remote(num_cpus=num_cpus, max_concurrency=max_groups_per_worker + 2, max_restarts=0)(RolloutWorker)
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        self.workers = [actor.remote(sampler_factory, env_factory, config, nice) for _ in range(num_workers)]
        ray.get([w.ping.remote() for w in self.workers])  # fail here, not mid-step, if a worker cannot start
        self.dead: set[int] = set()
        self._draining: list[ray.ObjectRef] = []  # aborted groups of the last step, still winding down
        self._carried: dict[ray.ObjectRef, _Flight] = {}  # groups running into the next step
        self._steps = 0
        self._uids = 0
        self.lora_name: str | None = None  # the adapter every worker samples under (update_lora)

    def live(self) -> list[int]:
        return [i for i in range(len(self.workers)) if i not in self.dead]

    @property
    def carried(self) -> int:
        """Groups started in earlier steps and still running (partial rollouts)."""
        return len(self._carried)

    def run_step(self, specs: list[dict[str, Any]], group_size: int, params: SamplingParams,
                 groups_needed: int | None = None, timeout_s: float = 600.0, partial: bool = False) -> StepResult:
        """Run one group per spec, after the groups carried from the last step; return when
        `groups_needed` (default: all of them) have finished. The rest are aborted, or with
        `partial` left running into the next step."""
        t0 = time.monotonic()
        total = len(self._carried) + len(specs)
        needed = total if groups_needed is None else groups_needed
        if not 0 < needed <= total:
            raise ValueError(f"groups_needed must be in 1..{total}, got {needed}")
        self._steps += 1
        refs, self._carried = self._carried, {}  # ref -> the group it runs
        outstanding = {i: 0 for i in range(len(self.workers))}
        for f in refs.values():
            outstanding[f.worker] += 1

        def submit(f: _Flight) -> None:
            live = self.live()
            if not live:
                raise RuntimeError("every rollout worker has died")
            f.worker = min(live, key=lambda i: (outstanding[i], i))
            f.uid, self._uids = self._uids, self._uids + 1
            outstanding[f.worker] += 1
            refs[self.workers[f.worker].run_group.remote(f.uid, f.spec, f.group_size, f.params)] = f

        for gi, spec in enumerate(specs):
            submit(_Flight(self._steps, gi, spec, group_size, params))
        done: list[tuple[_Flight, AgentGroup]] = []
        retried: list[int] = []
        while len(done) < needed:
            left = t0 + timeout_s - time.monotonic()
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=max(left, 0.0))
            if not ready:
                self._carried = refs  # still running: the caller may drop_carried() or run on
                raise TimeoutError(f"rollout step: {len(done)} of {needed} groups after {timeout_s} s")
            f = refs.pop(ready[0])
            outstanding[f.worker] -= 1
            try:
                done.append((f, ray.get(ready[0])))
            except ray.exceptions.RayActorError:  # the worker died: its groups start again elsewhere
                w = f.worker
                self.dead.add(w)
                lost = [(r, g) for r, g in refs.items() if g.worker == w]
                for r, _ in lost:
                    refs.pop(r)
                for g in [f] + [g for _, g in lost]:
                    retried.append(g.spec_index)
                    submit(g)
        aborted: list[int] = []
        if partial:
            self._carried = refs
        else:
            aborted = sorted(f.spec_index for f in refs.values())
            self._abort(refs)
        return StepResult([g for _, g in done], [f.spec_index for f, _ in done], aborted, retried,
                          time.monotonic() - t0, [f.step for f, _ in done], len(self._carried))

    def _abort(self, refs: dict[ray.ObjectRef, _Flight]) -> None:
        by_worker: dict[int, list[int]] = {}
        for f in refs.values():
            by_worker.setdefault(f.worker, []).append(f.uid)
        for w, uids in by_worker.items():
            if w not in self.dead:
                self.workers[w].abort.remote(uids)
        self._draining += list(refs)

    def drop_carried(self) -> int:
        """Abort the groups carried into the next step (their environments close); returns how many.
        `drain()` waits for them to wind down."""
        carried, self._carried = self._carried, {}
        self._abort(carried)
        return len(carried)

    def drain(self, timeout_s: float = 60.0) -> None:
        """Wait for the aborted groups of the last step to wind down (their environments closed)."""
        if self._draining:
            ray.wait(self._draining, num_returns=len(self._draining), timeout=timeout_s)
        self._draining = []

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], in_flight: str = "finish") -> int:
        """Load new weights into every live worker; returns the version all of them now have.
        `in_flight`: see `_check_in_flight` (`trainer.push_weights(rollout)` passes one)."""
        self._check_in_flight(in_flight)
        return self._to_every_worker("update_weights", named_tensors)

    def update_lora(self, lora_name: str, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any],
                    in_flight: str = "finish") -> int:
        """LoRA training's weight sync (`trainer.push_weights(rollout)`): the adapter into every
        live worker's sampler, which then draws every turn under it; returns the version all of
        them now have. `in_flight`: see `_check_in_flight`."""
        self._check_in_flight(in_flight)
        version = self._to_every_worker("update_lora", named_tensors, lora_name, config)
        self.lora_name = lora_name
        return version

    def _to_every_worker(self, method: str, named_tensors: Iterable[tuple[str, torch.Tensor]], *args: Any) -> int:
        """The tensors put in the object store once, `method` of every live worker called with
        them; the one weight version they all report."""
        ref = ray.put({n: t.detach().contiguous().cpu() for n, t in named_tensors})
        return self._one_version(method, *args, ref)

    def _one_version(self, method: str, *args: Any) -> int:
        """`method(*args)` on every live worker; the one weight version they all report."""
        live = self.live()
        versions = ray.get([getattr(self.workers[i], method).remote(*args) for i in live])
        if len(set(versions)) != 1:
            raise RuntimeError(f"workers disagree on the weight version after {method}: {dict(zip(live, versions))}")
        return versions[0]

    def _check_in_flight(self, in_flight: str) -> None:
        """Updates run between steps: the turns in flight are those of the groups carried into the
        next step (partial rollouts), and they always finish under the weights they began with
        (their later turns sample with the new ones). "abort" is accepted only when nothing is
        carried, where it means the same; with carried groups, drop_carried() them first."""
        if in_flight not in ("abort", "finish"):
            raise ValueError(f"in_flight must be 'abort' or 'finish', got {in_flight!r}")
        if in_flight == "abort" and self._carried:
            raise ValueError(f"in_flight='abort' with {len(self._carried)} group(s) carried into the next step: a Ray rollout "
                             "lets their turns in flight finish; call drop_carried() first to abort them, or pass 'finish'")

    def reload_weights(self, path: str | None = None) -> int:
        """Every live worker's engine reads every weight from a checkpoint directory (the model's
        own by default; a trainer's saved step, on a path each worker can read), so the weights
        need not travel through the object store; returns the version all of them now have.
        As `update_weights` with "finish": turns in flight (of groups carried into the next step)
        finish under the weights they began with."""
        return self._one_version("reload_weights", path)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode on every live worker's engine (built with enable_sleep_mode=True), for
        a trainer colocated with the workers: the KV caches' memory (level 2: the weights' too,
        which `update_weights` must then send whole) given back until `wake_up`. Between steps
        only: refused while groups are carried into the next step (their turns hold KV)."""
        if self._carried:
            raise ValueError(f"{len(self._carried)} group(s) are carried into the next step and hold KV: run them out "
                             "or drop_carried() before sleep")
        ray.get([self.workers[i].sleep.remote(level) for i in self.live()])

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Every live worker's `wake_up(tags)`: all, or "weights" / "kv_cache" (vLLM's RL order:
        weights, `update_weights`, then the KV cache)."""
        ray.get([self.workers[i].wake_up.remote(list(tags) if tags is not None else None) for i in self.live()])

    def is_sleeping(self) -> bool:
        """Whether any live worker's engine sleeps."""
        return any(ray.get([self.workers[i].is_sleeping.remote() for i in self.live()]))

    def stats(self) -> list[dict[str, Any]]:
        return ray.get([self.workers[i].stats.remote() for i in self.live()])

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers, self.dead = [], set()
