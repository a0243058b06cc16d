"""`RolloutClient`: the rollout API over HTTP, against one `cuttle serve` or a pool of them.

Owns the wire format of the RL routes (`/v1/rl/*`, see `engine/server/rl_routes.py`) from the
trainer's side. It satisfies `TokenSampler`, so `sample_groups(client, ...)` works exactly as with
an in-process `LLM`. With several servers, prompts are spread round-robin (a prompt's whole group
stays on one server, so its samples still share one prefill) and weight updates go to all.
Must never tokenize: token ids in, token ids out.

Squid prompts travel as token ids too (`{"prefix", "documents", "prompt"}`, each ids): text in
them is refused before anything is sent. `squid_positions` is the servers' convention (read once
from `/v1/rl/info`; servers that disagree are refused), so `rl.batch` rebuilds the attention the
servers sampled with. With several servers each one computes a document once for the prompts it
is sent (round-robin does not group prompts by document).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import torch
from safetensors.torch import save as save_safetensors

from cuttle.engine.openai_protocol import RL_SAMPLING_FIELDS
from cuttle.engine.sampling_params import SamplingParams
from cuttle.rl.rollout import by_params, sample_groups
from cuttle.rl.types import Group, Sample


def _wire_params(params: SamplingParams) -> dict[str, Any]:
    """The request's sampling fields for /v1/rl/generate; a field the route cannot honour is refused
    by name rather than dropped (a sampler that silently differs from the in-process one)."""
    fields = dataclasses.asdict(params)
    if params.logprobs not in (None, 0):
        raise ValueError(f"logprobs={params.logprobs}: /v1/rl/generate returns the sampled tokens' logprobs only")
    for name in ("prompt_logprobs", "structured_outputs"):
        if fields[name] is not None:
            raise ValueError(f"{name} is not supported by RolloutClient (/v1/rl/generate does not take it)")
    return {k: v for k, v in fields.items() if k in RL_SAMPLING_FIELDS}  # what /v1/rl/generate reads


class RolloutClient:
    # httpx.Client may be shared by threads, and a server batches concurrent requests itself: a Ray
    # rollout worker calls it from every group thread at once
    thread_safe = True

    def __init__(self, base_urls: str | list[str], api_key: str | None = None, timeout: float = 600.0):
        self.base_urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not self.base_urls:
            raise ValueError("RolloutClient needs at least one server URL")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(headers=headers, timeout=timeout)
        self._squid_positions: str | None = None
        self.lora_name: str | None = None  # the adapter rollouts are drawn under: the last `update_lora` sent

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(self, url: str, **kw: Any) -> dict[str, Any]:
        r = self._http.post(url, **kw)
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text}")
        return r.json()

    def _post_empty(self, url: str, **kw: Any) -> None:
        r = self._http.post(url, **kw)
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text}")

    def _get(self, url: str) -> dict[str, Any]:
        r = self._http.get(url)
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text}")
        return r.json()

    # ---- rollouts --------------------------------------------------------------------------
    def _agreed_info(self, keys: tuple[str, ...], what: str) -> tuple:
        """The servers' /v1/rl/info values of `keys`, which every server must give, and alike: a
        server without one of them (older than the field) or servers that differ are refused."""
        seen = {}
        for u in self.base_urls:
            info = self._get(u + "/v1/rl/info")
            missing = [k for k in keys if k not in info]
            if missing:
                raise ValueError(f"RolloutClient: {u} does not report {', '.join(missing)} in /v1/rl/info (a server older "
                                 "than the field): upgrade it, or set what it would say by hand")
            seen[u] = tuple(tuple(info[k]) if isinstance(info[k], list) else info[k] for k in keys)
        if len(set(seen.values())) != 1:
            raise ValueError(f"RolloutClient: servers {what} ({', '.join(keys)}): {seen}")
        return next(iter(seen.values()))

    @property
    def squid_positions(self) -> str:
        """The position convention the servers place squid documents with ("shared" or "concat")."""
        if self._squid_positions is None:
            self._squid_positions = self._agreed_info(("squid_positions",), "place documents differently")[0]
        return self._squid_positions

    def forward_options(self) -> dict:
        """What of the servers' forward a trainer must mirror (`LLMEngine.forward_options`, from
        /v1/rl/info; `TrainerConfig.for_sampler`)."""
        keys = ("sparse_attention", "moe_quant", "quantization", "quantize_lm_head", "dtype")
        return dict(zip(keys, self._agreed_info(keys, "run different forwards")))

    @property
    def eos_token_ids(self) -> set[int]:
        """The ids that end a sampled turn on the servers (an agent loop needs them to read a turn)."""
        return set(self._agreed_info(("eos_token_ids",), "end turns with different eos ids")[0])

    accepts_param_lists = True  # generate_tokens takes one SamplingParams per prompt

    def generate_tokens(self, prompts: list[list[int] | dict[str, Any]],
                        params: SamplingParams | list[SamplingParams]) -> list[list[Sample]]:
        """One list of samples per prompt; `params` one for all, or one per prompt (per-episode
        seeds): the prompts of each distinct parameters go as their own requests, all at once
        (the servers batch them)."""
        if isinstance(params, SamplingParams):
            return self._generate(prompts, params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling_params")
        groups = by_params(params)
        out: list[list[Sample]] = [[] for _ in prompts]
        with ThreadPoolExecutor(max_workers=min(32, len(groups))) as pool:
            futures = {first: pool.submit(self._generate, [prompts[i] for i in idx], params[first]) for first, idx in groups.items()}
            for first, idx in groups.items():
                for i, samples in zip(idx, futures[first].result()):
                    out[i] = samples
        return out

    def _generate(self, prompts: list[list[int] | dict[str, Any]], params: SamplingParams) -> list[list[Sample]]:
        wire = _wire_params(params)
        k = len(self.base_urls)
        shards = [list(range(i, len(prompts), k)) for i in range(k)]

        def call(i: int) -> list[dict[str, Any]]:
            if not shards[i]:
                return []
            body = {"prompts": [prompts[j] for j in shards[i]], "sampling_params": wire}
            if self.lora_name is not None:
                body["lora_name"] = self.lora_name
            return self._post(self.base_urls[i] + "/v1/rl/generate", json=body)["results"]

        with ThreadPoolExecutor(max_workers=k) as pool:
            answers = list(pool.map(call, range(k)))
        out: list[list[Sample]] = [[] for _ in prompts]
        for shard, results in zip(shards, answers):
            for j, res in zip(shard, results):
                v = int(res["weight_version"])
                out[j] = [Sample(s["token_ids"], s["logprobs"], s["finish_reason"], v, text=s["text"]) for s in res["samples"]]
        return out

    def sample_groups(self, prompts: list[list[int]], group_size: int, sampling_params: SamplingParams,
                      metadata: list[dict[str, Any]] | None = None) -> list[Group]:
        return sample_groups(self, prompts, group_size, sampling_params, metadata)

    # ---- weights ---------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        """The lowest version across the pool (servers can lag only while an update is under way)."""
        return min(int(self._http.get(u + "/v1/rl/weight_version").json()["weight_version"]) for u in self.base_urls)

    def sleep(self, level: int = 1) -> None:
        """Put every server to sleep (`POST /sleep`; servers started with --enable-sleep-mode): a
        trainer colocated with them gets the KV caches' memory while it trains (`level=2`: the
        weights' too; `update_weights` must then send them all before the servers serve again)."""
        for u in self.base_urls:
            self._post_empty(u + "/sleep", params={"level": level})

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake every server: all, or `tags` among "weights" and "kv_cache" (`POST /wake_up`)."""
        for u in self.base_urls:
            self._post_empty(u + "/wake_up", params={"tags": list(tags)} if tags is not None else None)

    def is_sleeping(self) -> bool:
        """Whether any server sleeps."""
        return any(self._get(u + "/is_sleeping")["is_sleeping"] for u in self.base_urls)

    def update_lora(self, lora_name: str, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any],
                    in_flight: str = "finish") -> int:
        """LoRA training's weight sync to every server (`POST /v1/rl/update_lora`; servers started
        with --enable-lora): from now on every rollout is sampled under this adapter. Returns the
        lowest new version."""
        blob = save_safetensors({n: t.detach().contiguous().cpu() for n, t in named_tensors},
                                metadata={"adapter_config": json.dumps(config)})
        versions = [int(self._post(u + "/v1/rl/update_lora", params={"lora_name": lora_name, "in_flight": in_flight},
                                   content=blob)["weight_version"]) for u in self.base_urls]
        self.lora_name = lora_name
        return min(versions)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], in_flight: str = "abort") -> int:
        """Send the tensors (as one safetensors blob) to every server; returns the lowest new version."""
        blob = save_safetensors({n: t.detach().contiguous().cpu() for n, t in named_tensors})
        versions = [
            int(self._post(u + "/v1/rl/update_weights", params={"in_flight": in_flight}, content=blob)["weight_version"])
            for u in self.base_urls
        ]
        return min(versions)
