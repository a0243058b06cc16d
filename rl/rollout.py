"""Token-in / token-out rollouts: GRPO groups and multi-turn trajectory turns.

Owns turning prompts into `Group`s of `Sample`s through anything that can generate tokens: an
in-process `LLM`, or `RolloutClient` against `cuttle serve`. A group is one engine request with
`n = group_size`, so its prompt is prefilled once and the samples fork from it (copy-on-write).
Must never re-tokenize outputs: rewards may read `Sample.text`, training reads token ids only.

A prompt is token ids, text, or a squid dict `{"prefix"?, "documents", "prompt"}`
(engine/squid.py). Text is encoded once, here, with the engine's own tokenizer, and from then on
only ids travel: the engine receives the ids, and the group records them (`Group.layout`, the
query in `prompt_token_ids`) with the engine's position convention. All groups of a call go to
the engine together, so every document is computed once per batch, however many groups and
samples use it, in whatever order.
"""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any, Protocol

from cuttle.engine.llm import LLM
from cuttle.engine.lora import LoRARequest
from cuttle.engine.outputs import RequestOutput
from cuttle.engine.sampling_params import SamplingParams
from cuttle.engine.squid import SquidLayout, parse_prompt
from cuttle.rl.types import Group, Sample, Trajectory

# token ids, text, or {"prefix"?: text | ids, "documents": [text | ids, ...], "prompt": text | ids}
RolloutPrompt = list[int] | str | dict[str, Any]


class TokenSampler(Protocol):
    """What a rollout needs from an engine: one list of samples per prompt, `params.n` each.

    Prompts are token ids, or dicts of token ids `{"prefix", "documents", "prompt"}` for a
    sampler that serves squid documents; such a sampler also has `squid_positions` ("shared" or
    "concat"), the convention it places documents with."""

    def generate_tokens(self, prompts: list[list[int] | dict[str, Any]], params: SamplingParams) -> list[list[Sample]]: ...


MAX_ABORTED_RETRIES = 3  # times sample_groups samples a group again after a weight update aborted it


def rollout_params(params: SamplingParams, n: int) -> SamplingParams:
    """`params` with `n` samples and the sampled token's logprob always returned."""
    return dataclasses.replace(params, n=n, logprobs=0 if params.logprobs is None else params.logprobs)


def samples_of(out: RequestOutput) -> list[Sample]:
    version = int(out.metrics["weight_version"])
    samples = []
    for c in out.outputs:
        lps = [d[t].logprob for d, t in zip(c.logprobs or [], c.token_ids)]
        samples.append(Sample(list(c.token_ids), lps, c.finish_reason, version, text=c.text))
    return samples


def generate_tokens(sampler: LLM | TokenSampler, prompts: list[list[int] | dict[str, Any]],
                    params: SamplingParams | list[SamplingParams], lora_request: LoRARequest | None = None) -> list[list[Sample]]:
    """`params`: one for every prompt, or a list of one per prompt (per-episode seeds). A sampler
    that does not declare `accepts_param_lists` gets one call per distinct parameters.
    `lora_request`: the adapter an in-process `LLM` samples under (other samplers hold their own)."""
    if isinstance(sampler, LLM):
        return [samples_of(o) for o in sampler.generate(prompts, params, use_tqdm=False, lora_request=lora_request)]
    if lora_request is not None:
        raise ValueError(f"lora_request is for an in-process LLM; a {type(sampler).__name__} samples under its own lora_name")
    if isinstance(params, SamplingParams):
        return sampler.generate_tokens(prompts, params)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling_params")
    if getattr(sampler, "accepts_param_lists", False):
        return sampler.generate_tokens(prompts, params)
    out: list[list[Sample]] = [[] for _ in prompts]
    for first, idx in by_params(params).items():
        for i, samples in zip(idx, sampler.generate_tokens([prompts[i] for i in idx], params[first])):
            out[i] = samples
    return out


def by_params(params: list[SamplingParams]) -> dict[int, list[int]]:
    """The positions of `params` grouped by equal parameters: {first position: positions}, in order."""
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(next((j for j in groups if params[j] == p), i), []).append(i)
    return groups


def episode_seed(seed: int | None, *keys: int) -> int | None:
    """A seed of its own for one member of a batch (a turn of one episode, one trajectory): with one
    seed for every request of a batch, each request's sampler draws the same uniforms (the
    engine's per-request seed, as vLLM's), so members in the same state wrote the same turn and the
    others were perfectly correlated. None stays None (unseeded)."""
    if seed is None:
        return None
    mask = 2**64 - 1
    h = seed & mask
    for k in keys:  # splitmix64 steps: every bit of every key reaches every bit of the result
        h = (h + 0x9E3779B97F4A7C15 + (k & mask)) & mask
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & mask
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & mask
        h ^= h >> 31
    return h >> 1  # within SamplingParams' signed 64-bit range


def squid_positions(sampler: LLM | TokenSampler) -> str:
    """The position convention `sampler` places documents with; refused if it serves none."""
    if isinstance(sampler, LLM):
        return sampler.engine.squid_positions
    conv = getattr(sampler, "squid_positions", None)
    if conv is None:
        raise ValueError(f"prompts with documents need a sampler that serves them; {type(sampler).__name__} does not "
                         "(it has no squid_positions)")
    return conv


def _check_ids(ids: list[int], field: str) -> None:
    # the engine checks the vocabulary range again when the ids arrive; this names the field early
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or t < 0), None)
    if bad is not None:
        raise ValueError(f"{field} token ids must be non-negative integers, got {bad!r}")


def _encoder(sampler: LLM | TokenSampler) -> Callable[[str, bool], list[int]]:
    if isinstance(sampler, LLM):
        return sampler.get_tokenizer().encode  # the very function the engine encodes text with

    def refuse(text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError(f"{type(sampler).__name__} has no tokenizer: give prompts (and a prompt dict's fields) as token ids")
    return refuse


def resolve_prompt(sampler: LLM | TokenSampler, prompt: RolloutPrompt) -> tuple[list[int], SquidLayout | None]:
    """A rollout prompt -> (query ids, layout or None), every field as token ids. Errors name the field."""
    if isinstance(prompt, str):
        return _encoder(sampler)(prompt), None
    if not isinstance(prompt, dict):
        return list(prompt), None
    convention = squid_positions(sampler)
    # the sampler's engine applies its own document limit when the prompt arrives
    max_documents = sampler.engine.config.max_documents if isinstance(sampler, LLM) else sys.maxsize
    layout, query, _ = parse_prompt(prompt, _encoder(sampler), _check_ids, convention, max_documents)
    if not query:
        raise ValueError("prompt (the query after the documents) must not be empty")
    return query, layout


def _engine_prompt(query: list[int], layout: SquidLayout | None) -> list[int] | dict[str, Any]:
    if layout is None:
        return query
    return {"prefix": layout.prefix, "documents": layout.documents, "prompt": query}


def sample_groups(
    sampler: LLM | TokenSampler,
    prompts: list[RolloutPrompt],
    group_size: int,
    sampling_params: SamplingParams,
    metadata: list[dict[str, Any]] | None = None,
) -> list[Group]:
    """One `Group` of `group_size` samples per prompt (token ids, text or a squid dict), in prompt order.

    `metadata[i]` rides along on group i (the task its reward function needs).
    """
    if metadata is not None and len(metadata) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(metadata)} metadata entries")
    resolved = [resolve_prompt(sampler, p) for p in prompts]
    keep = sampling_params.truncate_prompt_tokens
    if keep is not None:
        # applied here, so the group records the prompt the engine samples from: the trainer scores
        # exactly those ids (the engine used to cut the prompt while the group kept all of it)
        if keep == -1 or any(lay is not None for _, lay in resolved):
            raise ValueError("truncate_prompt_tokens in a rollout must be a count >= 1, and prompts with documents "
                             "cannot be truncated")
        resolved = [(q[-keep:], lay) for q, lay in resolved]
        sampling_params = dataclasses.replace(sampling_params, truncate_prompt_tokens=None)
    params = rollout_params(sampling_params, group_size)
    engine_prompts = [_engine_prompt(q, lay) for q, lay in resolved]
    per_prompt = generate_tokens(sampler, engine_prompts, params)
    # a weight update with in_flight="abort" (a trainer pushing while a served engine samples) ends
    # requests with finish_reason "abort": such a group was returned half sampled and trained on.
    # It is sampled again, whole, under the new weights (a group never mixes versions)
    for _ in range(MAX_ABORTED_RETRIES):
        redo = [i for i, ss in enumerate(per_prompt) if any(s.finish_reason == "abort" for s in ss)]
        if not redo:
            break
        for i, ss in zip(redo, generate_tokens(sampler, [engine_prompts[i] for i in redo], params)):
            per_prompt[i] = ss
    else:
        if any(s.finish_reason == "abort" for ss in per_prompt for s in ss):
            raise RuntimeError(f"groups were aborted (by weight updates) {MAX_ABORTED_RETRIES + 1} times in a row")
    meta = metadata or [{} for _ in prompts]
    return [Group(q, s, dict(m), lay) for (q, lay), s, m in zip(resolved, per_prompt, meta)]


def extend_trajectories(sampler: LLM | TokenSampler, trajectories: list[Trajectory], sampling_params: SamplingParams) -> list[Sample]:
    """Sample one model turn for each trajectory (from its full token stream) and append it.

    The caller then appends tool output / the next user turn with `append_context`; the engine's
    prefix cache makes the repeated history cheap (and a trajectory's documents stay cached), and
    nothing is ever re-tokenized.
    """
    for i, t in enumerate(trajectories):
        if t.layout is not None and t.layout.convention != squid_positions(sampler):
            raise ValueError(f"trajectories[{i}].layout was sampled with {t.layout.convention!r} positions; "
                             f"this sampler uses {squid_positions(sampler)!r}")
    if sampling_params.truncate_prompt_tokens is not None:
        raise ValueError("truncate_prompt_tokens cannot be used to extend trajectories: the turn must read the whole stream")
    params = rollout_params(sampling_params, 1)
    # one seed per trajectory (with one, every trajectory drew the same uniforms: G copies of a
    # prompt came out identical)
    each = [dataclasses.replace(params, seed=episode_seed(params.seed, i)) for i in range(len(trajectories))]
    per = generate_tokens(sampler, [_engine_prompt(t.token_ids, t.layout) for t in trajectories], each)
    turns = [s[0] for s in per]
    for traj, sample in zip(trajectories, turns):
        traj.append_sample(sample)
    return turns
