"""Token-in / token-out rollouts: GRPO groups and multi-turn trajectory turns.

Owns turning prompts (token ids) into `Group`s of `Sample`s through anything that can generate
tokens: an in-process `LLM`, or `RolloutClient` against `cuttle serve`. A group is one engine
request with `n = group_size`, so its prompt is prefilled once and the samples fork from it
(copy-on-write). Must never tokenize text or re-tokenize outputs: rewards may read `Sample.text`,
training reads token ids only.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from cuttle.engine.llm import LLM
from cuttle.engine.outputs import RequestOutput
from cuttle.engine.sampling_params import SamplingParams
from cuttle.rl.types import Group, Sample, Trajectory


class TokenSampler(Protocol):
    """What a rollout needs from an engine: one list of samples per prompt, `params.n` each."""

    def generate_tokens(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Sample]]: ...


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


def generate_tokens(sampler: LLM | TokenSampler, prompts: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
    if isinstance(sampler, LLM):
        return [samples_of(o) for o in sampler.generate(prompts, params, use_tqdm=False)]
    return sampler.generate_tokens(prompts, params)


def sample_groups(
    sampler: LLM | TokenSampler,
    prompts: list[list[int]],
    group_size: int,
    sampling_params: SamplingParams,
    metadata: list[dict[str, Any]] | None = None,
) -> list[Group]:
    """One `Group` of `group_size` samples per prompt (token ids), in prompt order.

    `metadata[i]` rides along on group i (the task its reward function needs).
    """
    if metadata is not None and len(metadata) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(metadata)} metadata entries")
    params = rollout_params(sampling_params, group_size)
    per_prompt = generate_tokens(sampler, [list(p) for p in prompts], params)
    meta = metadata or [{} for _ in prompts]
    return [Group(list(p), s, dict(m)) for p, s, m in zip(prompts, per_prompt, meta)]


def extend_trajectories(sampler: LLM | TokenSampler, trajectories: list[Trajectory], sampling_params: SamplingParams) -> list[Sample]:
    """Sample one model turn for each trajectory (from its full token stream) and append it.

    The caller then appends tool output / the next user turn with `append_context`; the engine's
    prefix cache makes the repeated history cheap, and nothing is ever re-tokenized.
    """
    params = rollout_params(sampling_params, 1)
    per = generate_tokens(sampler, [t.token_ids for t in trajectories], params)
    turns = [s[0] for s in per]
    for traj, sample in zip(trajectories, turns):
        traj.append_sample(sample)
    return turns
