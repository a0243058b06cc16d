"""The OpenAI server driven by the official `openai` client and raw HTTP: completions, chat,
streaming, logprobs, echo, n, seeds, errors, auth, admission, disconnects, metrics."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from server_fixture import LiveServer


@pytest.fixture(scope="module")
def live(qwen3_path):
    with LiveServer(qwen3_path, dtype="float32", num_kv_blocks=256, max_model_len=256) as srv:
        yield srv


@pytest.fixture()
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none")


def test_models_health_metrics(live, client):
    assert [m.id for m in client.models.list().data] == ["test-model"]
    assert httpx.get(live.url + "/health").status_code == 200
    text = httpx.get(live.url + "/metrics").text
    for name in ("cuttle_num_requests_running", "cuttle_kv_cache_usage_perc", "cuttle_prefix_cache_hit_rate",
                 "cuttle_time_to_first_token_seconds", "cuttle_inter_token_latency_seconds", "cuttle_e2e_request_latency_seconds",
                 "cuttle_graph_steps_total"):
        assert name in text
    # running totals are counters (they were gauges, so rate() misread them), named as vLLM's
    from prometheus_client.parser import text_string_to_metric_families

    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    for name in ("cuttle_prompt_tokens", "cuttle_generation_tokens", "cuttle_num_preemptions", "cuttle_graph_steps",
                 "cuttle_kv_window_released_blocks", "cuttle_squid_documents", "cuttle_squid_document_tokens", "cuttle_requests", "cuttle_client_disconnects"):
        assert types.get(name) == "counter", (name, types.get(name))
    assert types["cuttle_num_requests_running"] == "gauge" and "cuttle_prompt_tokens_total" in text


def test_completion_matches_offline_engine(live, client, qwen3_path):
    from cuttle.engine import LLM, SamplingParams

    r = client.completions.create(model="test-model", prompt=[5, 6, 7, 8], max_tokens=10, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    ref = LLM(qwen3_path, dtype="float32", num_kv_blocks=64).generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    ch = r.choices[0]
    assert ch.model_extra["token_ids"] == ref.outputs[0].token_ids
    assert ch.text == ref.outputs[0].text and ch.finish_reason == "length"
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 10


def test_completion_logprobs_echo_n_and_seed(client):
    r = client.completions.create(model="test-model", prompt="a b c d", max_tokens=5, temperature=0, logprobs=2, echo=True,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert len(lp.tokens) == 4 + 5 and r.choices[0].text.startswith("a b c d")
    assert all(len(t) >= 2 for t in lp.top_logprobs[1:])
    r3 = client.completions.create(model="test-model", prompt="a b c", max_tokens=8, temperature=1.0, n=3, seed=7,
                                   extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r3.choices) == [0, 1, 2]
    assert len({c.text for c in r3.choices}) == 3
    again = client.completions.create(model="test-model", prompt="a b c", max_tokens=8, temperature=1.0, n=3, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r3.choices]
    multi = client.completions.create(model="test-model", prompt=["a b", "c d e"], max_tokens=3, temperature=0)
    assert sorted(c.index for c in multi.choices) == [0, 1]
    # streamed echo + logprobs: the prompt's tokens and logprobs come in the first chunk (they were dropped)
    chunks = list(client.completions.create(model="test-model", prompt="a b c d", max_tokens=5, temperature=0, logprobs=2,
                                            echo=True, stream=True, extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    # a truncated prompt echoes what was kept (the whole prompt was echoed beside one prompt token)
    t = client.completions.create(model="test-model", prompt="a b c d", max_tokens=2, temperature=0, logprobs=0, echo=True,
                                  extra_body={"truncate_prompt_tokens": 1, "ignore_eos": True})
    assert t.usage.prompt_tokens == 1 and t.choices[0].text.startswith("d") and t.choices[0].logprobs.tokens[0] == "d"


def test_streaming_completion_equals_non_streaming(client):
    kw = dict(model="test-model", prompt="x y z", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_plain_and_streaming(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "a b c d e f g h i j k l m n o p q r s t u v"}]}]
    r = client.chat.completions.create(model="test-model", messages=msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in ("stop", "length")
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
    stream = client.chat.completions.create(model="test-model", messages=msgs, max_tokens=8, temperature=0, stream=True)
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == text
    again = client.chat.completions.create(model="test-model", messages=msgs, max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def raw(live, path: str, body, headers=None) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(live.url + path, content=data, headers={"content-type": "application/json", **(headers or {})}, timeout=30)


def test_unknown_model_is_a_404(live):
    """As vLLM and OpenAI answer it (the official client raises NotFoundError)."""
    r = raw(live, "/v1/completions", {"model": "nope", "prompt": "a"})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["param"] == "model" and err["code"] == "model_not_found" and "'test-model'" in err["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", {"model": "test-model"}, "prompt"),
    ("/v1/chat/completions", {"model": "test-model"}, "messages"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 7}, "top_p"),
    ("/v1/completions", {"prompt": "a", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "a " * 300, "max_tokens": 4}, None),
    ("/v1/completions", {"prompt": "a", "max_tokens": 400}, None),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
])
def test_errors_are_openai_shaped_400s(live, path, body, param):
    r = raw(live, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param
    assert raw(live, "/v1/completions", {"prompt": "a", "max_tokens": 2}).status_code == 200  # still serving


def test_api_key_and_admission_limit(qwen3_path):
    with LiveServer(qwen3_path, api_key="sekret", max_pending=1, dtype="float32", num_kv_blocks=64, max_model_len=128) as srv:
        assert raw(srv, "/v1/completions", {"prompt": "a"}).status_code == 401
        assert raw(srv, "/v1/completions", {"prompt": "a"}, {"authorization": "Bearer wrong"}).status_code == 401
        ok = raw(srv, "/v1/completions", {"prompt": "a", "max_tokens": 2}, {"authorization": "Bearer sekret"})
        assert ok.status_code == 200
        # hold the single admission slot: pause stepping, so the first request stays in flight
        srv.engine.pause()
        held: dict = {}
        t = threading.Thread(target=lambda: held.update(r=raw(srv, "/v1/completions", {"prompt": "a", "max_tokens": 3},
                                                              {"authorization": "Bearer sekret"})))
        t.start()
        import time

        while srv.engine.num_in_flight == 0:
            time.sleep(0.01)
        busy = raw(srv, "/v1/completions", {"prompt": "b", "max_tokens": 2}, {"authorization": "Bearer sekret"})
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["type"] == "server_busy"
        srv.engine.resume()
        t.join(30)
        assert held["r"].status_code == 200 and held["r"].json()["usage"]["completion_tokens"] >= 1
        assert raw(srv, "/v1/completions", {"prompt": "b", "max_tokens": 2}, {"authorization": "Bearer sekret"}).status_code == 200


def test_32_streaming_clients_with_disconnects(live):
    async def one(i: int, client: httpx.AsyncClient) -> tuple[int, str]:
        body = {"prompt": f"a b {i}", "max_tokens": 40, "temperature": 0, "stream": True, "ignore_eos": True}
        text = ""
        async with client.stream("POST", live.url + "/v1/completions", json=body, timeout=120) as r:
            n = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                n += 1
                text += json.loads(line[6:])["choices"][0]["text"]
                if i % 4 == 0 and n == 3:
                    return i, "disconnected"
        return i, text

    async def run() -> list[tuple[int, str]]:
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(i, client) for i in range(32)))

    results = asyncio.run(run())
    whole = {}
    for i, text in results:
        if i % 4:
            ref = raw(live, "/v1/completions", {"prompt": f"a b {i}", "max_tokens": 40, "temperature": 0, "ignore_eos": True}).json()
            whole[i] = ref["choices"][0]["text"]
            assert text == whole[i]
    import time

    for _ in range(100):  # aborts land within an engine step; the loop may be mid-step
        s = live.engine.stats_snapshot
        if s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_requests_running"] == 0:
            break
        time.sleep(0.05)
    assert live.engine.stats_snapshot["kv_blocks_free"] == live.engine.stats_snapshot["kv_blocks_total"]
    assert live.engine.num_in_flight == 0


def test_requests_that_finish_queue_no_abort(live, client, monkeypatch):
    """A request read to its final output must not abort itself afterwards (a streamed chat did:
    the generator marked itself finished only after handing out the final item)."""
    eng = live.llm.engine
    calls: list[str] = []
    real = eng.abort_request
    monkeypatch.setattr(eng, "abort_request", lambda rid: (calls.append(rid), real(rid))[1])
    kw = {"max_tokens": 6, "temperature": 0}
    list(client.completions.create(model="test-model", prompt="a b", stream=True, **kw))
    list(client.completions.create(model="test-model", prompt=["a b", "c d"], n=2, stream=True, **kw))
    list(client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "a b"}], stream=True, **kw))
    client.completions.create(model="test-model", prompt=["a b", "c"], **kw)
    client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "a b"}], n=2, **kw)
    assert raw(live, "/v1/rl/generate", {"prompts": [[5, 6]], "sampling_params": {"n": 2, "max_tokens": 4}}).status_code == 200
    # a last request: an abort queued by any of the above runs before this one's first step
    assert raw(live, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200
    assert calls == []


@pytest.mark.parametrize("path,field,value", [
    *[("/v1/chat/completions", f, v) for f, v in [
        ("guided_json", {"type": "object"}), ("guided_regex", "a+"), ("guided_choice", ["a", "b"]), ("guided_grammar", "root ::= 'a'"),
        ("guided_decoding_backend", "outlines"), ("guided_whitespace_pattern", " "), ("structured_outputs", {"json": {}}),
        # the test model's template reads no enable_thinking; a request's own template needs --trust-request-chat-template
        ("chat_template_kwargs", {"enable_thinking": False}), ("chat_template", "{{ x }}"), ("parallel_tool_calls", False),
        ("logit_bias", {"5": 101}), ("best_of", 2), ("functions", [{"name": "f"}]),
        ("store", True), ("reasoning_effort", "low"), ("length_penalty", 0.5), ("no_such_field", 1)]],
    *[("/v1/completions", f, v) for f, v in [
        ("guided_json", {"type": "object"}), ("guided_choice", ["a"]), ("suffix", "tail"), ("logit_bias", {"5": 101}),
        ("best_of", 3), ("priority", 1), ("length_penalty", 0.5), ("logprob_token_ids", [1]), ("no_such_field", 1)]],
])
def test_unimplemented_fields_are_refused_naming_them(live, path, field, value):
    body = {"messages": [{"role": "user", "content": "a"}]} if "chat" in path else {"prompt": "a"}
    r = raw(live, path, {**body, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_metadata_fields_and_off_values_are_accepted(live, path):
    """The fields listed in openai_protocol.IGNORED_FIELDS (nothing about the output depends on
    them) and unimplemented knobs at the value that means "off" are accepted; null is absent."""
    from cuttle.engine.openai_protocol import IGNORED_FIELDS

    body = {"messages": [{"role": "user", "content": "a b"}], "parallel_tool_calls": True, "echo": False} if "chat" in path else {"prompt": "a b", "suffix": ""}
    body.update({"max_tokens": 3, "temperature": 0, "ignore_eos": True, "user": "u-1", "safety_identifier": "s", "metadata": {"k": "v"},
                 "prompt_cache_key": "p", "store": False, "logit_bias": {}, "best_of": 1, "guided_json": None, "seed": None})
    assert set(IGNORED_FIELDS) <= set(body)
    r = raw(live, path, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def _events(r: httpx.Response) -> list[dict]:
    lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_streams_carry_only_new_tokens(live, monkeypatch):
    """A streamed request asks the engine for DELTA outputs: each output object carries the one
    token its step sampled and that token's text, not everything so far (O(L) per stream, not
    O(L^2)); together they are the whole completion, and the stream equals the non-streamed one."""
    seen: dict[str, list] = {}
    real = live.engine._deliver

    def spy(rid, item):
        if not isinstance(item, BaseException):
            seen.setdefault(rid, []).append(item)
        real(rid, item)

    monkeypatch.setattr(live.engine, "_deliver", spy)
    body = {"prompt": "a b c", "max_tokens": 48, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = raw(live, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    whole = raw(live, "/v1/completions", body).json()
    events = _events(r)
    [rid] = [k for k, outs in seen.items() if len(outs) > 1]
    per_step = [o.outputs[0] for o in seen[rid]]
    assert len(per_step) == 48 and all(len(c.token_ids) == 1 for c in per_step)
    assert [t for c in per_step for t in c.token_ids] == whole["choices"][0]["token_ids"]
    assert "".join(c.text for c in per_step) == whole["choices"][0]["text"]
    assert max(len(c.text) for c in per_step) < len(whole["choices"][0]["text"]) / 8
    assert [t for e in events for ch in e["choices"] for t in ch["token_ids"]] == whole["choices"][0]["token_ids"]
    assert events[-1]["usage"] == whole["usage"]


def test_chat_return_token_ids(live, qwen3_path):
    """vLLM's `return_token_ids` on chat (RL frameworks read the exact ids rather than tokenizing
    the text again): the prompt's ids beside the choices are the rendered template's
    (transformers' apply_chat_template), each choice's ids are the ones sampled (what a completion
    of those prompt ids samples, same seed); streamed, the first chunk alone carries the prompt's
    ids and the chunks' ids add up to the whole; without the field, neither appears."""
    from transformers import PreTrainedTokenizerFast

    messages = [{"role": "user", "content": "a b c"}]
    body = {"model": "test-model", "messages": messages, "max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 2,
            "ignore_eos": True, "return_token_ids": True, "logprobs": True}
    whole = raw(live, "/v1/chat/completions", body).json()
    hf = PreTrainedTokenizerFast(tokenizer_file=f"{qwen3_path}/tokenizer.json", eos_token="<|im_end|>",
                                 chat_template=live.llm.engine.tokenizer.chat_template)
    want_prompt = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert whole["prompt_token_ids"] == list(want_prompt) and whole["usage"]["prompt_tokens"] == len(want_prompt)
    completion = raw(live, "/v1/completions", {"model": "test-model", "prompt": whole["prompt_token_ids"], "max_tokens": 12,
                                               "temperature": 1.0, "seed": 5, "n": 2, "ignore_eos": True, "return_token_ids": True}).json()
    by_index = {c["index"]: c for c in completion["choices"]}
    for ch in whole["choices"]:
        assert len(ch["token_ids"]) == 12 and ch["token_ids"] == by_index[ch["index"]]["token_ids"]
        assert ch["message"]["content"] == by_index[ch["index"]]["text"]
        assert [e["token"] for e in ch["logprobs"]["content"]] == [live.llm.engine.tokenizer.decode([t], False) for t in ch["token_ids"]]
    events = _events(raw(live, "/v1/chat/completions", {**body, "stream": True}))
    assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"] and all("prompt_token_ids" not in e for e in events[1:])
    assert [ch["delta"].get("role") for ch in events[0]["choices"]] == ["assistant", "assistant"]
    for ch in whole["choices"]:
        mine = [c for e in events[1:] for c in e["choices"] if c["index"] == ch["index"]]
        assert [t for c in mine for t in c["token_ids"]] == ch["token_ids"]
    plain = raw(live, "/v1/chat/completions", {**body, "return_token_ids": False}).json()
    assert "prompt_token_ids" not in plain and all("token_ids" not in ch for ch in plain["choices"])
    # streamed completions: each choice's first chunk carries its prompt's ids, as vLLM's
    cevents = _events(raw(live, "/v1/completions", {"model": "test-model", "prompt": ["a b", "c d e"], "max_tokens": 3,
                                                     "stream": True, "return_token_ids": True, "ignore_eos": True}))
    firsts = {}
    for e in cevents:
        for c in e["choices"]:
            if c["index"] not in firsts:
                firsts[c["index"]] = c.get("prompt_token_ids")
            else:
                assert "prompt_token_ids" not in c
    tok = live.llm.engine.tokenizer
    assert firsts == {0: tok.encode("a b"), 1: tok.encode("c d e")}


def test_streamed_samples_finish_once_and_equal_non_streamed(live):
    """n = 3 samples that end at different steps (a stop token): each streamed choice sends its
    finish_reason once, and its text, token ids and logprobs equal the non-streamed ones."""
    base = {"prompt": "a b c", "n": 3, "seed": 11, "temperature": 1.0, "max_tokens": 24, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 1}
    probe = raw(live, "/v1/completions", base).json()["choices"]
    body = {**base, "stop_token_ids": [probe[0]["token_ids"][3]]}  # sample 0 stops at its 4th token
    whole = sorted(raw(live, "/v1/completions", body).json()["choices"], key=lambda c: c["index"])
    lengths = [len(c["token_ids"]) for c in whole]
    assert lengths[0] == 4 and max(lengths) == 24
    events = _events(raw(live, "/v1/completions", {**body, "stream": True}))
    for c in whole:
        mine = [ch for e in events for ch in e["choices"] if ch["index"] == c["index"]]
        assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == [c["finish_reason"]]
        assert mine[-1]["finish_reason"] == c["finish_reason"]
        assert "".join(ch["text"] for ch in mine) == c["text"]
        assert [t for ch in mine for t in ch["token_ids"]] == c["token_ids"]
        assert [x for ch in mine for x in ch["logprobs"]["token_logprobs"]] == c["logprobs"]["token_logprobs"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats(live, path):
    """vLLM's stream_options.continuous_usage_stats: every choice's event carries its prompt's
    tokens and its sample's tokens so far; the final usage event is the request's; without
    include_usage it is refused (vLLM drops it silently)."""
    body = {"messages": [{"role": "user", "content": "a b"}]} if "chat" in path else {"prompt": ["a b", "c d e"]}
    body = {**body, "model": "test-model", "max_tokens": 4, "n": 2, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = _events(raw(live, path, body))
    last: dict[tuple[int, int], int] = {}
    prompts: dict[int, int] = {}
    for e in events[:-1]:
        for ch in e["choices"]:
            if "chat" in path and ch["delta"].get("role"):
                continue  # the opening event (role only) comes before any output
            u = e["usage"]
            key = (ch["index"], 0)
            assert u["completion_tokens"] >= last.get(key, 0) and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
            last[key] = u["completion_tokens"]
            prompts[ch["index"]] = u["prompt_tokens"]
    assert sorted(last.values()) == [4] * len(last) and len(last) == (2 if "chat" in path else 4)
    final = events[-1]["usage"]
    assert final["completion_tokens"] == sum(last.values())
    if "chat" not in path:  # choices 0-1 are the first prompt's, 2-3 the second's
        assert prompts[0] == prompts[1] and prompts[2] == prompts[3] and final["prompt_tokens"] == prompts[0] + prompts[2]
    no_usage = raw(live, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert no_usage.status_code == 400 and no_usage.json()["error"]["param"] == "stream_options"
