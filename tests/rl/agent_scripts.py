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


def script_logprob(turn: int, i: int) -> float:
    return -0.01 * (i + 1) - turn


class ScriptedSampler:
    """`TokenSampler` over scripts: {key seen in the prompt: [turn text, ...]}."""

    def __init__(self, tok: Tokenizer, scripts: dict[str, list[str]], end_of_turn: int = 2, weight_version: int = 0):
        self.tok, self.scripts, self.end_of_turn, self.weight_version = tok, scripts, end_of_turn, weight_version
        self.eos_token_ids = {0, end_of_turn}
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
            turn = text.count(ASSISTANT) - 1
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


def fix_script(spec: dict[str, Any]) -> list[str]:
    """read -> edit (the injected bug undone) -> run tests -> submit, for a synthetic task."""
    task = make_task(spec)
    m = task.metadata
    path = next(p for p, text in task.files.items() if m["mutant"] in text)
    return [call("read_file", path=path),
            call("edit_file", path=path, old_str=m["mutant"], new_str=m["original"]),
            call("run_tests"),
            call("submit")]


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
