"""Task sets and scripted policies for the agent GRPO example: tasks the embedded tiny model can
actually earn reward on, graded by the same hidden tests as every sandbox task.

Owns the *guided* task set: a seeded synthetic repository task (`cuttle.sandbox.tasks.synthetic`:
a package with one injected bug, hidden tests over every function) whose prompt also names the
file and the exact line to change, so solving it is one `edit_file` call that copies the prompt's
strings, then `submit`. The reward is not weakened: the hidden tests run on a fresh copy of the
final workspace, and a wrong, partial or missing edit earns 0. Also owns the scripted fix policy
(a `TokenSampler` writing a task's fix turns in the model's own tool-call format) that makes the
warm start's trajectories. Must never put a hidden test into a prompt or a workspace.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from cuttle.engine.sampling_params import SamplingParams
from cuttle.engine.tokenizer import Tokenizer
from cuttle.rl.environment import SandboxEnvironment
from cuttle.rl.types import Sample
from cuttle.sandbox.tasks import Task, make_task


def tool_call(name: str, **arguments: Any) -> str:
    """A call exactly as the embedded model's chat template writes one."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


@functools.cache
def guided_fix(seed: int) -> tuple[Task, str, str, str] | None:
    """(the synthetic task, the buggy file, its buggy line, the fixed line); None when the bug is
    not one line that occurs once in its file (then one edit cannot name it)."""
    task = make_task({"kind": "synthetic", "seed": seed})
    m = task.metadata
    path = next(p for p, text in task.files.items() if m["mutant"] in text)
    bad, good = m["mutant"].splitlines(), m["original"].splitlines()
    diff = [(a, b) for a, b in zip(bad, good) if a != b]
    if len(bad) != len(good) or len(diff) != 1 or task.files[path].count(diff[0][0]) != 1:
        return None
    return task, path, diff[0][0].strip(), diff[0][1].strip()


def guided_task(seed: int) -> Task:
    fix = guided_fix(seed)
    if fix is None:
        raise ValueError(f"guided task seed {seed}: the synthetic bug is not one unique line")
    task, path, bad, good = fix
    prompt = f"{task.prompt} The bug is in {path}: replace `{bad}` with `{good}`, then submit."
    return dataclasses.replace(task, task_id=f"guided/{seed}", prompt=prompt)


def guided_seeds(start: int, count: int) -> list[int]:
    """The first `count` usable seeds from `start` on."""
    out, s = [], start
    while len(out) < count:
        if guided_fix(s) is not None:
            out.append(s)
        s += 1
    return out


def guided_env(spec: dict[str, Any]) -> SandboxEnvironment:
    """Environment factory: {"kind": "guided", "seed": s}; any other spec is a sandbox task spec."""
    return SandboxEnvironment(guided_task(int(spec["seed"])) if spec.get("kind") == "guided" else spec)


def fix_turns(seed: int) -> list[str]:
    """The guided task's solution as the model's turns: the edit, then submit."""
    _, path, bad, good = guided_fix(seed)
    return [tool_call("edit_file", path=path, old_str=bad, new_str=good), tool_call("submit")]


class ScriptedFix:
    """A `TokenSampler` that writes `fix_turns` for the guided task it finds in the prompt (turn i
    of an episode = the i-th assistant turn), ending each turn with the template's end-of-turn
    token; logprobs 0 (nothing trains on its logprobs: the warm start is supervised)."""

    def __init__(self, tok: Tokenizer, seeds: list[int]):
        self.tok = tok
        self.end_of_turn = tok.encode("<|im_end|>", add_special_tokens=False)[0]
        self.by_prompt = {guided_task(s).prompt: s for s in seeds}

    def generate_tokens(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        out = []
        for ids in prompts:
            text = self.tok.decode(ids, skip_special_tokens=False)
            seed = next(s for p, s in self.by_prompt.items() if p in text)
            turns = fix_turns(seed)
            body = turns[min(text.count("<|im_start|>assistant") - 1, len(turns) - 1)]
            tokens = self.tok.encode(body, add_special_tokens=False) + [self.end_of_turn]
            out.append([Sample(list(tokens), [0.0] * len(tokens), "stop", 0, text=body) for _ in range(params.n)])
        return out
