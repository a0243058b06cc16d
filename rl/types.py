"""The rollout data: `Sample`, `Group` (one prompt's samples) and `Trajectory` (a multi-turn
token stream with a loss mask).

Owns the shapes every other RL module passes around. Token ids are the only representation:
nothing here tokenizes or detokenizes, so what the trainer scores is exactly what the engine
sampled (re-rendering a chat and re-tokenizing it is how multi-turn RL silently drifts).

Squid documents: a group or trajectory sampled from a prompt with documents keeps the engine's
`SquidLayout` (prefix ids, document ids in the order given, position convention) next to its
query ids, so the trainer rebuilds the exact attention the sampler used
(`SquidLayout.dense_mask_and_positions`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cuttle.engine.squid import SquidLayout


@dataclass(slots=True)
class Sample:
    """One completion of a prompt, as the engine produced it."""

    token_ids: list[int]  # generated tokens (EOS included when it ended the sample)
    logprobs: list[float]  # the engine's logprob of each generated token (its sampling distribution)
    finish_reason: str | None  # "stop" | "length" | "abort"
    weight_version: int  # the engine's weight version that produced every one of these tokens
    reward: float = 0.0
    text: str = ""  # the engine's decoding, for reward functions and logs only


@dataclass(slots=True)
class Group:
    """G samples of one prompt: the unit of GRPO's baseline.

    With documents, `prompt_token_ids` is the query (the prompt after the documents) and `layout`
    holds the prefix and the documents before it; without, `layout` is None."""

    prompt_token_ids: list[int]
    samples: list[Sample]
    metadata: dict[str, Any] = field(default_factory=dict)  # the task behind the prompt, for rewards
    layout: SquidLayout | None = None

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


@dataclass(slots=True)
class Trajectory:
    """A token stream grown turn by turn: model turns are trained on, everything else is not.

    `token_ids[i]` is scored by the trainer iff `loss_mask[i]`; `logprobs[i]` is the engine's
    logprob for model tokens and 0.0 elsewhere. `weight_versions[i]` is -1 for tokens the model
    did not sample. Appending never re-tokenizes what is already there. With `layout` (squid
    documents), the stream is what follows the documents: the query, then the turns; every turn
    is sampled and scored with the prefix and documents in front.
    """

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    reward: float = 0.0
    num_turns: int = 0
    finish_reason: str | None = None
    layout: SquidLayout | None = None
    # where each appended sample (one engine request's output) begins in token_ids: the engine's
    # presence / frequency penalties count a request's own output, so the trainer needs them
    sample_starts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        # one entry per token in each per-token field; a mask is 0 or 1 (a 2 would weigh a token twice)
        n = len(self.token_ids)
        for name in ("loss_mask", "logprobs", "weight_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Trajectory.{name} has {len(getattr(self, name))} entries for {n} tokens")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("Trajectory.loss_mask entries must be 0 or 1")

    @classmethod
    def start(cls, prompt_token_ids: list[int], layout: SquidLayout | None = None) -> Trajectory:
        n = len(prompt_token_ids)
        return cls(list(prompt_token_ids), [0] * n, [0.0] * n, [-1] * n, layout=layout)

    def append_context(self, token_ids: list[int]) -> None:
        """Tokens the model did not sample (tool output, user turn, template glue): loss mask 0."""
        n = len(token_ids)
        self.token_ids.extend(token_ids)
        self.loss_mask.extend([0] * n)
        self.logprobs.extend([0.0] * n)
        self.weight_versions.extend([-1] * n)

    def append_sample(self, sample: Sample) -> None:
        """A model turn exactly as sampled: loss mask 1, the engine's logprobs."""
        if len(sample.logprobs) != len(sample.token_ids):
            raise ValueError("a sample appended to a trajectory needs one logprob per token (SamplingParams.logprobs=0)")
        n = len(sample.token_ids)
        self.sample_starts.append(len(self.token_ids))
        self.token_ids.extend(sample.token_ids)
        self.loss_mask.extend([1] * n)
        self.logprobs.extend(sample.logprobs)
        self.weight_versions.extend([sample.weight_version] * n)
        self.num_turns += 1
        self.finish_reason = sample.finish_reason

    @property
    def prompt_length(self) -> int:
        """Tokens before the first trained one (the whole stream if none is trained)."""
        return next((i for i, m in enumerate(self.loss_mask) if m), len(self.token_ids))
