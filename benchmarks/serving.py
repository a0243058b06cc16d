"""Serving benchmark: a load generator for any OpenAI-compatible /v1/completions endpoint
(cuttle, vLLM, llama.cpp's server), measured at the client over SSE.

    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --dataset random --request-rates 1,2,4
    python benchmarks/serving.py --base-url ... --dataset shared-prefix --concurrencies 1,4,16 --json out.json
    python benchmarks/serving.py --base-url ... --dataset coding-agent --concurrencies 4 --plot out.png

Owns: synthetic datasets of exact token lengths (`random`, `shared-prefix`, `coding-agent`),
arrivals (Poisson, constant rate, fixed concurrency; seeded), one streamed request and what it
costs as the client sees it (TTFT, TPOT, ITL, E2E), and the summary of a load level (percentiles,
throughput, goodput under an SLO, failures with their error text). It never talks to an engine
other than over HTTP, so every server is measured by the same code; a failed request is recorded,
never raised.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np

DATASETS = ("random", "shared-prefix", "coding-agent")
PERCENTILES = (50, 90, 99)
SWEEP_RATES = (0.5, 1.0, 2.0, 4.0)


# ---- prompts of exact token lengths ----------------------------------------------------------

class PromptBuilder:
    """Random prompts as token ids or as text whose token count is known.

    Without a tokenizer, ids are drawn from [id_min, id_max) and text is "t<id>" words: exact for
    the random-weight checkpoints' WordLevel vocab of "t0".."tN", approximate elsewhere (the
    server's usage then tells the true count). With a tokenizer, only vocab entries that encode
    back to themselves as one token after a space are used (" the", "t17"), so a prompt of n
    such words is n tokens and the same ids are valid in both formats.
    """

    def __init__(self, fmt: str = "token-ids", tokenizer: str | None = None, id_min: int = 100, id_max: int = 8000):
        if fmt not in ("token-ids", "text"):
            raise ValueError(f"prompt format must be token-ids or text, got {fmt!r}")
        self.fmt = fmt
        self.words: list[str] | None = None
        self.ids = list(range(id_min, id_max))
        if tokenizer is not None:
            self.ids, self.words = _single_token_words(tokenizer)

    def sample(self, rng: random.Random, n: int) -> list[Any]:
        """n prompt units: token ids, or words that are one token each (with their leading space)."""
        idx = [rng.randrange(len(self.ids)) for _ in range(n)]
        if self.fmt == "token-ids":
            return [self.ids[i] for i in idx]
        if self.words is not None:
            return [self.words[i] for i in idx]
        return [f" t{self.ids[i]}" for i in idx]

    def render(self, units: list[Any]) -> list[int] | str:
        return list(units) if self.fmt == "token-ids" else "".join(units)


def _single_token_words(path: str, max_probe: int = 20000) -> tuple[list[int], list[str]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path)
    added = set(getattr(tok, "get_added_tokens_decoder", dict)().keys())
    n = tok.get_vocab_size()
    probe = [i for i in range(n) if i not in added]
    if len(probe) > max_probe:  # a 150k vocab takes seconds to probe; a spread sample is plenty
        probe = random.Random(0).sample(probe, max_probe)
    ids, words = [], []
    for i in sorted(probe):
        w = tok.decode([i]).strip()
        if w.isascii() and w.isalnum() and tok.encode(" " + w, add_special_tokens=False).ids == [i]:
            ids.append(i)
            words.append(" " + w)
    if len(ids) < 100:
        raise ValueError(f"tokenizer {path}: only {len(ids)} single-token words found; use --prompt-format token-ids")
    return ids, words


# ---- datasets --------------------------------------------------------------------------------

@dataclass(slots=True)
class Turn:
    new_units: list[Any]  # appended to the session's history (after the previous reply) before sending
    output_len: int


@dataclass(slots=True)
class Session:
    """One request (random, shared-prefix) or an agent's chain of turns; a turn is sent only after
    the previous one finished, with the previous reply and the new turn appended to the history."""
    turns: list[Turn]
    group: int = 0  # which shared prefix / repository context it uses


def _span(s: str | tuple[int, int]) -> tuple[int, int]:
    if isinstance(s, tuple):
        return s
    lo, _, hi = str(s).partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 0 < lo_i <= hi_i:
        raise ValueError(f"length range must be N or LO:HI with 0 < LO <= HI, got {s!r}")
    return lo_i, hi_i


def make_dataset(cfg: ServingConfig, builder: PromptBuilder, seed: int) -> list[Session]:
    rng = random.Random(seed)
    out_lo, out_hi = _span(cfg.output_len)

    def out_len() -> int:
        return rng.randint(out_lo, out_hi)

    if cfg.dataset == "random":
        lo, hi = _span(cfg.input_len)
        return [Session([Turn(builder.sample(rng, rng.randint(lo, hi)), out_len())]) for _ in range(cfg.num_requests)]
    if cfg.dataset == "shared-prefix":
        prefixes = [builder.sample(rng, cfg.prefix_len) for _ in range(cfg.num_prefixes)]
        lo, hi = _span(cfg.suffix_len)
        sessions = []
        for i in range(cfg.num_requests):
            g = i % cfg.num_prefixes
            sessions.append(Session([Turn(prefixes[g] + builder.sample(rng, rng.randint(lo, hi)), out_len())], g))
        rng.shuffle(sessions)
        return sessions
    if cfg.dataset == "coding-agent":
        # one repository context shared by every session (the system prompt + files an agent reads
        # first); each session's first turn is a task, later turns are tool output chunks
        repo = builder.sample(rng, cfg.context_len)
        lo, hi = _span(cfg.tool_output_len)
        sessions = []
        for _ in range(cfg.num_sessions):
            turns = [Turn(repo + builder.sample(rng, rng.randint(lo, hi)), out_len())]
            turns += [Turn(builder.sample(rng, rng.randint(lo, hi)), out_len()) for _ in range(cfg.turns - 1)]
            sessions.append(Session(turns))
        return sessions
    raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {cfg.dataset!r}")


# ---- one streamed request ----------------------------------------------------------------------

@dataclass(slots=True)
class RequestResult:
    session: int
    turn: int
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0  # from usage when the server reports it, else the units sent
    output_tokens: int = 0  # from usage when reported, else token-bearing chunks
    expected_output_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    start: float = 0.0  # seconds since the level started
    ttft: float | None = None
    e2e: float | None = None
    chunks: int = 0  # token-bearing SSE events; fewer than output_tokens when a server batches tokens
    itl: list[float] = field(default_factory=list)
    reply_ids: list[int] | None = None
    reply_text: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any], res: RequestResult, timeout: float) -> RequestResult:
    """POST one streaming completion; fills `res`. Every failure (connect, HTTP status, an error
    event in the stream, a stream that ends early) lands in res.error."""
    t0 = time.perf_counter()
    last = None
    usage: dict[str, Any] | None = None
    ids: list[int] = []
    text: list[str] = []
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                msg = json.loads(data)
                if "error" in msg:
                    raise RuntimeError(f"error event: {json.dumps(msg['error'])[:300]}")
                if msg.get("usage"):
                    usage = msg["usage"]
                for ch in msg.get("choices") or []:
                    piece, tids = ch.get("text") or "", ch.get("token_ids") or []
                    # a finish-only chunk with nothing in it is not a token (llama.cpp sends one)
                    if not piece and not tids and ch.get("finish_reason") is not None:
                        continue
                    text.append(piece)
                    ids.extend(tids)
                    res.chunks += 1
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
            if not done:
                raise RuntimeError("stream ended without [DONE]")
        res.e2e = time.perf_counter() - t0
        if res.ttft is None:
            raise RuntimeError("no tokens streamed")
        if usage:
            res.prompt_tokens = int(usage.get("prompt_tokens") or res.prompt_tokens)
            res.output_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                res.cached_tokens = int(details["cached_tokens"])
        if not res.output_tokens:
            res.output_tokens = len(ids) or res.chunks
        res.reply_ids = ids or None
        res.reply_text = "".join(text)
        res.ok = True
    except Exception as e:  # noqa: BLE001 - a benchmark run records failures and goes on
        res.error = f"{type(e).__name__}: {e}"[:400]
        res.e2e = time.perf_counter() - t0
    return res


# ---- a run -------------------------------------------------------------------------------------

@dataclass(slots=True)
class ServingConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # default: the first id of GET /v1/models
    label: str | None = None  # the engine's name in tables and plots
    dataset: str = "random"
    num_requests: int = 64  # random, shared-prefix
    input_len: str = "128:512"
    output_len: str = "64:128"
    num_prefixes: int = 4  # shared-prefix
    prefix_len: int = 512
    suffix_len: str = "16:64"
    num_sessions: int = 8  # coding-agent
    turns: int = 4
    context_len: int = 2048
    tool_output_len: str = "64:256"
    think_time_ms: float = 0.0  # an agent's pause between a reply and its next turn (tool run time)
    arrival: str = "poisson"  # poisson | constant | concurrency
    request_rates: list[float] = field(default_factory=lambda: [1.0])  # sessions started per second
    concurrencies: list[int] = field(default_factory=list)  # sessions in flight; with rates: a cap
    prompt_format: str = "token-ids"
    tokenizer: str | None = None
    token_id_range: tuple[int, int] = (100, 8000)
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    warmup: int = 1
    timeout_s: float = 600.0  # httpx timeouts: connecting, and the longest silence within a stream
    seed: int = 0

    def levels(self) -> list[dict[str, Any]]:
        """Load levels of the sweep: each is (arrival, rate, concurrency cap)."""
        if self.arrival == "concurrency":
            return [{"arrival": "concurrency", "rate": None, "concurrency": c} for c in (self.concurrencies or [1])]
        if self.arrival not in ("poisson", "constant"):
            raise ValueError(f"arrival must be poisson, constant or concurrency, got {self.arrival!r}")
        cap = self.concurrencies[0] if self.concurrencies else None
        return [{"arrival": self.arrival, "rate": r, "concurrency": cap} for r in self.request_rates]


def arrival_offsets(n: int, level: dict[str, Any], rng: random.Random) -> list[float]:
    """When each session starts, in seconds from the level's start."""
    rate = level["rate"]
    if level["arrival"] == "concurrency" or rate is None or math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate) if level["arrival"] == "poisson" else 1.0 / rate
    return out


def _root(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url.removesuffix("/v1")


def _body(cfg: ServingConfig, model: str | None, prompt: list[int] | str, max_tokens: int, want_ids: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": cfg.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    if cfg.ignore_eos:  # fixed output lengths: every engine does the same amount of decode work
        body.update(ignore_eos=True, min_tokens=max_tokens)
    if want_ids:  # the coding agent appends the exact reply tokens, as a real agent's history would
        body["return_token_ids"] = True
    body.update(cfg.extra_body)
    return body


async def _run_level(cfg: ServingConfig, client: httpx.AsyncClient, model: str | None, builder: PromptBuilder,
                     sessions: list[Session], level: dict[str, Any], seed: int) -> dict[str, Any]:
    url = _root(cfg.base_url) + "/v1/completions"
    rng = random.Random(seed + 1)  # arrivals and synthetic replies; the dataset has its own stream
    offsets = arrival_offsets(len(sessions), level, rng)
    sem = asyncio.Semaphore(level["concurrency"]) if level["concurrency"] else None
    want_ids = cfg.dataset == "coding-agent" and builder.fmt == "token-ids"
    results: list[RequestResult] = []
    t0 = time.perf_counter()

    async def run_session(si: int, s: Session) -> None:
        history: list[Any] = []
        for ti, turn in enumerate(s.turns):
            history.extend(turn.new_units)
            res = RequestResult(si, ti, prompt_tokens=len(history), expected_output_tokens=turn.output_len,
                                start=time.perf_counter() - t0)
            await send(client, url, _body(cfg, model, builder.render(history), turn.output_len, want_ids), res, cfg.timeout_s)
            results.append(res)
            if not res.ok:
                return  # the rest of this agent's turns would build on a reply that never came
            if ti + 1 < len(s.turns):
                if builder.fmt == "text":
                    history.append(res.reply_text)
                else:  # a server that does not return token ids: a reply of the same length stands in
                    history.extend(res.reply_ids or builder.sample(rng, res.output_tokens))
                if cfg.think_time_ms:
                    await asyncio.sleep(cfg.think_time_ms / 1000)

    async def start(si: int, s: Session, at: float) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        if sem is None:
            await run_session(si, s)
        else:
            async with sem:
                await run_session(si, s)

    before = await scrape_metrics(client, cfg.base_url)
    await asyncio.gather(*(start(i, s, at) for i, (s, at) in enumerate(zip(sessions, offsets))))
    duration = time.perf_counter() - t0
    after = await scrape_metrics(client, cfg.base_url)
    out = {"level": level, **summarize(results, duration, cfg.slo_ttft_ms, cfg.slo_tpot_ms)}
    # both ends as scraped: some of these are counters, some ratios (a ratio's difference means nothing)
    out["server_metrics"] = {"before": before, "after": after}
    out["requests"] = [{k: v for k, v in asdict(r).items() if k not in ("itl", "reply_ids", "reply_text")} for r in results]
    return out


_SERVER_SERIES = re.compile(r"prefix_cache|preempt|prompt_tokens|generation_tokens|cached")


async def scrape_metrics(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    """Prefix-cache, preemption and token counters from the server's Prometheus /metrics, if it has
    one (cuttle_*, vllm:*), scraped before and after a level. Missing metrics are not an error."""
    try:
        r = await client.get(_root(base_url) + "/metrics", timeout=10)
        if r.status_code != 200:
            return {}
    except httpx.HTTPError:
        return {}
    out = {}
    for line in r.text.splitlines():
        if line.startswith("#") or not _SERVER_SERIES.search(line.split("{")[0].split(" ")[0]):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out


async def _model_of(client: httpx.AsyncClient, base_url: str, log) -> str | None:
    try:
        r = await client.get(_root(base_url) + "/v1/models", timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:  # the requests will fail and say why
        log(f"could not list models at {_root(base_url)}/v1/models ({type(e).__name__}: {e}); sending no model id")
        return None


async def run_async(cfg: ServingConfig, log=print) -> dict[str, Any]:
    builder = PromptBuilder(cfg.prompt_format, cfg.tokenizer, *cfg.token_id_range)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=cfg.timeout_s) as client:
        model = cfg.model or await _model_of(client, cfg.base_url, log)
        url = _root(cfg.base_url) + "/v1/completions"
        warm_rng = random.Random(zlib.crc32(f"warmup:{cfg.seed}".encode()))
        for i in range(cfg.warmup):  # first-request costs (compilation, allocation) out of the numbers
            res = await send(client, url, _body(cfg, model, builder.render(builder.sample(warm_rng, 16)), 4, False),
                             RequestResult(-1, i), cfg.timeout_s)
            if not res.ok:
                log(f"warm-up request failed: {res.error}")
        results = []
        for li, level in enumerate(cfg.levels()):
            # each level and dataset gets its own prompts: a run must not hit prefixes cached by the
            # level or dataset before it on the same server
            seed = zlib.crc32(f"{cfg.dataset}:{cfg.seed}:{li}".encode())
            sessions = make_dataset(cfg, builder, seed)
            r = await _run_level(cfg, client, model, builder, sessions, level, seed)
            log(format_summary(r, cfg.label or model or "?", cfg.dataset))
            results.append(r)
    config = asdict(cfg)
    config["model"] = model
    return {"config": config, "results": results}


def run(cfg: ServingConfig, log=print) -> dict[str, Any]:
    """Every load level of `cfg` against one server; {"config", "results": [one per level]}."""
    return asyncio.run(run_async(cfg, log))


# ---- metrics -----------------------------------------------------------------------------------

def _stats(xs: list[float]) -> dict[str, float | None]:
    """mean and percentiles in milliseconds (None when nothing was measured)."""
    if not xs:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(xs) * 1000.0
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def summarize(results: list[RequestResult], duration: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    errors: dict[str, int] = {}
    for r in failed:
        errors[r.error] = errors.get(r.error, 0) + 1

    def meets(r: RequestResult) -> bool:
        tpot = r.tpot
        return ((slo_ttft_ms is None or r.ttft * 1000 <= slo_ttft_ms)
                and (slo_tpot_ms is None or tpot is None or tpot * 1000 <= slo_tpot_ms))

    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    good = sum(1 for r in ok if meets(r))
    return {
        "num_requests": len(results), "completed": len(ok), "failed": len(failed), "errors": errors,
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output / duration if duration > 0 else 0.0,
        "input_throughput": prompt / duration if duration > 0 else 0.0,
        "total_input_tokens": prompt, "total_output_tokens": output,
        "short_outputs": sum(1 for r in ok if r.output_tokens != r.expected_output_tokens),
        # ITL is a gap between events: with several tokens per event it is not a per-token figure
        "tokens_per_chunk": output / max(1, sum(r.chunks for r in ok)),
        "cached_tokens": sum(cached) if cached else None,
        "cache_hit_frac": sum(cached) / prompt if cached and prompt else None,
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "good_requests": good, "goodput": good / duration if duration > 0 else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats([g for r in ok for g in r.itl]),
        "e2e_ms": _stats([r.e2e for r in ok]),
    }


def level_name(level: dict[str, Any]) -> str:
    if level["arrival"] == "concurrency":
        return f"concurrency {level['concurrency']}"
    cap = f", cap {level['concurrency']}" if level.get("concurrency") else ""
    return f"{level['arrival']} {level['rate']:g} req/s{cap}"


def format_summary(r: dict[str, Any], label: str, dataset: str) -> str:
    def f(x: float | None, spec: str = ".1f") -> str:
        return "-" if x is None else format(x, spec)

    lines = [f"==== {label} | {dataset} | {level_name(r['level'])} ====",
             f"requests: {r['completed']}/{r['num_requests']} ok, {r['failed']} failed in {r['duration_s']:.2f} s",
             f"throughput: {r['request_throughput']:.3f} req/s, {r['output_throughput']:.1f} out tok/s, {r['input_throughput']:.1f} in tok/s",
             f"tokens: {r['total_input_tokens']} in, {r['total_output_tokens']} out"
             + (f", {r['short_outputs']} requests with fewer/more output tokens than asked" if r["short_outputs"] else "")
             + (f", {r['tokens_per_chunk']:.2f} tokens per streamed event" if r["tokens_per_chunk"] > 1.01 else "")]
    if r["cached_tokens"] is not None:
        lines.append(f"prompt tokens from cache: {r['cached_tokens']} ({100 * (r['cache_hit_frac'] or 0):.1f}%)")
    slo = r["slo"]
    if slo["ttft_ms"] is not None or slo["tpot_ms"] is not None:
        lines.append(f"goodput (TTFT <= {slo['ttft_ms']} ms, TPOT <= {slo['tpot_ms']} ms): {r['goodput']:.3f} req/s "
                     f"({r['good_requests']}/{r['completed']})")
    lines.append(f"{'ms':<6}{'mean':>10}" + "".join(f"{'p' + str(p):>10}" for p in PERCENTILES))
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = r[key]
        lines.append(f"{key[:-3].upper():<6}{f(s['mean']):>10}" + "".join(f"{f(s[f'p{p}']):>10}" for p in PERCENTILES))
    for err, n in list(r["errors"].items())[:5]:
        lines.append(f"  failed x{n}: {err}")
    return "\n".join(lines)


TABLE_HEADERS = ["engine", "dataset", "load", "ok/total", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
                 "TPOT p99", "ITL p50", "ITL p99", "E2E p50", "E2E p99", "goodput", "cache hit"]


def _cell(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def table_rows(run_result: dict[str, Any], label: str | None = None) -> list[list[str]]:
    """One markdown row per load level (latencies in ms)."""
    cfg = run_result["config"]
    label = label or cfg.get("label") or cfg.get("model")
    rows = []
    for r in run_result["results"]:
        hit = r.get("cache_hit_frac")
        rows.append([label, cfg["dataset"], level_name(r["level"]), f"{r['completed']}/{r['num_requests']}",
                     _cell(r["request_throughput"]), _cell(r["output_throughput"]),
                     *(_cell(r[k][p]) for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms") for p in ("p50", "p99")),
                     _cell(r["goodput"]), "-" if hit is None else f"{100 * hit:.0f}%"])
    return rows


# ---- command line ------------------------------------------------------------------------------

def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> tuple[ServingConfig, argparse.Namespace]:
    d = ServingConfig()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=d.base_url, help="server root (a trailing /v1 is accepted)")
    ap.add_argument("--model", default=None, help="model id (default: the first one /v1/models lists)")
    ap.add_argument("--label", default=None, help="engine name in the summary, tables and plots")
    g = ap.add_argument_group("dataset (lengths are N or LO:HI tokens)")
    g.add_argument("--dataset", default=d.dataset, choices=DATASETS)
    g.add_argument("--num-requests", type=int, default=d.num_requests, help="random, shared-prefix")
    g.add_argument("--input-len", default=d.input_len, help="random")
    g.add_argument("--output-len", default=d.output_len, help="every dataset; exact with ignore_eos")
    g.add_argument("--num-prefixes", type=int, default=d.num_prefixes, help="shared-prefix")
    g.add_argument("--prefix-len", type=int, default=d.prefix_len, help="shared-prefix")
    g.add_argument("--suffix-len", default=d.suffix_len, help="shared-prefix")
    g.add_argument("--num-sessions", type=int, default=d.num_sessions, help="coding-agent")
    g.add_argument("--turns", type=int, default=d.turns, help="coding-agent: turns per session")
    g.add_argument("--context-len", type=int, default=d.context_len, help="coding-agent: shared repository context")
    g.add_argument("--tool-output-len", default=d.tool_output_len, help="coding-agent: task / tool output per turn")
    g.add_argument("--think-time-ms", type=float, default=d.think_time_ms, help="coding-agent: pause between turns")
    g = ap.add_argument_group("load (a comma list is a sweep)")
    g.add_argument("--arrival", default=None, choices=["poisson", "constant", "concurrency"],
                   help="default: concurrency if only --concurrencies is given, else poisson")
    g.add_argument("--request-rates", type=_floats, default=None, help="sessions (= requests, for 1-turn datasets) per second")
    g.add_argument("--concurrencies", type=_ints, default=None, help="sessions in flight; with a rate, a cap")
    g.add_argument("--sweep", action="store_true",
                   help=f"default load levels when none are given: rates {','.join(map(str, SWEEP_RATES))} (a comma list already sweeps)")
    g = ap.add_argument_group("requests")
    g.add_argument("--prompt-format", default=d.prompt_format, choices=["token-ids", "text"])
    g.add_argument("--tokenizer", default=None, help="tokenizer.json (or its folder): exact text lengths, no special ids")
    g.add_argument("--token-id-range", default="100:8000", help="ids drawn without a tokenizer, LO:HI")
    g.add_argument("--temperature", type=float, default=d.temperature)
    g.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos / min_tokens")
    g.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    g.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds to connect, and the longest silence in a stream, before a request fails")
    g.add_argument("--warmup", type=int, default=d.warmup)
    g.add_argument("--seed", type=int, default=d.seed)
    g = ap.add_argument_group("output")
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument("--json", default=None, help="write config + all results here")
    g.add_argument("--plot", default=None, help="PNG of throughput and latency against load")
    a = ap.parse_args(argv)
    arrival = a.arrival or ("concurrency" if a.concurrencies and not a.request_rates else "poisson")
    if arrival != "concurrency" and a.concurrencies and len(a.concurrencies) > 1:
        ap.error("with a request rate, --concurrencies is one cap, not a sweep")
    cfg = ServingConfig(
        base_url=a.base_url, model=a.model, label=a.label, dataset=a.dataset, num_requests=a.num_requests,
        input_len=a.input_len, output_len=a.output_len, num_prefixes=a.num_prefixes, prefix_len=a.prefix_len,
        suffix_len=a.suffix_len, num_sessions=a.num_sessions, turns=a.turns, context_len=a.context_len,
        tool_output_len=a.tool_output_len, think_time_ms=a.think_time_ms, arrival=arrival,
        request_rates=a.request_rates or (list(SWEEP_RATES) if a.sweep and not a.concurrencies else [1.0]), concurrencies=a.concurrencies or [], prompt_format=a.prompt_format,
        tokenizer=a.tokenizer, token_id_range=_span(a.token_id_range), temperature=a.temperature,
        ignore_eos=not a.no_ignore_eos, extra_body=a.extra_body, slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms,
        warmup=a.warmup, timeout_s=a.timeout, seed=a.seed,
    )
    return cfg, a


def main(argv: list[str] | None = None) -> None:
    cfg, a = parse_args(argv)
    out = run(cfg)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if a.plot:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from plot_serving import plot

        plot([out], a.plot)
    if any(r["failed"] for r in out["results"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
