"""SamplingParams: how one request is sampled, validated on construction.

Owns the meaning and the allowed range of every sampling knob. An invalid value raises
`ValueError` naming the field and its range, so callers (the offline API, the server) can
return it to the user verbatim.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a streamed request carries (vLLM's enum of the same name)."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # one output, when the request finishes



@dataclass(slots=True)
class StructuredOutputsParams:
    """A constraint on the output, vLLM's offline shape: exactly one of `json` (a JSON schema, as a
    dict or its JSON text), `regex`, `choice` (the output is one of these strings), `grammar`
    (EBNF, GBNF-style), `json_object` (any JSON object), `structural_tag` (xgrammar's structural
    tag JSON, which the server builds for tool calls) or cuttle's `tool_calls` (a
    `token_calls.CallProgram` as JSON: tool calls whose markers are special tokens, which the server
    builds too). `disable_any_whitespace` is accepted for
    vLLM's sake: cuttle's JSON never has free whitespace (engine/structured_output.py says why).
    Compiled by engine/structured_output.py; only the shape is checked here."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    tool_calls: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag", "tool_calls")
                 if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, json_object, "
                             f"structural_tag, tool_calls; got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its JSON text), got {type(self.json).__name__}")
        for k in ("regex", "grammar", "structural_tag", "tool_calls"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{k} must be a non-empty string")
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        if self.json_object not in (None, True, False) or not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.json_object and .disable_any_whitespace must be booleans")

    @property
    def kind(self) -> str:
        # (not truthiness: json={} is the schema every JSON value meets)
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag", "tool_calls")
                    if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """What the compiled grammar depends on (the compile cache's key)."""
        v = getattr(self, self.kind)
        return self.kind, v if isinstance(v, str) else json.dumps(v)  # key order matters: properties come out in it


MAX_STOP_STRINGS = 1024  # OpenAI takes 4; vLLM has no limit

# temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by less overflows
GREEDY_BELOW = 1e-5


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-N per generated token (the sampled token is always included)
    prompt_logprobs: int | None = None  # top-N per prompt token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (vLLM's; -1: as many as max_model_len allows)
    # the token-level controls (engine/structured_output.py applies them in one mask stage)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # a word's last token is banned once the rest has been generated
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: at most this many tokens inside the (first) thinking block; then its closing tag is
    # forced (engine/structured_output.py, "Thinking budget")
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # a list (or tuple) as vLLM takes; anything else (an int, a dict whose keys would pass as
        # strings) is refused by name, not iterated
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {type(self.stop_token_ids).__name__}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):  # "false" is truthy: it would mean the opposite
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.top_k == 0:
            self.top_k = -1
        _check_int("n", self.n, lo=1, hi=1024)
        _check_float("temperature", self.temperature, lo=0.0, hi=100.0)
        if self.temperature < GREEDY_BELOW:  # logits / 1e-39 overflow to inf and sample garbage: greedy, as vLLM
            self.temperature = 0.0
        _check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_int("top_k", self.top_k, lo=-1, hi=2**31 - 1)
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=-(2**63), hi=2**63 - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1, hi=2**31 - 1)
        _check_int("min_tokens", self.min_tokens, lo=0, hi=2**31 - 1)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0, hi=10.0, lo_open=True)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=20)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=20)
        if len(self.stop) > MAX_STOP_STRINGS:
            # each is scanned for on the engine thread at every token: a huge list slows every request
            raise ValueError(f"stop holds {len(self.stop)} strings; the limit is {MAX_STOP_STRINGS}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids[]", t, lo=0, hi=2**31 - 1)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 (as many as max_model_len allows) or an integer >= 1, got {t!r}")
        self._check_controls()

    def _check_controls(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must be a mapping of token id -> bias")
            # JSON object keys are strings: "50256" is token 50256 (OpenAI's wire form)
            bias: dict[int, float] = {}
            for k, v in self.logit_bias.items():
                ds = k.strip().lstrip("-") if isinstance(k, str) else ""
                tid = int(k) if ds.isascii() and ds.isdigit() else k
                _check_int("logit_bias key", tid, lo=0, hi=2**31 - 1)
                _check_float(f"logit_bias[{tid}]", v, lo=-100.0, hi=100.0)
                bias[tid] = float(v)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids[]", t, lo=0, hi=2**31 - 1)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError("bad_words must be a list of non-blank strings")
            self.bad_words = self.bad_words or None
        if self.thinking_token_budget is not None:
            _check_int("thinking_token_budget", self.thinking_token_budget, lo=0, hi=2**31 - 1)
        so = self.structured_outputs
        if so is not None:
            if self.thinking_token_budget is not None:
                # the grammar reads the whole output, thinking included: the forced closing tag would break it
                raise ValueError("thinking_token_budget cannot be combined with structured_outputs: the grammar covers the "
                                 "whole output, thinking included")
            if not isinstance(so, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}")
            # the grammar decides where the output ends (its stop token); these would fight it
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with structured_outputs: the grammar ends the output with EOS")
            if self.min_tokens:
                raise ValueError("min_tokens cannot be combined with structured_outputs: the grammar decides when the output ends")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_controls(self) -> bool:
        """Any of logit_bias, allowed_token_ids, bad_words, structured_outputs, thinking_token_budget set."""
        return (self.logit_bias is not None or self.allowed_token_ids is not None or self.bad_words is not None
                or self.structured_outputs is not None or self.thinking_token_budget is not None)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")


def _check_float(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number in {'(' if lo_open else '['}{lo}, {hi}], got {value!r}")
    if (value <= lo if lo_open else value < lo) or value > hi:
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}")
