"""Scripted policies for the agent-loop tests: a fake sampler that writes fixed turns in the
model's own tool-call format, and fake environments whose tools are instant (or slow, or broken).

The sampler answers like an engine: token ids (the turn's text encoded, then the template's
end-of-turn token), one logprob per token, a weight version. It finds its script by a key it sees
in the prompt's text and its turn by counting the assistant turns already there.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any

from cuttle.engine.sampling_params import SamplingParams
from cuttle.engine.tokenizer import Tokenizer
from cuttle.rl.types import Sample
from cuttle.sandbox.tasks import make_task

ASSISTANT = "<|im_start|>assistant"


def call(name: str, **arguments: Any) -> str:
    """A tool call exactly as the embedded model's template writes one."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def call_in(fmt: str, name: str, **arguments: Any) -> str:
    """A tool call as a model trained on format `fmt` writes it (engine/tool_parsers.py's formats)."""
    args = json.dumps(arguments)
    xml = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in arguments.items())
    return {
        "hermes": call(name, **arguments),
        "qwen3_coder": f"<tool_call>\n<function={name}>\n{xml}</function>\n</tool_call>",
        "seed_oss": f"<seed:tool_call>\n<function={name}>\n{xml}</function>\n</seed:tool_call>",
        "glm45": f"<tool_call>{name}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}"
                                                 f"</arg_value>\n" for k, v in arguments.items()) + "</tool_call>",
        "deepseek_v3": f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```"
                       "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "deepseek_v31": f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "minimax_m2": f'<minimax:tool_call>\n<invoke name="{name}">\n' + "".join(
            f'<parameter name="{k}">{v if isinstance(v, str) else json.dumps(v)}</parameter>\n' for k, v in arguments.items())
            + "</invoke>\n</minimax:tool_call>",
        "mistral": f"[TOOL_CALLS]{name}[ARGS]{args}",
        "llama3_json": f'{{"name": "{name}", "parameters": {args}}}',
        "granite": f'<|tool_call|>[{{"name": "{name}", "arguments": {args}}}]',
        "kimi_k2": f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>{args}"
                   "<|tool_call_end|><|tool_calls_section_end|>",
        # gpt-oss: an analysis message, then the call as a commentary message (its <|call|> is the stop token)
        "openai": f"<|channel|>analysis<|message|>I will call {name}.<|end|><|start|>assistant<|channel|>commentary "
                  f"to=functions.{name} <|constrain|>json<|message|>{args}",
    }[fmt]


def script_logprob(turn: int, i: int) -> float:
    return -0.01 * (i + 1) - turn


class ScriptedSampler:
    """`TokenSampler` over scripts: {key seen in the prompt: [turn text, ...]}."""

    def __init__(self, tok: Tokenizer, scripts: dict[str, list[str]], end_of_turn: int = 2, weight_version: int = 0,
                 eos_token_ids: set[int] | None = None, turn_of=None):
        """`turn_of(prompt text)`: the turn a prompt asks for (default: its assistant turns, ChatML's)."""
        self.tok, self.scripts, self.end_of_turn, self.weight_version = tok, scripts, end_of_turn, weight_version
        self.eos_token_ids = eos_token_ids or {0, end_of_turn}
        self.turn_of = turn_of or (lambda text: text.count(ASSISTANT) - 1)
        self.calls: list[tuple[int, int]] = []  # (number of prompts, n) per generate call
        self.sampled: list[list[int]] = []  # every sample's ids, in order

    def update_weights(self, named_tensors, in_flight: str = "abort") -> int:  # noqa: ANN001
        self.weights = dict(named_tensors)
        self.weight_version += 1
        return self.weight_version

    def generate_tokens(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        self.calls.append((len(prompts), params.n))
        out = []
        for ids in prompts:
            text = self.tok.decode(ids, skip_special_tokens=False)
            turn = self.turn_of(text)
            key = next(k for k in self.scripts if k in text)
            script = self.scripts[key]
            body = script[min(turn, len(script) - 1)]
            tokens = self.tok.encode(body, add_special_tokens=False) + [self.end_of_turn]
            finish = "stop"
            if len(tokens) > params.max_tokens:
                tokens, finish = tokens[: params.max_tokens], "length"
            lps = [script_logprob(turn, i) for i in range(len(tokens))]
            self.sampled += [list(tokens)] * params.n
            out.append([Sample(list(tokens), list(lps), finish, self.weight_version, text=body) for _ in range(params.n)])
        return out


def fix_script(spec: dict[str, Any], fmt: str = "hermes") -> list[str]:
    """read -> edit (the injected bug undone) -> run tests -> submit, for a synthetic task, the
    calls in tool-call format `fmt`."""
    task = make_task(spec)
    m = task.metadata
    path = next(p for p, text in task.files.items() if m["mutant"] in text)
    return [call_in(fmt, "read_file", path=path),
            call_in(fmt, "edit_file", path=path, old_str=m["mutant"], new_str=m["original"]),
            call_in(fmt, "run_tests"),
            call_in(fmt, "submit")]


class FakeEnvironment:
    """Instant tools: `call` echoes its arguments (after `delay` seconds); reward from `reward_of`."""

    def __init__(self, spec: dict[str, Any], delay: float = 0.0, log: list | None = None):
        self.spec, self.delay, self.log = spec, delay, log
        self.task_id = f"fake/{spec.get('seed', 0)}"
        self.prompt = f"Task {self.task_id}: {spec.get('prompt', 'do the thing')}"
        self.closed = False
        self.lock = threading.Lock()

    def call(self, name: str, arguments: dict[str, Any]) -> tuple[bool, str]:
        start = time.monotonic()
        if self.delay:
            time.sleep(self.delay)
        if self.log is not None:
            with self.lock:
                self.log.append((name, start, time.monotonic()))
        if name == "fail":
            return False, "fail: this tool always fails"
        if name == "huge":
            return True, "x" * 10_000
        return True, f"{name} ok {json.dumps(arguments, sort_keys=True)}"

    def reward(self) -> tuple[float, dict[str, Any]]:
        return float(self.spec.get("reward", 1.0)), {}

    def close(self) -> None:
        self.closed = True
