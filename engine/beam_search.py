"""Beam search, vLLM's: `LLM.beam_search(prompts, BeamSearchParams(...))` offline and
`use_beam_search` on /v1/completions.

Owns the search itself (which beams live, which are complete, their scores and the final order),
as a state machine a driver feeds: `BeamSearch.pending()` lists the token lists to extend this
step, the driver asks the engine for each one's next-token log-probabilities (one token, greedy,
`logprobs = 2 * beam_width`), and `advance()` takes them. Both drivers, offline
(`LLM.beam_search`) and the server's (`server/beam_completions.py`), keep every beam's KV: each
beam is an engine session (engine/session.py) whose turn gives its candidates, and a kept
candidate forks its parent's session with the sampled token replaced by its own
(`LLMEngine.fork_beams`, from `origins`), so a step computes one token a beam. Where the server's
session limits leave no room it goes on with `run_beam_search_async`: each step one-token
requests over the beams' whole streams, as vLLM's does (the prefix cache serves their full
blocks; the partial last block is computed again).

The rules are vLLM's (its `beam_search` and `get_beam_search_score`), so a drop-in client gets
the same beams:
- each step, every live beam's `2 * beam_width` most likely next tokens are candidates; an EOS
  candidate (any of the model's end ids, unless `ignore_eos`) completes its beam (finish "stop"),
  and the `beam_width` best others by cumulative logprob live on;
- after `max_tokens` steps (or when no beam lives) the complete and the live beams are ranked by
  `cum_logprob / len(tokens) ** length_penalty`, where `tokens` is the prompt and the generated
  tokens, less a final EOS (vLLM counts the prompt too), and the best `beam_width` are returned;
- no early stop: a search runs its `max_tokens` steps while any beam lives.
Log-probabilities are the model's own (greedy rows get no processing), so `temperature` must be
0: vLLM takes a temperature but only uses it to sample one extra candidate at random, which would
make a search that is meant to be deterministic depend on a seed; cuttle refuses it instead.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field

from cuttle.engine.sampler import Logprob

MAX_BEAM_WIDTH = 10  # 2 x width candidates a beam, within the 20 logprobs a request may ask for (vLLM's cap too)


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's fields. `include_stop_str_in_output`: the server's texts keep a final EOS token's
    text (the offline `tokens` always keep it, as vLLM's)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}] (2 x beam_width candidates a step are "
                             f"asked for as logprobs, at most 20), got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature != 0:
            raise ValueError(f"temperature must be 0 for beam search (the search ranks the model's own logprobs; a sampled "
                             f"extra candidate would make it random), got {self.temperature!r}")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or lp != lp or abs(lp) == float("inf"):
            raise ValueError(f"length_penalty must be a finite number, got {lp!r}")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` are the prompt's and the generated ones (vLLM's), `logprobs` one dict
    of candidates per generated token, `text` the whole of `tokens` decoded (offline, as vLLM)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first, at most beam_width


def beam_score(tokens: list[int], cum_logprob: float, eos_ids: Collection[int], length_penalty: float) -> float:
    """vLLM's score: the cumulative logprob over the length (prompt included, a final EOS not)."""
    n = len(tokens) - (1 if tokens and tokens[-1] in eos_ids else 0)
    return cum_logprob / (max(n, 1) ** length_penalty)


class BeamSearch:
    """One prompt's search (see the module docstring for the rules)."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, eos_ids: Collection[int]):
        self.prompt_len = len(prompt_ids)
        self.params = params
        self.eos = frozenset(() if params.ignore_eos else eos_ids)
        self.beams = [BeamSearchSequence(list(prompt_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0
        self.origins: list[tuple[int, int]] = []  # after `advance`: (parent index, token) per live beam

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.params.max_tokens

    def pending(self) -> list[list[int]]:
        """The token lists whose next-token candidates `advance` needs, one per live beam."""
        return [] if self.done else [b.tokens for b in self.beams]

    def advance(self, candidates: list[dict[int, Logprob]]) -> None:
        """Each live beam's candidates (token id -> its logprob), in `pending()`'s order."""
        if len(candidates) != len(self.beams):
            raise ValueError(f"advance needs one candidate dict per live beam ({len(self.beams)}), got {len(candidates)}")
        live: list[tuple[float, int, BeamSearchSequence, dict[int, Logprob]]] = []
        for beam, top in zip(self.beams, candidates):
            for tok, lp in top.items():
                cum = beam.cum_logprob + lp.logprob
                if tok in self.eos:
                    self.completed.append(BeamSearchSequence(beam.tokens + [tok], beam.logprobs + [top], cum, None, "stop", tok))
                else:
                    live.append((cum, tok, beam, top))
        live.sort(key=lambda c: -c[0])  # stable: ties keep the beams' and candidates' order
        kept = live[: self.params.beam_width]
        index = {id(b): i for i, b in enumerate(self.beams)}
        # each new live beam's parent (its index among the beams just extended) and new token: a
        # driver that keeps a beam's KV (engine sessions) forks the parent's
        self.origins = [(index[id(b)], tok) for _, tok, b, _ in kept]
        self.beams = [BeamSearchSequence(b.tokens + [tok], b.logprobs + [top], cum) for cum, tok, b, top in kept]
        self.steps += 1

    def result(self) -> list[BeamSearchSequence]:
        """The best `beam_width` beams, complete or not (those still live end with "length")."""
        for b in self.beams:
            b.finish_reason = "length"
        ranked = sorted(self.completed + self.beams, key=lambda b: -beam_score(b.tokens, b.cum_logprob, self.eos,
                                                                             self.params.length_penalty))
        return ranked[: self.params.beam_width]

    def generated(self, beam: BeamSearchSequence) -> list[int]:
        """The beam's generated tokens, a final EOS left out unless `include_stop_str_in_output`
        (the server's choice text and ids, as vLLM's online search)."""
        out = beam.tokens[self.prompt_len:]
        if out and beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            out = out[:-1]
        return out


async def run_beam_search_async(searches: list[BeamSearch],
                                score: Callable[[list[list[int]]], Awaitable[list[dict[int, Logprob]]]]) -> None:
    """Drive `searches` to the end, one step of all of them at a time: `score(token_lists)` gives
    each list's next-token candidates (2 x beam_width of them), as one-token requests over each
    beam's whole stream (the server's driver; the prefix cache serves the full blocks)."""
    while (flat := _pending(searches)):
        _advance(searches, await score(flat))


def _pending(searches: list[BeamSearch]) -> list[list[int]]:
    return [toks for s in searches for toks in s.pending()]


def _advance(searches: list[BeamSearch], got: list[dict[int, Logprob]]) -> None:
    at = 0
    for s in searches:
        n = len(s.pending())
        if n:
            s.advance(got[at: at + n])
            at += n
