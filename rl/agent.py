"""The agent loop for RL: multi-turn coding episodes with the product's own chat template, tool
parser and tools, token-in / token-out.

Owns one episode's life: an environment started from a task spec, the chat (system prompt with
the tool schemas offered: every agent tool, or the subset `AgentConfig.tools` names; the task,
then turns), each turn sampled from the full token stream, its tool
calls parsed with the server's parser (`engine/tool_parsers.py`, the format the template teaches)
and run concurrently against the sandboxed environment, their results appended through the
template (`rl/chat.py`: deltas only, never re-tokenizing), until the model answers without a tool
call, calls `submit`, or hits a limit (turns, tokens, context, wall clock); then the reward from
the hidden tests on a fresh copy of the final workspace. All episodes of a call advance turn by
turn together: a turn of every live episode is one batch for the engine (at the first turn each
group is one request with `n` = its live members, so its prompt is prefilled once). On an
in-process `LLM` each episode holds an engine session (engine/session.py) from its first turn to
its end: the group's members fork one session over the shared prompt, and a later turn computes
only the ids appended since (tool results, template glue) plus the last sampled token, its history
pinned in the KV pool across the tool calls. Other samplers (HTTP, Ray's locked sampler, scripted
policies) send the whole stream each turn and rely on the prefix cache.

Stragglers: `step` returns once `groups_needed` groups are complete. The other groups are either
aborted (over-sampling: environments closed, nothing kept) or, with `partial=True`, carried into
the next `step` as they are (partial rollouts): their environments stay open, a tool call they
are waiting on keeps running in the pool meanwhile, and their next turns are sampled with
whatever weights the sampler has then, so one trajectory's tokens may carry several weight
versions (each token keeps its own in `Trajectory.weight_versions`, with its behaviour logprob).
With `AgentConfig.turn_wait_s` set, a batch does not wait for every tool call of a turn: the
episodes whose calls are back after that long go on without the slow ones.

Bad input never stops a batch: a malformed tool call, an unknown tool or bad arguments become a
tool error message the model reads next turn; an environment that cannot start fails only its
episode (`finish="env_error"`, the reason in `error`). Must never run model output outside the
environment, and never train on a token the model did not sample (loss mask 1 on sampled ids only).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from cuttle.engine.llm import LLM
from cuttle.engine.lora import LoRARequest
from cuttle.engine.sampling_params import SamplingParams
from cuttle.engine.tokenizer import Tokenizer
from cuttle.engine.harmony import split_harmony
from cuttle.engine.tool_parsers import ToolCall, parser_for_template, split_tool_calls
from cuttle.rl.advantages import group_advantages
from cuttle.rl.batch import TrainBatch
from cuttle.rl.chat import ChatState, ChatTokens, TemplateNotAppendOnly
from cuttle.rl.harmony_chat import HarmonyChatTokens
from cuttle.rl.environment import AgentEnvironment, EnvFactory
from cuttle.rl.rollout import TokenSampler, episode_seed, generate_tokens, samples_of
from cuttle.rl.types import Sample, Trajectory
from cuttle.sandbox.tools import SUBMIT, agent_tool_schemas

log = logging.getLogger("cuttle.rl")

SYSTEM_PROMPT = ("You are a coding agent working in a Python repository mounted at /workspace. Use the tools to read, "
                 "search, edit and test the code. When the task is done, call submit.")

# finishes caused by a limit: the trajectory was cut, its last turns are not the model's choice
LIMIT_FINISHES = ("max_turns", "max_tokens", "context", "wall_clock")
# the episode produced nothing to train on or grade
FAILED_FINISHES = ("env_error", "aborted")


@dataclass(slots=True)
class AgentConfig:
    max_turns: int = 8  # model turns per episode
    max_tokens_per_turn: int = 256
    max_total_tokens: int = 4096  # the whole stream: prompt, turns, tool results
    max_tool_output_chars: int = 4000  # a tool's text beyond this keeps its head and tail
    max_wall_seconds: float = 600.0  # per episode, from its environment's start; checked between turns
    max_parallel_calls: int = 8  # tool calls (and environment starts, gradings) running at once
    system_prompt: str = SYSTEM_PROMPT
    parser: str | None = None  # tool-call format; None: the one the chat template teaches
    # None: every turn waits for all tool calls of the batch (lockstep). A number: after that many
    # seconds the episodes whose calls are back are sampled again without the slow ones.
    turn_wait_s: float | None = None
    # keep each episode's KV pinned in an engine session between turns (in-process LLM only)
    use_sessions: bool = True
    # the tools offered (names from `agent_tool_schemas()`; the system prompt lists them in that
    # order); None: all of them. A call of a tool not offered is an "unknown tool" error message for
    # the model, and `submit` ends an episode only when it is offered. Fewer schemas, shorter prompts.
    tools: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.tools is not None:
            offered_tools(self.tools)  # refuses unknown, repeated or no names


def offered_tools(names: tuple[str, ...] | list[str] | None) -> list[dict[str, Any]]:
    """The schemas of the named agent tools (`None`: every one), in `agent_tool_schemas()` order."""
    schemas = agent_tool_schemas()
    if names is None:
        return schemas
    known = [s["function"]["name"] for s in schemas]
    if isinstance(names, str) or not names:
        raise ValueError(f"AgentConfig.tools must be a non-empty sequence of tool names from {', '.join(known)}; got {names!r}")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"AgentConfig.tools: unknown tool(s) {', '.join(map(repr, unknown))}; available: {', '.join(known)}")
    if len(set(names)) != len(names):
        raise ValueError(f"AgentConfig.tools: a tool is named twice in {list(names)!r}")
    return [s for s in schemas if s["function"]["name"] in names]


@dataclass(slots=True)
class ToolResult:
    name: str
    ok: bool
    content: str  # exactly what the tool message shows the model
    seconds: float


@dataclass(slots=True)
class AgentTurn:
    text: str  # the model's exact text of the turn (its end-of-turn token excluded)
    calls: list[ToolCall]  # parsed, each with its exact block in `.text`
    malformed: list[str]  # blocks that open a call but do not parse, verbatim
    results: list[ToolResult] = field(default_factory=list)  # one per block, in the order the model wrote them
    content: str = ""  # the text outside the calls, as the server returns it (tool_parsers' parse in the episode's format)
    # the text the calls were parsed from, where it is not `text`: a harmony turn's messages as the
    # `openai` format reads them (engine/harmony.py), its analysis left out
    parsed: str = ""


@dataclass(slots=True)
class PendingTurn:
    """A sampled turn whose tool calls are still running (the episode waits on them)."""

    sample: Sample
    turn: AgentTurn
    jobs: list[tuple[int, Future]]  # (index into turn.results, the running call)
    continues: bool  # False for a submitting turn: its calls still run, nothing is appended after it

    def ready(self) -> bool:
        return all(f.done() for _, f in self.jobs)


@dataclass(slots=True)
class Episode:
    spec: dict[str, Any]  # the task spec the environment was made from
    group: int  # index of its group in the call
    trajectory: Trajectory | None = None  # None when the environment never started
    chat: ChatState | None = None
    turns: list[AgentTurn] = field(default_factory=list)
    finish: str | None = None  # answered | submitted | end_of_text | template | one of LIMIT/FAILED_FINISHES
    error: str | None = None
    reward: float = 0.0
    reward_info: dict[str, Any] = field(default_factory=dict)
    env: AgentEnvironment | None = None
    seconds: float = 0.0  # from the environment's start to the last turn (or the abort)
    started: float = 0.0  # time.monotonic() when the episode started
    pending: PendingTurn | None = None  # never set on an episode handed back to a caller
    session: str | None = None  # its engine session while it runs (in-process LLM)

    @property
    def complete(self) -> bool:
        return self.finish is not None and self.pending is None

    @property
    def truncated(self) -> bool:
        return self.finish in LIMIT_FINISHES

    @property
    def failed(self) -> bool:
        return self.finish in FAILED_FINISHES

    def openai_messages(self) -> list[dict[str, Any]]:
        """The conversation as a `cuttle serve` client holds it: assistant messages with `content`
        (outside the calls) and `tool_calls` as the server returns them. Rendered by the template it
        re-serializes the calls, so it equals the token stream only when the model wrote each call
        the way the template writes it (`messages` of `chat` is the exact view)."""
        if self.chat is None:
            return []
        out, turns = [], iter(self.turns)
        for m in self.chat.messages:
            if m["role"] != "assistant":
                out.append(dict(m))
                continue
            turn = next(turns)  # parsed in the episode's format; its calls' ids are those the tool messages answer
            msg: dict[str, Any] = {"role": "assistant", "content": turn.content or None}
            if turn.calls:
                msg["tool_calls"] = [c.to_openai() for c in turn.calls]
            out.append(msg)
        return out


@dataclass(slots=True)
class AgentGroup:
    spec: dict[str, Any]
    episodes: list[Episode]

    @property
    def rewards(self) -> list[float]:
        return [e.reward for e in self.episodes if not e.failed]

    @property
    def complete(self) -> bool:
        return all(e.complete for e in self.episodes)


@dataclass(slots=True)
class AgentStep:
    groups: list[AgentGroup]  # complete and graded, carried-in groups first
    aborted: list[AgentGroup]  # cut to end the step (over-sampling): failed episodes, not graded
    carried: int  # groups left running into the next step (partial rollouts)
    seconds: float


def _check_agent_params(params: SamplingParams) -> None:
    if params.truncate_prompt_tokens is not None:  # a turn reads the episode's whole stream, which the trainer scores
        raise ValueError("truncate_prompt_tokens cannot be used in agent rollouts: each turn reads the whole episode")


def turn_seed(seed: int | None, turn: int, spec: dict[str, Any], group: int, member: int) -> int | None:
    """The engine seed of one episode's turn (`member` of group `group` of the call, on task
    `spec`; a group's first turn is one request under member 0's), from the rollout's `seed`: the
    same in every process (the spec enters through its JSON's CRC32; str hashes are salted per
    process). None stays None."""
    return episode_seed(seed, turn, zlib.crc32(json.dumps(spec, sort_keys=True, default=str).encode()), group, member)


def clip_output(text: str, limit: int) -> str:
    """At most about `limit` characters: the head and the tail, the middle replaced by a count."""
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - limit} characters truncated ...]\n{text[-tail:]}"


def _arguments(call: ToolCall) -> dict[str, Any] | str:
    try:
        args = json.loads(call.arguments)
    except json.JSONDecodeError as err:
        return f"arguments are not valid JSON ({err.msg})"
    except RecursionError:
        return "arguments are nested too deeply"
    return args if isinstance(args, dict) else "arguments must be a JSON object"


def _ordered_blocks(turn: AgentTurn) -> list[ToolCall | str]:
    """Calls and malformed blocks in the order the model wrote them (one tool message each)."""
    where = turn.parsed or turn.text
    return sorted([*turn.calls, *turn.malformed], key=lambda b: where.find(b.text if isinstance(b, ToolCall) else b))


# what a malformed call is told to look like, in the parser's format
_CALL_SHAPES = {
    "hermes": '<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>",
    "seed_oss": "<seed:tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</seed:tool_call>",
    "glm45": "<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>",
    "deepseek_v3": "<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>",
    "deepseek_v31": "<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>",
    "mistral": '[TOOL_CALLS]NAME[ARGS]{...} (or [TOOL_CALLS][{"name": ..., "arguments": {...}}] where the template writes a list)',
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>"
               "<|tool_calls_section_end|>",
    "granite": '<|tool_call|>[{"name": NAME, "arguments": {...}}]',
    "llama3_json": '{"name": NAME, "parameters": {...}} as the whole reply',
    "minimax_m2": '<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="KEY">VALUE</parameter>\n</invoke>\n</minimax:tool_call>',
    "openai": "<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...} (a JSON object), "
              "then <|call|>",
}


def _placeholder(block: ToolCall | str, submit: str | None, parser: str = "hermes") -> ToolResult:
    if isinstance(block, str):
        return ToolResult("", False, f"Error: malformed tool call; write {_CALL_SHAPES[parser]}. Got: {clip_output(block, 200)}",
                          0.0)
    if block.name == submit:
        return ToolResult(SUBMIT, True, "submitted", 0.0)
    return ToolResult(block.name, False, "", 0.0)


class AgentRollout:
    """Runs groups of agent episodes on one sampler with environments from `env_factory`."""

    def __init__(self, sampler: LLM | TokenSampler, env_factory: EnvFactory, config: AgentConfig | None = None,
                 tokenizer: Tokenizer | None = None, eos_token_ids: set[int] | None = None):
        self.sampler = sampler
        self.env_factory = env_factory
        self.config = config or AgentConfig()
        if isinstance(sampler, LLM):
            tokenizer = tokenizer or sampler.get_tokenizer()
            eos_token_ids = eos_token_ids or sampler.engine.eos_token_ids
        if tokenizer is None or eos_token_ids is None:
            raise ValueError("a sampler other than LLM needs its tokenizer and eos_token_ids")
        self.tok = tokenizer
        self.tools = offered_tools(self.config.tools)
        names = [t["function"]["name"] for t in self.tools]
        # with a subset, a call of another tool is refused here (the environment may well have it);
        # without one, every name goes to the environment, which refuses the ones it does not know
        self.tool_names = None if self.config.tools is None else frozenset(names)
        self.submit = SUBMIT if SUBMIT in names else None  # `submit` ends episodes only when offered
        self.parser = self.config.parser or parser_for_template(tokenizer.chat_template)
        # gpt-oss's harmony turns: appended as sampled, tool results as harmony messages (rl/harmony_chat.py)
        self.chat = (HarmonyChatTokens if self.parser == "openai" else ChatTokens)(tokenizer, self.tools, eos_token_ids)
        self.pool = ThreadPoolExecutor(self.config.max_parallel_calls, thread_name_prefix="cuttle-agent")
        self.llm = sampler if isinstance(sampler, LLM) and self.config.use_sessions else None
        self._lora_name: str | None = None  # on an in-process LLM: the adapter turns run under (update_lora)
        self.carried: list[AgentGroup] = []  # unfinished groups kept for the next `step` (partial rollouts)
        self.env_close_errors = 0  # environments whose close() raised (logged; the episodes keep their results)

    def tool_call_params(self, params: SamplingParams, parallel: bool = True) -> SamplingParams:
        """`params` with the offered tools' calls under their schemas (tool_choice auto: the turn is
        free until the model opens a call in the chat template's format, then the call follows the
        tool-call grammar or token program the server would use, engine/structured_output.py).
        Give the trainer the same params (`TrainerConfig.for_sampler(sampler, these)`) so it scores
        each token under the mask it was drawn with. A ValueError where the format has no grammar
        here (the tokenizer or xgrammar cannot serve it)."""
        from cuttle.engine.structured_output import tool_call_structure

        if params.structured_outputs is not None:
            raise ValueError("tool_call_params: params already carry structured_outputs")
        so = tool_call_structure(self.parser, "auto", None, self.tools, self.tok, parallel, self.tok.chat_template)
        if so is None:
            raise ValueError(f"tool_call_params: the {self.parser} tool-call format has no grammar for auto calls here "
                             "(xgrammar missing, a tokenizer it cannot serve, or markers it cannot write)")
        return dataclasses.replace(params, structured_outputs=so)

    # ---- LoRA training's weight sync (rl/lora.py) --------------------------------------------
    @property
    def lora_name(self) -> str | None:
        """The adapter every turn runs under: the last `update_lora` (None: the base model)."""
        return self._lora_name if isinstance(self.sampler, LLM) else getattr(self.sampler, "lora_name", None)

    def update_lora(self, lora_name: str, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any],
                    in_flight: str = "finish") -> int:
        """A LoRA trainer's push through the rollout (`trainer.push_weights(rollout)`); returns the
        new weight version. On an in-process LLM the adapter is loaded there and every later turn,
        engine sessions included (their pins are dropped: new weights), runs under it; any other
        sampler takes it through its own `update_lora`."""
        if isinstance(self.sampler, LLM):
            version = self.sampler.update_lora(lora_name, named_tensors, config, in_flight)
            self._lora_name = lora_name
            return version
        update = getattr(self.sampler, "update_lora", None)
        if update is None:
            raise ValueError(f"a {type(self.sampler).__name__} sampler takes no LoRA adapter (it has no update_lora)")
        return update(lora_name, named_tensors, config, in_flight)

    def close(self) -> None:
        self.drop_carried()
        # a call abandoned by an abort may still run: its environment is closed, and a sandboxed
        # command dies at its own timeout, so nothing waits for it here
        self.pool.shutdown(wait=False, cancel_futures=True)

    def drop_carried(self) -> list[AgentGroup]:
        """Abort the carried groups and close their environments; returns them."""
        dropped, self.carried = self.carried, []
        self._release(dropped, "aborted", "dropped while carried between steps")
        return dropped

    # ---- one call: groups of episodes ------------------------------------------------------
    def run(self, specs: list[dict[str, Any]], group_size: int, params: SamplingParams,
            should_stop: Callable[[], bool] | None = None) -> list[AgentGroup]:
        """`group_size` episodes per task spec, all advanced together; returns one group per spec.
        `should_stop()` is asked between turns and while tool calls run: True aborts every
        unfinished episode."""
        _check_agent_params(params)
        groups = self._new_groups(specs, group_size)
        try:
            self._start([e for g in groups for e in g.episodes])
            if self._advance(groups, params, should_stop, None) == "stopped":
                self._release(groups, "aborted", "the rollout was stopped", close=False)
            self._grade([e for g in groups for e in g.episodes if not e.failed])
        finally:
            self._close(groups)
        return groups

    def step(self, specs: list[dict[str, Any]], group_size: int, params: SamplingParams,
             groups_needed: int | None = None, partial: bool = False,
             should_stop: Callable[[], bool] | None = None) -> AgentStep:
        """One RL step: the groups carried from the last step (partial rollouts) and a new group per
        spec advance together until `groups_needed` (default: all) are complete. Those are graded
        and returned (every group that completed by then, so possibly more than needed); the others
        are aborted (over-sampling), or with `partial` kept running into the next step."""
        t0 = time.monotonic()
        _check_agent_params(params)
        needed = len(self.carried) + len(specs) if groups_needed is None else groups_needed
        if not 0 < needed <= len(self.carried) + len(specs):
            raise ValueError(f"groups_needed must be in 1..{len(self.carried) + len(specs)}, got {needed}")
        new = self._new_groups(specs, group_size)
        groups, self.carried = self.carried + new, []
        done: list[AgentGroup] = []
        rest: list[AgentGroup] = []
        try:
            self._start([e for g in new for e in g.episodes])
            enough = lambda: sum(g.complete for g in groups) >= needed  # noqa: E731
            reason = self._advance(groups, params, should_stop, enough)
            done = [g for g in groups if g.complete]
            rest = [g for g in groups if not g.complete]
            if partial and reason != "stopped":
                self.carried, rest = rest, []
            self._release(rest, "aborted", "cut to end the step (enough groups were complete)", close=False)
            self._grade([e for g in done for e in g.episodes if not e.failed])
        except BaseException:
            self.carried = []
            self._release(groups, "aborted", "the step failed", close=False)
            raise
        finally:
            kept = set(map(id, self.carried))
            self._close([g for g in groups if id(g) not in kept])
        return AgentStep(done, rest, len(self.carried), time.monotonic() - t0)

    def _new_groups(self, specs: list[dict[str, Any]], group_size: int) -> list[AgentGroup]:
        return [AgentGroup(spec, [Episode(spec, gi) for _ in range(group_size)]) for gi, spec in enumerate(specs)]

    def _release(self, groups: list[AgentGroup], finish: str, error: str, close: bool = True) -> None:
        """End every unfinished episode of `groups` (a running tool call is abandoned: a sandboxed
        command dies at its own timeout) and, with `close`, close their environments."""
        for g in groups:
            for e in g.episodes:
                if not e.complete:
                    if e.pending is not None:
                        for _, f in e.pending.jobs:
                            f.cancel()
                        e.pending = None
                    e.finish, e.error = finish, error
                    e.seconds = time.monotonic() - e.started
        if close:
            self._close(groups)

    def _close(self, groups: list[AgentGroup]) -> None:
        for g in groups:
            for e in g.episodes:
                self._end_session(e)
                env, e.env = e.env, None
                if env is None:
                    continue
                try:
                    env.close()
                except Exception:  # noqa: BLE001 - one cleanup failing (rmtree under a still-running process) lost the
                    # whole batch and left the later environments open; the episode was graded already
                    self.env_close_errors += 1
                    log.exception("closing the environment of task %r failed", e.spec)

    def _end_session(self, e: Episode) -> None:
        if e.session is not None:
            self.llm.close_session(e.session)
            e.session = None

    def _start(self, episodes: list[Episode]) -> None:
        futures = [self.pool.submit(self.env_factory, e.spec) for e in episodes]
        for e, f in zip(episodes, futures):
            e.started = time.monotonic()
            try:
                e.env = f.result()
            except Exception as err:  # noqa: BLE001 - any failure to start fails this episode only
                e.finish, e.error = "env_error", f"environment for task {e.spec!r} could not start: {type(err).__name__}: {err}"
                continue
            messages = [{"role": "system", "content": self.config.system_prompt}, {"role": "user", "content": e.env.prompt}]
            e.chat, ids = self.chat.start(messages)
            e.trajectory = Trajectory.start(ids)

    def _advance(self, groups: list[AgentGroup], params: SamplingParams, should_stop: Callable[[], bool] | None,
                 enough: Callable[[], bool] | None) -> str:
        """Sample every episode that is not waiting on a tool, collect tool results, repeat; returns
        "done" (every episode complete), "enough" or "stopped"."""
        episodes = [e for g in groups for e in g.episodes]
        while True:
            for e in episodes:
                if e.finish is not None:  # its KV is not needed anymore
                    self._end_session(e)
            if all(e.complete for e in episodes):
                return "done"
            if should_stop is not None and should_stop():
                return "stopped"
            if enough is not None and enough():
                return "enough"
            now = time.monotonic()
            ready = [e for e in episodes if e.finish is None and e.pending is None]
            for e in ready:
                if now - e.started > self.config.max_wall_seconds:
                    e.finish = "wall_clock"
            ready = [e for e in ready if e.finish is None]
            if ready:
                self._sample(groups, ready, params)
            self._collect([e for e in episodes if e.pending is not None],
                          lambda: (should_stop is not None and should_stop()) or (enough is not None and enough()))

    def _sample(self, groups: list[AgentGroup], ready: list[Episode], params: SamplingParams) -> None:
        cfg = self.config
        ready_set = set(map(id, ready))
        # requests: (episodes sharing one prompt, prompt ids); a group's first turn is one request
        # with n = its members (its prompt prefilled once, the members fork from it)
        requests: list[list[Episode]] = []
        for g in groups:
            first = [e for e in g.episodes if id(e) in ready_set and not e.turns]
            if first:
                requests.append(first)
            requests += [[e] for e in g.episodes if id(e) in ready_set and e.turns]
        by_shape: dict[tuple[int, int, int], list[list[Episode]]] = {}
        for members in requests:
            ids = members[0].trajectory.token_ids
            room = min(cfg.max_tokens_per_turn, cfg.max_total_tokens - len(ids))
            if room <= 0:
                for e in members:
                    e.finish = "context"
            else:
                by_shape.setdefault((len(members), room, len(members[0].turns)), []).append(members)
        sampled: list[tuple[Episode, Sample]] = []
        member = {id(e): i for g in groups for i, e in enumerate(g.episodes)}
        for (n, room, turn), reqs in by_shape.items():
            p = dataclasses.replace(params, n=n, max_tokens=room, logprobs=0)
            # a seed per request (a group's first turn; then each episode's turns): with one per
            # turn, every episode of the batch drew the same uniforms after the first turn
            each = [dataclasses.replace(p, seed=turn_seed(params.seed, turn, m[0].spec, m[0].group, member[id(m[0])])) for m in reqs]
            outs = self._generate(reqs, each)
            for members, samples in zip(reqs, outs):
                sampled += list(zip(members, samples))
        for e, s in sampled:
            e.trajectory.append_sample(s)
            text, ended = self.chat.turn_text(s.token_ids)
            readable = split_harmony(text)[1] if self.parser == "openai" else text
            parsed = split_tool_calls(readable, self.parser, self.tools)
            t = AgentTurn(text, parsed.calls, parsed.malformed, content=parsed.content, parsed=readable if readable != text else "")
            e.turns.append(t)
            if s.finish_reason == "length":
                finish = "context" if len(e.trajectory.token_ids) >= cfg.max_total_tokens else "max_tokens"
            elif not ended:
                finish = "end_of_text"  # ended by an EOS the template does not close turns with
            elif any(c.name == self.submit for c in t.calls):
                finish = "submitted"
            elif not t.calls and not t.malformed:
                finish = "answered"
            else:
                finish = None
            blocks = _ordered_blocks(t)
            t.results = [_placeholder(b, self.submit, self.parser) for b in blocks]  # calls are filled in when they are back
            jobs = []
            if finish in (None, "submitted"):  # a submitting turn's other calls still change the workspace
                jobs = [(i, self.pool.submit(self._call_tool, e.env, b)) for i, b in enumerate(blocks)
                        if isinstance(b, ToolCall) and b.name != self.submit]
            e.seconds = time.monotonic() - e.started
            if finish is not None:
                e.finish = finish
                self.chat.finish_turn(e.chat, s.token_ids)
            if finish is None or jobs:
                e.pending = PendingTurn(s, t, jobs, continues=finish is None)

    def _generate(self, reqs: list[list[Episode]], each: list[SamplingParams]) -> list[list[Sample]]:
        """One turn for each request (a group's first turn: its members together), `each[i]` the
        parameters of request i. With sessions, each episode's session is opened at its first turn
        (members forked from one) and the turn runs on it; if the engine refuses a session (its
        limits), the batch goes without."""
        lora = LoRARequest(self._lora_name) if isinstance(self.sampler, LLM) and self._lora_name is not None else None
        if self.llm is None:
            return generate_tokens(self.sampler, [m[0].trajectory.token_ids for m in reqs], each, lora)
        llm = self.llm
        try:
            for members in reqs:
                if members[0].session is None:
                    sid = llm.open_session(members[0].trajectory.token_ids, lora)
                    members[0].session = sid
                    for e, fork in zip(members[1:], llm.fork_session(sid, len(members) - 1) if len(members) > 1 else []):
                        e.session = fork
            sids = [e.session for members in reqs for e in members]
            outs = iter(llm.generate_session(sids, [dataclasses.replace(p, n=1) for members, p in zip(reqs, each) for _ in members]))
        except ValueError:
            for members in reqs:
                for e in members:
                    self._end_session(e)
            return generate_tokens(self.sampler, [m[0].trajectory.token_ids for m in reqs], each, lora)
        return [[samples_of(next(outs))[0] for _ in members] for members in reqs]

    def _call_tool(self, env: AgentEnvironment, call: ToolCall) -> ToolResult:
        t0 = time.monotonic()
        args = _arguments(call)
        if self.tool_names is not None and call.name not in self.tool_names:
            ok, text = False, f"unknown tool {call.name!r}; available: {', '.join(sorted(self.tool_names))}"
        elif isinstance(args, str):
            ok, text = False, f"{call.name}: {args}"
        else:
            try:
                ok, text = env.call(call.name, args)
            except Exception as err:  # noqa: BLE001 - a host-side failure is reported to the model, the batch goes on
                ok, text = False, f"{call.name} failed in the environment: {type(err).__name__}: {err}"
        content = clip_output(text, self.config.max_tool_output_chars)
        return ToolResult(call.name, ok, content if ok else f"Error: {content}", time.monotonic() - t0)

    def _collect(self, waiting: list[Episode], interrupt: Callable[[], bool]) -> None:
        """Wait for tool calls (all of them, or with `turn_wait_s` those back within it, at least
        one episode's) and append their results. Returns early when `interrupt()` turns True (the
        step was stopped, or enough groups are complete); the calls keep running (an abort cancels
        them, partial rollouts collect them later)."""
        t0 = time.monotonic()
        wait_s = self.config.turn_wait_s
        while waiting:
            running = {f for e in waiting for _, f in e.pending.jobs if not f.done()}
            if not running:
                break
            if interrupt():
                return
            if wait_s is not None and time.monotonic() - t0 >= wait_s and any(e.pending.ready() for e in waiting):
                break
            wait(running, timeout=0.05, return_when=FIRST_COMPLETED)
        for e in waiting:
            if e.pending.ready():
                self._finish_turn(e)

    def _finish_turn(self, e: Episode) -> None:
        cfg = self.config
        pending, e.pending = e.pending, None
        t = pending.turn
        for i, f in pending.jobs:
            t.results[i] = f.result()
        e.seconds = time.monotonic() - e.started
        if not pending.continues:
            return
        messages = [{"role": "tool", "tool_call_id": getattr(b, "id", f"malformed-{i}"), "name": r.name or "error",
                     "content": r.content} for i, (b, r) in enumerate(zip(_ordered_blocks(t), t.results))]
        try:
            delta = self.chat.append_turn(e.chat, pending.sample.token_ids, messages)
        except TemplateNotAppendOnly as err:
            e.finish, e.error = "template", str(err)
            self.chat.finish_turn(e.chat, pending.sample.token_ids)  # the stream ends with this turn, as sampled
            return
        e.trajectory.append_context(delta)
        if e.session is not None:
            self.llm.append_to_session(e.session, delta)
        if len(e.turns) >= cfg.max_turns:
            e.finish = "max_turns"
        elif len(e.trajectory.token_ids) >= cfg.max_total_tokens:
            e.finish = "context"
        elif time.monotonic() - e.started > cfg.max_wall_seconds:
            e.finish = "wall_clock"

    def _grade(self, episodes: list[Episode]) -> None:
        futures = [self.pool.submit(e.env.reward) for e in episodes]
        for e, f in zip(episodes, futures):
            try:
                e.reward, e.reward_info = f.result()
            except Exception as err:  # noqa: BLE001 - grading broke on the host: no reward to train on
                e.finish, e.error = "env_error", f"grading failed: {type(err).__name__}: {err}"


# ---- from episodes to a training batch -----------------------------------------------------
def agent_batch(groups: list[AgentGroup], scale_by_std: bool, filter_truncated: bool = True,
                pad_id: int = 0) -> tuple[TrainBatch | None, dict[str, int]]:
    """A `TrainBatch` of the groups' episodes with group-relative advantages.

    Failed episodes (no environment, grading broke, aborted) are left out of both the baseline and
    the batch. With `filter_truncated` (compact filtering), episodes cut by a limit still count in
    their group's baseline with the reward their workspace earned, but are left out of the loss.
    Returns (batch or None when nothing is left, counts of what was kept and dropped)."""
    trajs: list[Trajectory] = []
    advs: list[float] = []
    gids: list[int] = []
    counts = {"kept": 0, "filtered": 0, "failed": 0}
    for gi, g in enumerate(groups):
        graded = [e for e in g.episodes if not e.failed]
        counts["failed"] += len(g.episodes) - len(graded)
        for e, a in zip(graded, group_advantages([e.reward for e in graded], scale_by_std)):
            if filter_truncated and e.truncated:
                counts["filtered"] += 1
                continue
            e.trajectory.reward = e.reward
            trajs.append(e.trajectory)
            advs.append(a)
            gids.append(gi)
    counts["kept"] = len(trajs)
    return (TrainBatch.from_trajectories(trajs, advs, gids, pad_id) if trajs else None), counts


def episode_stats(groups: list[AgentGroup]) -> dict[str, float]:
    """Per-call summary: rewards, turns, tool calls by kind, tokens, finishes."""
    eps = [e for g in groups for e in g.episodes]
    done = [e for e in eps if e.trajectory is not None]
    calls = Counter(c.name for e in eps for t in e.turns for c in t.calls)
    stats: dict[str, float] = {
        "episodes": float(len(eps)),
        "reward_mean": sum(e.reward for e in eps if not e.failed) / max(1, sum(not e.failed for e in eps)),
        "turns_mean": sum(len(e.turns) for e in done) / max(1, len(done)),
        "sampled_tokens": float(sum(sum(e.trajectory.loss_mask) for e in done)),
        "stream_tokens": float(sum(len(e.trajectory.token_ids) for e in done)),
        "malformed_calls": float(sum(len(t.malformed) for e in eps for t in e.turns)),
        "tool_seconds": sum(r.seconds for e in eps for t in e.turns for r in t.results),
    }
    stats.update({f"calls_{k}": float(v) for k, v in sorted(calls.items())})
    stats.update({f"finish_{k}": float(v) for k, v in sorted(Counter(e.finish for e in eps).items())})
    return stats
