"""benchmarks/serving.py against a live `cuttle serve` on the embedded model: every dataset and
arrival mode yields sane metrics, shared prefixes show up as cached tokens, text prompts have
exact token lengths, and failing endpoints are counted, not raised."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time

import httpx
import pytest
from server_fixture import free_port

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import serving
from serving import ServingConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as f:  # a file, not a pipe: a pipe nobody reads would block the server once full
        proc = subprocess.Popen([sys.executable, "-m", "cuttle.engine.cli", "serve", "--port", str(port), "--num-kv-blocks", "256",
                                 "--max-num-seqs", "8"], stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def small(url: str, **kw) -> ServingConfig:
    base = dict(base_url=url, num_requests=4, input_len="16:48", output_len="6", warmup=1, timeout_s=120)
    return ServingConfig(**{**base, **kw})


def check_sane(r: dict, n: int) -> None:
    assert (r["num_requests"], r["completed"], r["failed"]) == (n, n, 0), r["errors"]
    assert r["short_outputs"] == 0
    for q in r["requests"]:
        assert q["ok"] and q["output_tokens"] == q["expected_output_tokens"]
        assert 0 < q["ttft"] <= q["e2e"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = r[key]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], (key, s)
    assert r["ttft_ms"]["p50"] <= r["e2e_ms"]["p50"]
    assert r["total_output_tokens"] == sum(q["expected_output_tokens"] for q in r["requests"])
    assert r["request_throughput"] > 0 and r["output_throughput"] > 0 and r["input_throughput"] > 0
    assert r["tokens_per_chunk"] == 1.0  # cuttle streams every token as its own event, so ITL is per token


@pytest.mark.parametrize("arrival", ["poisson", "constant"])
def test_random_at_a_rate(server, arrival):
    out = serving.run(small(server, arrival=arrival, request_rates=[20.0], slo_ttft_ms=1e6, slo_tpot_ms=1e6), log=lambda s: None)
    assert out["config"]["model"] == "cuttle-tiny-coder" and len(out["results"]) == 1
    r = out["results"][0]
    check_sane(r, 4)
    assert r["good_requests"] == 4  # an SLO nothing can miss
    starts = sorted(q["start"] for q in r["requests"])
    if arrival == "constant":  # one every 50 ms, none before its time
        assert all(t >= 0.05 * i - 0.005 for i, t in enumerate(starts)), starts


def test_concurrency_sweep_and_summary(server, tmp_path):
    out = serving.run(small(server, arrival="concurrency", concurrencies=[1, 3], num_requests=3, slo_ttft_ms=0.001),
                      log=lambda s: None)
    assert [r["level"]["concurrency"] for r in out["results"]] == [1, 3]
    for r in out["results"]:
        check_sane(r, 3)
        assert r["good_requests"] == 0 and r["goodput"] == 0.0  # a 1 us TTFT SLO is never met
    one = out["results"][0]["requests"]  # one in flight: each request starts after the previous ended
    for a, b in itertools.pairwise(one):
        assert b["start"] >= a["start"] + a["e2e"] - 1e-3
    text = serving.format_summary(out["results"][1], "cuttle", "random")
    assert "concurrency 3" in text and "TTFT" in text and "3/3 ok" in text
    rows = serving.table_rows(out)
    assert len(rows) == 2 and len(rows[0]) == len(serving.TABLE_HEADERS)
    from plot_serving import plot

    plot([out, {**out, "config": {**out["config"], "label": "again"}}], str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_shared_prefix_hits_the_cache(server):
    cfg = small(server, dataset="shared-prefix", num_prefixes=1, prefix_len=64, suffix_len="4:12",
                arrival="concurrency", concurrencies=[1])
    r = serving.run(cfg, log=lambda s: None)["results"][0]
    check_sane(r, 4)
    cached = [q["cached_tokens"] for q in r["requests"]]
    assert cached[0] == 0 and all(c >= 64 for c in cached[1:]), cached  # the prefix is 4 full blocks
    assert r["cached_tokens"] == sum(cached) and r["cache_hit_frac"] > 0


def test_coding_agent_turns_build_on_replies(server):
    # sessions start 2 s apart (and then overlap): two prefills of one uncached prefix in the same
    # engine step both compute it, so only a later session can find the repository cached
    cfg = small(server, dataset="coding-agent", num_sessions=2, turns=3, context_len=64, tool_output_len="8:16",
                output_len="4", arrival="constant", request_rates=[0.5], concurrencies=[2])
    r = serving.run(cfg, log=lambda s: None)["results"][0]
    check_sane(r, 6)
    for s in (0, 1):
        turns = sorted((q for q in r["requests"] if q["session"] == s), key=lambda q: q["turn"])
        assert [q["turn"] for q in turns] == [0, 1, 2]
        for a, b in itertools.pairwise(turns):
            assert b["start"] >= a["start"] + a["e2e"] - 1e-3  # the next turn waits for the reply
            assert b["prompt_tokens"] >= a["prompt_tokens"] + 4 + 8  # history + reply + tool output
            # the whole previous turn (prompt and reply, less the last sampled token) was cached
            assert b["cached_tokens"] >= (a["prompt_tokens"] + 4 - 1) // 16 * 16
    second = next(q for q in r["requests"] if q["session"] == 1 and q["turn"] == 0)
    assert second["cached_tokens"] >= 64  # the shared repository


def test_text_prompts_have_exact_lengths(server):
    from cuttle.engine.default_model import DEFAULT_MODEL_DIR

    cfg = small(server, prompt_format="text", tokenizer=DEFAULT_MODEL_DIR, input_len="24", request_rates=[50.0])
    r = serving.run(cfg, log=lambda s: None)["results"][0]
    check_sane(r, 4)
    assert [q["prompt_tokens"] for q in r["requests"]] == [24] * 4


def test_failures_are_counted_not_raised(server):
    dead = serving.run(small(f"http://127.0.0.1:{free_port()}", model="x", warmup=0, request_rates=[100.0]), log=lambda s: None)
    r = dead["results"][0]
    assert (r["completed"], r["failed"]) == (0, 4) and "ConnectError" in next(iter(r["errors"]))
    assert r["ttft_ms"]["p50"] is None and r["request_throughput"] == 0
    # ids past the vocabulary: cuttle answers 400 with its reason, which the run keeps
    bad = serving.run(small(server, token_id_range=(9000, 9100), warmup=0, request_rates=[100.0]), log=lambda s: None)
    r = bad["results"][0]
    assert (r["completed"], r["failed"]) == (0, 4)
    assert all(e.startswith("RuntimeError: HTTP 400") and "prompt token ids" in e for e in r["errors"])
    serving.format_summary(r, "cuttle", "random")


def test_cli_arguments():
    cfg, _ = serving.parse_args(["--concurrencies", "1,4,16", "--dataset", "shared-prefix"])
    assert [lv["concurrency"] for lv in cfg.levels()] == [1, 4, 16] and cfg.arrival == "concurrency"
    cfg, _ = serving.parse_args(["--request-rates", "0.5,2", "--concurrencies", "8"])
    assert cfg.levels() == [{"arrival": "poisson", "rate": 0.5, "concurrency": 8}, {"arrival": "poisson", "rate": 2.0, "concurrency": 8}]
    cfg, _ = serving.parse_args(["--sweep"])
    assert len(cfg.levels()) >= 3


def test_run_all_agent_sessions_fit_the_context():
    import run_all

    for size in ("quick", "standard", "full"):
        w = run_all.workloads(size)
        a, out = w["agent"], int(w["output_len"])
        last_prompt = a["context_len"] + a["turns"] * serving._span(a["tool_output_len"])[1] + (a["turns"] - 1) * out
        assert last_prompt + out <= 4096 and len(w["concurrencies"]) >= 3
