"""Task sets and scripted policies for the agent GRPO example: tasks the embedded tiny model can
actually earn reward on, graded by the same hidden tests as every sandbox task.

Owns the *guided* task set: a seeded synthetic repository task (`cuttle.sandbox.tasks.synthetic`:
a package with one injected bug, hidden tests over every function) whose short prompt names the
edit that fixes it, as the `edit_file` arguments' JSON (the shortest run of whole words around the
bug that occurs once in its file), so solving it is one `edit_file` call, then `submit`; and its
*narrow* subset (one package, four one-operator bugs), which the example trains on. The reward is
not weakened: the hidden tests run on a fresh copy of the final workspace, and a wrong, partial or
missing edit earns 0. Also owns the scripted fix policy (a `TokenSampler` writing a task's fix
turns in the model's own tool-call format) that makes the warm start's trajectories. Must never
put a hidden test into a prompt or a workspace.
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


def _span(bad: str, good: str, text: str) -> tuple[str, str] | None:
    """The shortest run of whole words of `bad` around its difference from `good` that occurs once
    in `text`, and the same words of `good`: replacing one by the other turns `bad` into `good`."""
    pre = 0
    while pre < min(len(bad), len(good)) and bad[pre] == good[pre]:
        pre += 1
    suf = 0
    while suf < min(len(bad), len(good)) - pre and bad[-1 - suf] == good[-1 - suf]:
        suf += 1
    a, b = pre, len(bad) - suf  # bad[a:b] -> good[a:len(good) - suf]
    while a > 0 and not bad[a - 1].isspace():  # whole words only: a copy never starts mid-word
        a -= 1
    while b < len(bad) and not bad[b].isspace():
        b += 1
    while True:
        old = bad[a:b]
        if old.strip() == old and text.count(old) == 1:
            return old, good[a:len(good) - (len(bad) - b)]
        if b < len(bad):  # grow to the right first, then left, a word (and its space) at a time
            b += 1
            while b < len(bad) and not bad[b].isspace():
                b += 1
        elif a > 0:
            a -= 1
            while a > 0 and not bad[a - 1].isspace():
                a -= 1
        else:
            return None


@functools.cache
def guided_fix(seed: int) -> tuple[Task, str, str, str] | None:
    """(the synthetic task, the buggy file, the shortest unique span of its buggy line around the
    bug, that span fixed); None when the bug is not within one line of its file."""
    task = make_task({"kind": "synthetic", "seed": seed})
    m = task.metadata
    path = next(p for p, text in task.files.items() if m["mutant"] in text)
    bad, good = m["mutant"].splitlines(), m["original"].splitlines()
    diff = [(a, b) for a, b in zip(bad, good) if a != b]
    if len(bad) != len(good) or len(diff) != 1:
        return None
    text = task.files[path]
    span = _span(diff[0][0].strip(), diff[0][1].strip(), text)
    # the one edit must give back the original file exactly
    if span is None or text.replace(span[0], span[1]) != text.replace(m["mutant"], m["original"]):
        return None
    return task, path, *span


def guided_task(seed: int) -> Task:
    """The synthetic task with a short prompt that names the file and the exact edit."""
    fix = guided_fix(seed)
    if fix is None:
        raise ValueError(f"guided task seed {seed}: the synthetic bug is not within one line")
    task, path, bad, good = fix
    # the edit's arguments as the call's JSON writes them, so the call copies one run of the prompt
    prompt = f"Fix the bug with edit_file {json.dumps({'path': path, 'old_str': bad, 'new_str': good})}, then submit."
    return dataclasses.replace(task, task_id=f"guided/{seed}", prompt=prompt)


# The narrow set: one package and four one-operator bugs in two files. The embedded model cannot
# copy strings from its prompt (measured: after a warm start its loss on a copied `old_str` is ~10
# nats/token), so on open-ended guided tasks it earns 0 and GRPO has no signal; here a policy that
# ignores the prompt and writes one of the four fixes earns ~1/4, and one that reads which
# operator the prompt names earns 1.
NARROW_PACKAGE = "odds"
NARROW_EDITS = frozenset({("seqs.py", "//", "%"), ("textx.py", "!=", "=="), ("seqs.py", "-", "+"), ("seqs.py", ">=", ">")})


def narrow(seed: int) -> bool:
    fix = guided_fix(seed)
    if fix is None:
        return False
    package, module = fix[1].split("/")
    return package == NARROW_PACKAGE and (module, fix[2], fix[3]) in NARROW_EDITS


def guided_seeds(start: int, count: int, only_narrow: bool = False) -> list[int]:
    """The first `count` usable seeds from `start` on (of the narrow set with `only_narrow`)."""
    out, s = [], start
    while len(out) < count:
        if (narrow(s) if only_narrow else guided_fix(s) is not None):
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
