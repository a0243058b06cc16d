"""The reference trainer: scores `TrainBatch`es with the engine's own model code, steps AdamW on
the chosen policy loss, and pushes the new weights back into a running engine.

It trains and scores in the sampler's MXFP8 format: `moe_quant="mxfp8"` quantizes every
routed-expert weight on the fly in the forward, `quantization="mxfp8"` every linear the engine's
`quantization` covers (attention and dense-MLP projections, and the routed experts) and, with
`quantize_lm_head`, the lm_head (a tied one only where it makes logits: the token lookup reads the
embedding as is, as the engine's does). Each is a parametrization over the master weight: cast to
the engine's model dtype (`quant_dtype`), `quantize_mxfp8`, dequantize; straight-through gradients.
So the logprobs are those of an engine serving that format, and the trained policy is sampled with
no post-training quantization step. The master weights stay in `dtype` and are what `push_weights`
sends (the engine re-quantizes them the same way). `sparse_attention` (the engine's
training-free top-k spec) scores under the same rule, squid segments each on its own keys.
`TrainerConfig.for_sampler` reads all of these from the sampler (an `LLM`, or the servers'
/v1/rl/info). Its sampling fields (`SAMPLING_FIELDS`: temperature, truncation, penalties,
logit_bias / allowed_token_ids / bad_words / structured_outputs, min_tokens and its stop ids) must
be the rollout's, as `for_sampler(sampler, sampling_params)` copies them: the trainer scores the
distribution the tokens were drawn from, the engine sampler's processing replayed on its logits
(rl/sampling_replay.py; per engine request where it counts: `TrainBatch.output_starts`).

Owns a training copy of the model (float32 master weights by default), its optimizer, and the
recomputation of the sampled tokens' logprobs (`CausalLM.forward_masked` over rows of whole
sequences, each under the attention it was sampled with: causal, or its squid layout's mask and
positions from `SquidLayout.dense_mask_and_positions`; the same parameters and math as the
engine, so the mismatch metric measures numerics, not model drift).
Must never sample and never hold engine state: weights reach the engine only through
`update_weights` on an `LLM`, an `AsyncEngine` caller or a `RolloutClient`.

One `step` is `minibatches` optimizer steps over consecutive parts of the batch (each micro-batched
by tokens, gradients accumulated). The PPO/GRPO ratio's old policy (`old_policy`) is either the
behaviour policy, the engine's logprobs of the sampled tokens (default: the ratio then also
corrects for stale weights and sampler/trainer mismatch, and its clip binds wherever the policy
has moved away from what sampled), or the trainer's own logprobs scored once at the start of the
step ("start", classic PPO; the clip then binds from the second minibatch on, and TIS corrects
the sampler gap). Never the current logprobs detached: that ratio is 1 by construction and the
clip could never bind.
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.utils import parametrize

from cuttle.engine.config import DTYPES, MOE_QUANT_MODES, QUANTIZATION_MODES, ModelConfig
from cuttle.engine.models import CausalLM, load_model
from cuttle.engine.models.transformer import parse_sparse_attention, sparse_attention_for
from cuttle.engine.models.linear_quant import linear_slots
from cuttle.engine.models.moe_quant import moe_layers
from cuttle.engine.sampling_params import SamplingParams, StructuredOutputsParams
from cuttle.moe.mxfp8 import fake_quantize_ste
from cuttle.rl.batch import PackedBatch, TrainBatch
from cuttle.engine.lora import LoRABatch, LoRAContext
from cuttle.rl.lora import TrainableLoRA
from cuttle.rl.losses import LossConfig, Normalizer, loss_config, policy_loss
from cuttle.rl.mismatch import mismatch
from cuttle.rl.sampling_replay import SamplingReplay
from cuttle.rl.shared_rows import SharedRow, shared_with_previous


class WeightTarget(Protocol):
    def update_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]], in_flight: str = "abort") -> int: ...


class LoRATarget(Protocol):
    """Where a LoRA trainer pushes its adapter (`EngineSampler`, `RolloutClient`, or an
    `AgentRollout`, which passes it to its sampler): a sampler that then draws every rollout
    under it (`lora_name`)."""

    lora_name: str | None

    def update_lora(self, lora_name: str, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any],
                    in_flight: str = "finish") -> int: ...


@dataclass(slots=True)
class TrainerConfig:
    loss: LossConfig = field(default_factory=lambda: loss_config("grpo"))
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0  # max global grad norm; None disables
    temperature: float = 1.0  # must equal the rollout's, so the trainer scores the sampling distribution
    # the rollout's truncation, likewise (SamplingParams' meanings; -1 or 0 / 1.0 / 0.0: none)
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    # the rollout's penalties, likewise (applied first, as the engine's sampler does): repetition over
    # the sample's whole context, presence / frequency over its own request's output so far
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # the rollout's token-level controls, likewise (SamplingParams' meanings, applied first: the
    # bias, then what the mask excludes); bad_words and structured_outputs need the tokenizer
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    thinking_token_budget: int | None = None  # its thinking budget's forced closing tag (needs the tokenizer)
    # and its min_tokens: the stop ids (stop_token_ids, and EOS unless ignore_eos) masked while its
    # output is shorter; `eos_token_ids` None: the checkpoint's (the engine's rule)
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    eos_token_ids: list[int] | None = None
    max_tokens_per_row: int = 2048  # micro-batch size: whole sequences packed into one row
    # a group's samples in one row read their shared prompt (and documents) once (rl/shared_rows.py);
    # not under NSA or sparse_attention, whose rules are per segment of each sequence
    share_prefixes: bool = True
    dtype: str = "float32"
    old_policy: str = "behaviour"  # the ratio's denominator: "behaviour" (engine logprobs) or "start"
    minibatches: int = 1  # optimizer steps per batch, each over a consecutive part of its sequences
    moe_quant: str | None = None  # "mxfp8": routed experts quantized on the fly in the forward (the sampler's format)
    quantization: str | None = None  # "mxfp8": every linear the engine's `quantization` covers, routed experts included
    quantize_lm_head: bool = False  # with quantization: the lm_head too (the engine's `quantize_lm_head`)
    quant_dtype: str | None = None  # the engine's model dtype, which its MXFP8 weights are quantized from (default: `dtype`)
    # the engine's `sparse_attention` (training-free top-k), so sampled tokens are scored under the
    # attention they were sampled with: the same spec string or dict; None: dense attention
    sparse_attention: str | dict | None = None
    # LoRA training (rl/lora.py): {"r": 8, "lora_alpha": 16, "target_modules": [...], "use_rslora": False};
    # only the adapter trains (the base weights are frozen) and `push_weights` sends it to the
    # sampler's `update_lora` under `lora_name`, whose requests then run under it
    lora: dict[str, Any] | None = None
    lora_name: str = "policy"

    def __post_init__(self) -> None:
        if self.moe_quant is not None and self.moe_quant not in MOE_QUANT_MODES:
            raise ValueError(f"moe_quant must be None or one of {', '.join(MOE_QUANT_MODES)}; got {self.moe_quant!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be None or one of {', '.join(QUANTIZATION_MODES)}; got {self.quantization!r}")
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head=True needs quantization='mxfp8' (the lm_head is quantized with the other linears)")
        if self.quant_dtype is not None and self.quant_dtype not in DTYPES:
            raise ValueError(f"quant_dtype must be one of {', '.join(DTYPES)}; got {self.quant_dtype!r}")
        if self.sparse_attention is not None:
            parse_sparse_attention(self.sparse_attention)  # refused here, naming the field, if malformed
        if self.old_policy not in OLD_POLICIES:
            raise ValueError(f"old_policy must be one of {OLD_POLICIES}, got {self.old_policy!r}")
        if self.minibatches < 1:
            raise ValueError(f"minibatches must be >= 1, got {self.minibatches}")
        # (before SamplingParams, which reads a temperature near 0 as greedy)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not self.temperature > 0.0:
            raise ValueError(f"temperature must be > 0 (the trainer scores a sampling distribution), got {self.temperature!r}")
        if self.eos_token_ids is not None:
            self.eos_token_ids = sorted(set(self.eos_token_ids))
        # every other sampling field is checked by SamplingParams' own rules, naming the field (and
        # normalised: logit_bias keys as ints)
        sp = self.rollout_params()
        self.logit_bias, self.stop_token_ids, self.bad_words = sp.logit_bias, sp.stop_token_ids, sp.bad_words

    def rollout_params(self) -> SamplingParams:
        """The sampling fields this config replays, as the SamplingParams a rollout would set."""
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, logit_bias=self.logit_bias,
                              allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                              structured_outputs=self.structured_outputs, min_tokens=self.min_tokens, max_tokens=None,
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                              thinking_token_budget=self.thinking_token_budget)

    @classmethod
    def for_sampler(cls, sampler: Any, sampling_params: SamplingParams | None = None, **fields: Any) -> TrainerConfig:
        """A config whose forward is the sampler's, so its logprobs are the ones the samples were
        drawn with: its `sparse_attention` and its MXFP8 weights (`moe_quant`, `quantization`,
        `quantize_lm_head`, quantized from its dtype), and its EOS ids. `sampler`: an in-process
        `LLM`, or a `RolloutClient` (read from the servers' /v1/rl/info). With the rollout's
        `sampling_params`, every field of it that shapes the distribution a token is drawn from
        (`SAMPLING_FIELDS`: temperature, truncation, penalties, token controls, min_tokens and its
        stop ids). The other fields as given, over these."""
        served = hasattr(sampler, "forward_options")  # a RolloutClient; an LLM answers through its engine
        info = sampler.forward_options() if served else sampler.engine.forward_options()
        eos = sampler.eos_token_ids if served else sampler.engine.eos_token_ids
        quantized = info["moe_quant"] is not None or info["quantization"] is not None
        mirrored = {"sparse_attention": info["sparse_attention"], "moe_quant": info["moe_quant"],
                    "quantization": info["quantization"], "quantize_lm_head": info["quantize_lm_head"],
                    "quant_dtype": info["dtype"] if quantized else None, "eos_token_ids": sorted(eos)}
        if sampling_params is not None:
            if sampling_params.greedy:
                raise ValueError("sampling_params.temperature is 0 (greedy): the trainer scores a sampling distribution")
            mirrored.update({name: getattr(sampling_params, name) for name in SAMPLING_FIELDS})
        return cls(**{**mirrored, **fields})


# SamplingParams fields that shape the distribution a token is drawn from: a TrainerConfig field each
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "logit_bias", "allowed_token_ids", "bad_words", "structured_outputs",
                   "thinking_token_budget", "min_tokens", "stop_token_ids", "ignore_eos")


OLD_POLICIES = ("behaviour", "start")


class Trainer:
    def __init__(self, model_path: str, config: TrainerConfig | None = None, device: str = "cpu",
                 freeze: tuple[str, ...] = (), tokenizer: str | None = None):
        """`freeze`: parameter-name prefixes left untrained (e.g. ("embed",)). `tokenizer`: the
        folder of the engine's tokenizer (default `model_path`), read only for the config's
        bad_words / structured_outputs / thinking_token_budget (to replay the engine's masks)."""
        self.config = config or TrainerConfig()
        self.device = torch.device(device)
        mc = ModelConfig.from_pretrained(model_path)
        self.model: CausalLM = load_model(model_path, mc, DTYPES[self.config.dtype], self.device)
        if self.config.moe_quant is not None or self.config.quantization is not None:
            self._quantize_on_the_fly()
        self.sparse = sparse_attention_for(self.config.sparse_attention, mc)  # refused as the engine refuses it
        # shared prompt rows (rl/shared_rows.py), except under NSA / top-k, which attend per segment of each sequence
        self.shares_prefixes = self.config.share_prefixes and self.model.nsa is None and self.sparse is None
        self.replay = SamplingReplay(self.config, model_path, mc, tokenizer)
        self.lora: TrainableLoRA | None = None
        if self.config.lora is not None:
            # the adapter through the model's LoRA seam, on every row: the engine's formula
            self.lora = TrainableLoRA(mc, self.config.lora).to(self.device)
            ctx = LoRAContext()
            ctx.batch = LoRABatch([(self.lora, None)])  # type: ignore[list-item]  # duck-typed adapter: `.weights`
            self.model.enable_lora(ctx)
            for p in self.model.parameters():
                p.requires_grad_(False)
            self.params = list(self.lora.parameters())
        else:
            # frozen by the engine's names (a parametrized weight's own name ends in `.original`)
            self.params = [p for n, p in self.model.named_parameters() if not _engine_name(n).startswith(freeze)]
        for p in self.params:
            p.requires_grad_(True)
        c = self.config
        self.optimizer = torch.optim.AdamW(self.params, lr=c.lr, betas=c.betas, weight_decay=c.weight_decay)
        self.num_steps = 0

    def _quantize_on_the_fly(self) -> None:
        """Parametrize every weight the sampler holds in MXFP8 by its round trip (see the module
        docstring); the same weights `prepare_quantized_experts` / `prepare_quantized_linears`
        replace in the engine, refused where the engine refuses them."""
        c = self.config
        slots: list[tuple[nn.Module, str]] = []
        layers = moe_layers(self.model)
        if c.moe_quant is not None and not layers:
            raise ValueError(f"moe_quant={c.moe_quant!r}: this {self.model.cfg.architecture} model has no MoE layers")
        # quantization="mxfp8" quantizes the routed experts too, as the engine's loader does
        slots += [(layer, name) for layer in layers.values() for name in ("w13", "w2")]
        if c.quantization is not None:
            slots += [(module, attr) for module, attr, _ in linear_slots(self.model)]
            if c.quantize_lm_head:
                # tied: `lm_head` is the embedding under a second name; parametrizing that name
                # leaves `embed` (the token lookup) as it is, and the gradients of both meet in it
                slots.append((self.model, "lm_head"))
        src = DTYPES[c.quant_dtype or c.dtype]
        for module, name in slots:
            k = getattr(module, name).shape[-1]
            if k % 32:
                raise ValueError(f"MXFP8: {type(module).__name__}.{name} has input dim {k}, not a multiple of the MX block size 32")
            parametrize.register_parametrization(module, name, _MXFP8RoundTrip(src))

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                 segments: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if segments is None:
            return self.model.forward_masked(ids, pos, mask, sparse=self.sparse)
        return self.model.forward_masked(ids, pos, mask, sparse=self.sparse, segments=segments[0],
                                         segment_shifts=segments[1])

    # ---- scoring ---------------------------------------------------------------------------
    def _rows(self, batch: PackedBatch, first: int = 0, end: int | None = None) -> Iterator[tuple[int, int]]:
        """Consecutive sequence ranges [a, b) within [first, end) whose tokens fit one row (a
        longer one goes alone); with shared prompt rows a sequence after one of its group counts
        only what it adds to the row."""
        lens = batch.seq_lens
        end = len(lens) if end is None else end
        shared = shared_with_previous(batch, first, end) if self.shares_prefixes else [0] * (end - first)
        a, total = first, 0
        for i in range(first, end):
            cost = lens[i] - shared[i - first] if i > a else lens[i]
            if i > a and total + cost > self.config.max_tokens_per_row:
                yield a, i
                a, total, cost = i, 0, lens[i]
            total += cost
        if a < end:
            yield a, end

    def _row_logprobs(self, batch: PackedBatch, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor, slice]:
        """Logprobs of the trained tokens of sequences [a, b) (autograd follows the caller's mode),
        each token's sequence index local to the row, and the row's slice of the token stream."""
        cu = batch.cu_seqlens.tolist()
        span = slice(cu[a], cu[b])
        ids = batch.input_ids[span].to(self.device)
        pos = batch.position_ids[span].to(self.device)
        lens = torch.tensor(batch.seq_lens[a:b], device=self.device)
        doc = torch.repeat_interleave(torch.arange(b - a, device=self.device), lens)
        segments = None
        if self.model.nsa is not None or self.sparse is not None:  # NSA / top-k attend per segment (each sequence's pieces)
            segments = tuple(t.to(self.device)[None] for t in batch.row_segments(a, b))
        targets = batch.loss_mask[span].to(self.device).nonzero().squeeze(1)
        # token t is predicted by the logits at t - 1 (never across a sequence: position 0 is untrained)
        pred = targets - 1
        shared = SharedRow.build(batch, a, b) if self.shares_prefixes else None
        if shared is not None and shared.shared:  # the group's prompt once: each token predicted from the row it is computed in
            row = (shared.input_ids.to(self.device), shared.position_ids.to(self.device), shared.mask.to(self.device))
            pred = shared.index.to(self.device)[pred]
        else:  # block-diagonal: each sequence causal or under its squid layout, never seeing another
            row = (ids, pos, batch.row_mask(a, b).to(self.device))
        # cached: each MXFP8 weight is quantized once per row, however often the forward reads it
        with parametrize.cached():
            hidden = self._forward(row[0][None], row[1][None], row[2][None], segments)[0]
            logits = self.model.compute_logits(hidden[pred])
        logits = self.replay(logits, batch, a, b, ids, targets)
        lp = torch.log_softmax(logits, dim=-1).gather(1, ids[targets][:, None]).squeeze(1)
        return lp, doc[targets], span

    @torch.no_grad()
    def score(self, batch: TrainBatch | PackedBatch) -> torch.Tensor:
        """The trainer's logprobs of every trained token, in stream order: aligned with
        `packed.rollout_logprobs[packed.loss_mask > 0]`."""
        packed = batch.packed() if isinstance(batch, TrainBatch) else batch
        return torch.cat([self._row_logprobs(packed, a, b)[0] for a, b in self._rows(packed)]).cpu()

    # ---- training --------------------------------------------------------------------------
    def step(self, batch: TrainBatch | PackedBatch, current_version: int | None = None) -> dict[str, float]:
        """`minibatches` AdamW steps on the configured loss; returns loss, grad norm, clip fraction,
        mismatch (of the logprobs at the start of the step) and reward stats.

        Per-token weight versions (partial rollouts): tokens sampled by a version older than
        `current_version` (default: the newest in the batch) are stale. The mismatch is always
        against the behaviour logprobs; it is also reported apart for the fresh tokens (sampler vs
        trainer numerics under the same weights) and the stale ones (that plus the policy's drift
        since they were sampled, which the behaviour-policy ratio corrects)."""
        t0 = time.perf_counter()
        packed = batch.packed() if isinstance(batch, TrainBatch) else batch
        for name in ("advantages", "rollout_logprobs"):  # a NaN here would reach every weight
            t = getattr(packed, name)
            if not bool(torch.isfinite(t[packed.loss_mask > 0] if t.shape == packed.loss_mask.shape else t).all()):
                raise ValueError(f"the batch's {name} hold a non-finite value (a NaN or infinite reward?); nothing was trained")
        cfg = self.config.loss
        trained_per_seq = [int(packed.loss_mask[s:e].sum().item()) for s, e in zip(packed.cu_seqlens[:-1].tolist(), packed.cu_seqlens[1:].tolist())]
        rollout_all = packed.rollout_logprobs[packed.loss_mask > 0]
        # offsets of each sequence's trained tokens in the flat (stream-order) vector
        starts = [0]
        for n in trained_per_seq:
            starts.append(starts[-1] + n)
        k = min(self.config.minibatches, packed.num_seqs)
        # scored before any update: the old policy for "start", and with several minibatches the
        # only logprobs that measure the sampler mismatch against these weights
        start_lp = self.score(packed) if self.config.old_policy == "start" or k > 1 else None
        old_all = start_lp if self.config.old_policy == "start" else rollout_all
        bounds = [round(i * packed.num_seqs / k) for i in range(k + 1)]
        self.model.train()
        total_loss, clip_fracs, grad_norms, scored = 0.0, [], [], []
        for m0, m1 in zip(bounds, bounds[1:]):
            norm = Normalizer(m1 - m0, sum(trained_per_seq[m0:m1]), cfg.max_len or max(trained_per_seq, default=1))
            self.optimizer.zero_grad(set_to_none=True)
            for a, b in self._rows(packed, m0, m1):
                lp, seq_idx, span = self._row_logprobs(packed, a, b)
                flat = slice(starts[a], starts[b])
                old, rollout = old_all[flat].to(lp.device), rollout_all[flat].to(lp.device)
                loss, stats = policy_loss(lp, old, rollout, packed.advantages[a:b].to(lp.device), seq_idx, b - a, cfg, norm)
                loss.backward()
                total_loss += loss.item()
                clip_fracs.append(stats["clip_frac"])
                scored.append(lp.detach().cpu())
            grad_norms.append(torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip or float("inf")).item())
            if not math.isfinite(grad_norms[-1]):
                self.optimizer.zero_grad(set_to_none=True)
                raise FloatingPointError(f"non-finite gradient norm ({grad_norms[-1]}) in minibatch {m0}..{m1}: this "
                                         "optimizer step was skipped (earlier minibatches of the call were applied)")
            self.optimizer.step()
        self.num_steps += 1
        trainer_lp = start_lp if start_lp is not None else torch.cat(scored)  # k == 1: scored before the update
        extra: dict[str, float] = {}
        if packed.token_versions is not None:
            versions = packed.token_versions[packed.loss_mask > 0]
            if versions.numel():
                current = int(versions.max()) if current_version is None else current_version
                stale = versions < current
                extra = {"stale_token_frac": stale.float().mean().item(),
                         "max_version_lag": float(current - int(versions.min())),
                         **mismatch(trainer_lp[~stale], rollout_all[~stale]).to_dict("mismatch_fresh_"),
                         **mismatch(trainer_lp[stale], rollout_all[stale]).to_dict("mismatch_stale_")}
        return {
            "loss": total_loss / k,
            "grad_norm": max(grad_norms),
            "clip_frac": sum(clip_fracs) / max(len(clip_fracs), 1),
            "reward_mean": packed.rewards.mean().item(),
            "num_seqs": float(packed.num_seqs),
            "num_trained_tokens": float(sum(trained_per_seq)),
            "train_seconds": time.perf_counter() - t0,
            **mismatch(trainer_lp, rollout_all).to_dict(),
            **extra,
        }

    # ---- weight sync -----------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights under the engine's own parameter names (no HF name round trip)."""
        for name, p in self.model.named_parameters():
            yield _engine_name(name), p.detach()

    def push_weights(self, target: WeightTarget | LoRATarget, in_flight: str = "abort") -> int:
        """Load the current weights into a running engine; returns its new weight version. A LoRA
        trainer sends its adapter alone (`update_lora`, PEFT names) under `config.lora_name`; the
        requests in flight finish under the adapter they started with unless `in_flight` is "abort"."""
        if self.lora is not None:
            if not hasattr(target, "lora_name"):
                # an LLM's rollouts (sample_groups(llm, ...)) would go on sampling the base model
                raise ValueError(f"a LoRA policy is pushed to a sampler whose rollouts then run under it (EngineSampler, "
                                 f"RolloutClient, AgentRollout), not to a {type(target).__name__}: call its update_lora "
                                 "and pass lora_request to each generate instead")
            return target.update_lora(self.config.lora_name, self.lora.peft_state().items(), self.lora.config,  # type: ignore[union-attr]
                                      in_flight)
        return target.update_weights(self.named_weights(), in_flight)  # type: ignore[union-attr]


def _engine_name(name: str) -> str:
    """A parameter's engine name: a parametrized weight's master is `<module>.parametrizations.<w>.original`."""
    return name.replace("parametrizations.", "").removesuffix(".original")


class _MXFP8RoundTrip(nn.Module):
    """Parametrization of a weight (an [N, K] linear, a stacked [E, N, K] expert weight): its
    MXFP8 round trip along K, straight-through."""

    def __init__(self, from_dtype: torch.dtype) -> None:
        super().__init__()
        self.from_dtype = from_dtype

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return fake_quantize_ste(w, self.from_dtype)
