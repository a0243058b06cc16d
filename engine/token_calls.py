"""Tool calls whose markers are special tokens, under grammars: a token-level program the mask
stage (engine/structured_output.py) runs per sample.

xgrammar never writes a special token inside a grammar, so a call layout such as Mistral's
`[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}` (v11 on) or gpt-oss's
`NAME <|constrain|>json<|message|>{...}<|call|>` cannot be one grammar. It is a program instead
(`CallProgram`, built by `structured_output.tool_call_structure`, carried as
`StructuredOutputsParams.tool_calls`): per tool a list of segments, text (a regex) or JSON (the
tool's schema) alternating with special tokens, grammar segment first and last. Each grammar
segment runs as its own xgrammar matcher whose stop token is the special that follows it (the last
one's: the program's `ends`), so the special becomes allowed exactly when the segment may end, and
sampling it moves to the next segment. A sample is either in free text (`auto`: until it writes an
opening token, or a special token followed by an opening text: gpt-oss's `<|channel|>` then
`commentary to=functions.`; a token that runs past such a text hands the rest to the call's
matchers, and a rest no tool's name can start leaves the call unconstrained), in a call (every tool whose segments still accept the tokens so far is alive; the
row allows the union of their next tokens, so the name segment decides the tool), or after a call
(an end token not in `again`: nothing more is constrained, unless `between` names the tokens one
of which must come next: Kimi-K2's `<|tool_calls_section_end|>`, or `<|tool_call_begin|>` and
another call). An end token in `again` opens the next call (parallel calls). States catch up with each sample's output as a grammar matcher does.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# where a sample is in its program
FREE, CALL, AFTER, BETWEEN = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class CallProgram:
    """What `tool_calls` carries (JSON): `calls` per tool a list of segments, each {"regex": r},
    {"json": schema} (with "lead": a regex before it, if any) or {"special": token id}, alternating grammar / special, grammar first and
    last; `opens`: tokens that start a call from free text; `open_texts`: [special token, text]
    pairs that start one too, the text written right after the token; `ends`: tokens that may end a
    call's last segment; `again`: those of them that open another call; `between`: where set, the
    tokens one of which must follow a call's end (those in `opens` start another call)."""

    calls: list[list[dict[str, Any]]]
    ends: list[int]
    opens: list[int] = field(default_factory=list)
    again: list[int] = field(default_factory=list)
    start_in_call: bool = False
    open_texts: list[list[Any]] = field(default_factory=list)
    between: list[int] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"calls": self.calls, "ends": self.ends, "opens": self.opens, "again": self.again,
                           "start_in_call": self.start_in_call, "open_texts": self.open_texts, "between": self.between})

    @classmethod
    def from_json(cls, text: str) -> CallProgram:
        d = json.loads(text)
        prog = cls(d["calls"], list(d["ends"]), list(d.get("opens", [])), list(d.get("again", [])), bool(d.get("start_in_call")),
                   [list(p) for p in d.get("open_texts", [])], list(d.get("between", [])))
        for i, segs in enumerate(prog.calls):
            kinds = ["special" in s for s in segs]
            if not segs or kinds[0] or kinds[-1] or any(kinds[j] == kinds[j + 1] for j in range(len(kinds) - 1)):
                raise ValueError(f"structured_outputs.tool_calls: call {i} must alternate grammar and special segments, "
                                 "a grammar first and last")
        if not prog.ends or not set(prog.again) <= set(prog.ends) or (
                not prog.start_in_call and not prog.opens and not prog.open_texts):
            raise ValueError("structured_outputs.tool_calls needs ends (again among them) and, unless it starts in a call, opens")
        return prog


@dataclass(slots=True)
class CompiledCalls:
    """A program with each grammar segment compiled: per tool, per segment, (compiled grammar or
    None for a special, the stop tokens of its matcher)."""

    program: CallProgram
    steps: list[list[tuple[Any, list[int]]]]


def compile_calls(prog: CallProgram, compile_segment) -> CompiledCalls:
    """`compile_segment(segment dict)`: its compiled xgrammar grammar."""
    steps = []
    for segs in prog.calls:
        out = []
        for j, s in enumerate(segs):
            if "special" in s:
                out.append((None, []))
            else:
                stops = [segs[j + 1]["special"]] if j + 1 < len(segs) else list(prog.ends)
                out.append((compile_segment(s), stops))
        steps.append(out)
    return CompiledCalls(prog, steps)


def _matcher(calls: CompiledCalls, tool: int, seg: int) -> Any:
    import xgrammar as xgr

    grammar, stops = calls.steps[tool][seg]
    return xgr.GrammarMatcher(grammar, override_stop_tokens=stops, max_rollback_tokens=0)


def _fresh(calls: CompiledCalls) -> list[list[Any]]:
    return [[t, 0, _matcher(calls, t, 0)] for t in range(len(calls.steps))]


def _opened_by_text(calls: CompiledCalls, since: list[Any], t: int, text_of) -> list[list[Any]] | None:
    """In free text: `since` is [the last special token, the text written after it]; token `t`
    extends it. The alive tools if an opening text is now complete (the rest of `t`'s text fed to
    them; none alive if no tool's name can start so: [] leaves the call unconstrained), else None."""
    pairs = calls.program.open_texts
    if any(t == p[0] for p in pairs):
        since[:] = [t, ""]
        return None
    if since[0] is None:
        return None
    since[1] += text_of(t)
    for special, opening in pairs:
        if special == since[0] and since[1].startswith(opening):
            rest = since[1][len(opening) :]
            since[:] = [None, ""]
            alive = _fresh(calls)
            return [a for a in alive if not rest or a[2].accept_string(rest)]
    if not any(special == since[0] and opening.startswith(since[1]) for special, opening in pairs):
        since[:] = [None, ""]  # (not an opening: wait for the next special token)
    return None


def fill_calls(calls: CompiledCalls, states: dict[int, list[Any]], key: int, ids: list[int], start: int, end: int,
               bits: np.ndarray, k: int, width: int, text_of=None) -> str | None:
    """Sample `key`'s program (output from `start`) caught up to position `end` of `ids`, and row k
    of `bits` (uint32) narrowed to what it allows next; the reason where the output breaks it.
    `text_of(token)`: its text (for opening texts)."""
    prog = calls.program
    st = states.get(key)
    if st is None:
        st = states[key] = [0, CALL if prog.start_in_call else FREE, _fresh(calls) if prog.start_in_call else [], [None, ""]]
    done, phase, alive, since = st
    for t in ids[start + done : end]:
        if phase == FREE:
            if t in prog.opens:
                phase, alive = CALL, _fresh(calls)
            elif prog.open_texts:
                opened = _opened_by_text(calls, since, t, text_of)
                if opened:
                    phase, alive = CALL, opened
                elif opened is not None:  # a name no tool has: this call runs unconstrained
                    phase = AFTER
        elif phase == BETWEEN:
            if t not in prog.between:
                st[:] = [done, phase, alive, since]
                return f"token {t} at output position {done} is not allowed by the request's tool-call grammar"
            phase, alive = (CALL, _fresh(calls)) if t in prog.opens else (AFTER, [])
        elif phase == CALL:
            kept, finished = [], False
            for tool, seg, m in alive:
                if not m.accept_token(t):
                    continue
                if not m.is_terminated():
                    kept.append([tool, seg, m])
                elif seg + 1 == len(calls.steps[tool]):
                    finished = True
                else:  # the special after this segment: on to the next grammar segment
                    kept.append([tool, seg + 2, _matcher(calls, tool, seg + 2)])
            if finished:
                phase, alive = (CALL, _fresh(calls)) if t in prog.again else (BETWEEN if prog.between else AFTER, [])
            elif kept:
                alive = kept
            else:
                st[:] = [done, phase, alive, since]
                return f"token {t} at output position {done} is not allowed by the request's tool-call grammar"
        done += 1
    st[:] = [done, phase, alive, since]
    if phase == BETWEEN:
        row = np.zeros_like(bits[k])
        for t in prog.between:
            row[t >> 5] |= np.uint32(1) << np.uint32(t & 31)
        bits[k] &= row
    elif phase == CALL:
        masks = torch.zeros((len(alive), width), dtype=torch.int32)
        for i, (_, _, m) in enumerate(alive):
            m.fill_next_token_bitmask(masks, i)
        bits[k] &= np.bitwise_or.reduce(masks.numpy().view(np.uint32), axis=0)
    return None
