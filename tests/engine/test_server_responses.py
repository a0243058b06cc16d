"""POST /v1/responses (engine/server/responses.py) against its oracle, the chat route: the same
conversation gives the same prompt, text, reasoning split, tool calls and logprobs; the event
stream parses as the `openai` SDK's types, in order, and adds up to the whole response; tool
calls round-trip through input items and through `previous_response_id` as prefix-cache hits;
the store answers GET / DELETE; every field cuttle cannot honour is a 400 naming it."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from server_fixture import named_events, thinking_fixtures


BS = 4
WEATHER_CHAT = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                                  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
WEATHER = [{"type": "function", "name": "get_weather", "description": "weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
THOUGHT = "<think>\nWhere is Paris?\n</think>\n\nIt is sunny."
SCRIPTS = {301: CALL, 302: "It is sunny.", 303: THOUGHT}
EVENTS = TypeAdapter(ResponseStreamEvent)


checkpoint, live, thinking = thinking_fixtures("qwen3_responses", SCRIPTS, BS)


def post(srv, body: dict, path: str = "/v1/responses") -> httpx.Response:
    return httpx.post(srv.url + path, json={"model": "test-model", **body}, timeout=120)


def events(srv, body: dict) -> list[dict]:
    """A streamed response's events, each checked against the SDK's event types and its SSE name."""
    out = []
    for obj in named_events(srv, "/v1/responses", body):
        # usage is checked apart (`checked`): the SDK requires cache_write_tokens
        EVENTS.validate_python({**obj, "response": {**obj["response"], "usage": None}} if "response" in obj else obj)
        if obj["type"] in ("response.completed", "response.incomplete"):
            checked(obj["response"])
        out.append(obj)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def checked(resp: dict) -> dict:
    """The response object as the SDK's `Response` type reads it. Usage is checked apart: the SDK
    requires `cache_write_tokens`, a count cuttle does not keep (see docs/server.md)."""
    Response.model_validate({**resp, "usage": None})
    u = resp["usage"]
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    return resp


def chat(srv, messages: list[dict], **kw) -> dict:
    r = post(srv, {"messages": messages, **kw}, "/v1/chat/completions")
    assert r.status_code == 200, r.text
    return r.json()


def assert_same_logprobs(got: list[dict], ref: list[dict]) -> None:
    """Same tokens and ranks, logprobs within fp32 rounding (one side may reuse the other's
    prefix-cached KV, computed in another chunking)."""
    def flat(lps):
        return [(e["token"], e["bytes"], [t["bytes"] for t in e["top_logprobs"]]) for e in lps]

    def values(lps):
        return [v for e in lps for v in [e["logprob"]] + [t["logprob"] for t in e["top_logprobs"]]]

    assert flat(got) == flat(ref) and len(got) > 0
    assert values(got) == pytest.approx(values(ref), abs=1e-5)


def message_text(resp: dict) -> str:
    return "".join(p["text"] for i in resp["output"] if i["type"] == "message" for p in i["content"])


def text_of_stream(evs: list[dict]) -> str:
    return "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")


@pytest.mark.parametrize("stream", [False, True])
def test_text_equals_chat(live, stream):
    """Instructions + a user message: the prompt, text and logprobs of the chat request with a
    system message and that user message (greedy, no EOS, so both run the full length)."""
    inp = [{"role": "user", "content": [{"type": "input_text", "text": "Say "}, {"type": "input_text", "text": "hello"}]}]
    body = {"instructions": "Be brief.", "input": inp, "max_output_tokens": 12, "temperature": 0, "ignore_eos": True,
            "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    ref = chat(live, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}], max_tokens=12,
               temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2)
    ref_text, ref_lps = ref["choices"][0]["message"]["content"], ref["choices"][0]["logprobs"]["content"]
    if stream:
        evs = events(live, body)
        assert [e["type"] for e in evs[:4]] == ["response.created", "response.in_progress", "response.output_item.added",
                                                "response.content_part.added"]
        assert [e["type"] for e in evs[-4:]] == ["response.output_text.done", "response.content_part.done",
                                                 "response.output_item.done", "response.incomplete"]
        resp = evs[-1]["response"]
        assert text_of_stream(evs) == ref_text
        assert_same_logprobs([lp for e in evs if e["type"] == "response.output_text.delta" for lp in e["logprobs"]], ref_lps)
    else:
        r = post(live, body)
        assert r.status_code == 200, r.text
        resp = r.json()
    checked(resp)
    assert message_text(resp) == ref_text
    assert_same_logprobs(resp["output"][0]["content"][0]["logprobs"], ref_lps)
    # ran to max_output_tokens: incomplete, as OpenAI reports it
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["usage"]["input_tokens"] == ref["usage"]["prompt_tokens"]
    assert resp["usage"]["output_tokens"] == 12
    assert resp["instructions"] == "Be brief." and resp["temperature"] == 0


def test_official_client_reads_text_and_stream(live):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="none")
    r = client.responses.create(model="test-model", input="Weather?", extra_body={"seed": 302})
    assert r.output_text == "It is sunny." and r.status == "completed"
    with client.responses.stream(model="test-model", input="Weather?", extra_body={"seed": 302}) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == final.output_text == "It is sunny."
    # a function call streams its arguments as written: the client's accumulator rebuilds the item
    with client.responses.stream(model="test-model", input="Weather in Paris? (sdk stream)", tools=WEATHER,
                                 extra_body={"seed": 301}) as s:
        pieces = [e.delta for e in s if e.type == "response.function_call_arguments.delta"]
        final = s.get_final_response()
    [call] = [i for i in final.output if i.type == "function_call"]
    assert len(pieces) > 1 and "".join(pieces) == call.arguments and json.loads(call.arguments) == {"city": "Paris"}
    assert call.status == "completed" and call.name == "get_weather"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip_is_a_prefix_cache_hit(live, stream):
    """A function_call item, its output sent back (as items, or after previous_response_id), and
    the next turn's prompt hits the prefix cache for the whole first turn: the model's exact text
    of the call is replayed, as on chat."""
    user = [{"role": "user", "content": f"Weather in Paris? ({'streamed' if stream else 'whole'} responses)"}]
    first = {"input": user, "tools": WEATHER}
    if stream:
        evs = events(live, {**first, "seed": 301})
        resp = evs[-1]["response"]
        assert evs[-1]["type"] == "response.completed"
        done = [e for e in evs if e["type"] == "response.function_call_arguments.done"]
        assert [json.loads(e["arguments"]) for e in done] == [{"city": "Paris"}]
    else:
        resp = post(live, {**first, "seed": 301}).json()
    checked(resp)
    # the prompt's full blocks not found in the cache are written to it (cache_write_tokens)
    details, n_in = resp["usage"]["input_tokens_details"], resp["usage"]["input_tokens"]
    assert details["cache_write_tokens"] == n_in // BS * BS - details["cached_tokens"] > 0
    calls = [i for i in resp["output"] if i["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert resp["output"][-1]["type"] == "function_call"  # no text before the call, so no message item
    prompt_then_call = resp["usage"]["input_tokens"] + resp["usage"]["output_tokens"] - 1  # less the end-of-turn token
    answer = {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "sunny, 21 C"}
    # the oracle: chat's count of the same conversation
    chat_msgs = user + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": calls[0]["call_id"], "type": "function", "function": {"name": "get_weather", "arguments": calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": calls[0]["call_id"], "content": "sunny, 21 C"}]
    counted = httpx.post(live.url + "/tokenize", json={"messages": chat_msgs, "tools": WEATHER_CHAT}, timeout=60).json()["count"]
    # items sent back: the whole first turn hits; then the same conversation by previous_response_id
    # hits all of that prompt (the engine always computes its last token)
    for second, hit in (({"input": user + [dict(c) for c in resp["output"]] + [answer]}, prompt_then_call // BS * BS),
                        ({"input": [answer], "previous_response_id": resp["id"]}, (counted - 1) // BS * BS)):
        r = post(live, {**second, "tools": WEATHER, "seed": 302})
        assert r.status_code == 200, r.text
        out = checked(r.json())
        assert message_text(out) == "It is sunny."
        assert out["usage"]["input_tokens"] == counted
        assert out["usage"]["input_tokens_details"]["cached_tokens"] == hit


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_item_equals_chat_reasoning_content(thinking, stream):
    body = {"input": "Weather in Paris?", "seed": 303}
    ref = chat(thinking, [{"role": "user", "content": "Weather in Paris?"}], seed=303)["choices"][0]["message"]
    assert ref["reasoning_content"] and ref["content"]
    if stream:
        evs = events(thinking, body)
        assert "".join(e["delta"] for e in evs if e["type"] == "response.reasoning_text.delta") == ref["reasoning_content"]
        assert text_of_stream(evs) == ref["content"]
        resp = evs[-1]["response"]
    else:
        resp = post(thinking, body).json()
    checked(resp)
    assert [i["type"] for i in resp["output"]] == ["reasoning", "message"]
    assert resp["output"][0]["content"] == [{"type": "reasoning_text", "text": ref["reasoning_content"]}]
    assert message_text(resp) == ref["content"]
    tok = thinking.llm.engine.tokenizer
    assert resp["usage"]["output_tokens_details"]["reasoning_tokens"] == len(tok.encode(THOUGHT.split("\n\n")[0], add_special_tokens=False))


def test_reasoning_sent_back_is_rendered_for_the_turn(thinking):
    """A reasoning item in the input becomes the next assistant turn's reasoning_content: the
    prompt equals chat's with that field."""
    inp = [{"role": "user", "content": "Hi"}, {"type": "reasoning", "id": "rs_1", "summary": [],
                                               "content": [{"type": "reasoning_text", "text": "greet back"}]},
           {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
           {"role": "user", "content": "Weather?"}]
    r = post(thinking, {"input": inp, "seed": 302, "reasoning": {"effort": "none"}})
    assert r.status_code == 200, r.text
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
            {"role": "user", "content": "Weather?"}]
    ref = chat(thinking, msgs, seed=302, chat_template_kwargs={"enable_thinking": False})
    assert r.json()["usage"]["input_tokens"] == ref["usage"]["prompt_tokens"]
    assert message_text(r.json()) == ref["choices"][0]["message"]["content"]


def test_json_schema_text_format(live):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    r = post(live, {"input": "A verdict as JSON", "max_output_tokens": 40, "temperature": 0,
                    "text": {"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}}})
    assert r.status_code == 200, r.text
    resp = checked(r.json())
    assert resp["status"] == "completed"
    assert set(json.loads(message_text(resp))) == {"ok"}
    assert resp["text"]["format"]["name"] == "verdict"


def test_store_get_delete_and_chain(live):
    r = post(live, {"input": "Weather?", "seed": 302}).json()
    got = httpx.get(f"{live.url}/v1/responses/{r['id']}", timeout=30)
    assert got.status_code == 200 and got.json() == r
    chained = post(live, {"input": "And tomorrow?", "seed": 302, "previous_response_id": r["id"]}).json()
    assert chained["previous_response_id"] == r["id"]
    assert chained["usage"]["input_tokens"] > r["usage"]["input_tokens"] + r["usage"]["output_tokens"]
    d = httpx.delete(f"{live.url}/v1/responses/{r['id']}", timeout=30)
    assert d.json() == {"id": r["id"], "object": "response.deleted", "deleted": True}
    assert httpx.get(f"{live.url}/v1/responses/{r['id']}", timeout=30).status_code == 404
    gone = post(live, {"input": "x", "previous_response_id": r["id"]})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "previous_response_id"
    unstored = post(live, {"input": "Weather?", "seed": 302, "store": False}).json()
    assert unstored["store"] is False
    assert httpx.get(f"{live.url}/v1/responses/{unstored['id']}", timeout=30).status_code == 404


def test_store_counts_what_a_response_holds(live):
    """The store's bound counts the whole response kept (tools and metadata echoed in it), not only
    its items: tools that never reach the prompt (tool_choice none) cannot grow memory past it."""
    store = live.app.state.response_store
    before = store._bytes
    tools = [{**WEATHER[0], "name": f"tool_{i}", "description": "d" * 100} for i in range(2000)]
    r = post(live, {"input": "Weather?", "seed": 302, "tools": tools, "tool_choice": "none"})
    assert r.status_code == 200, r.text
    assert store._bytes - before >= len(json.dumps(r.json())) >= 200_000


def test_store_is_bounded():
    from cuttle.engine.server.responses import ResponseStore
    s = ResponseStore(max_responses=3, max_bytes=100)
    for i in range(5):
        s.put({"id": f"r{i}"}, [], 10)
    assert len(s) == 3 and s.get("r4") and s._bytes == 30
    s.put({"id": "big"}, [], 90)  # past the byte bound: the oldest go until it fits
    assert len(s) == 2 and s._bytes == 100 and s.get("r4") and s.get("big")
    with pytest.raises(Exception, match="not found"):
        s.get("r3")


REFUSED = [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include"),
    ({"input": "x", "top_logprobs": 3}, "top_logprobs"),
    ({"input": "x", "background": True, "stream": True}, "background"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": WEATHER}, "tool_choice"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "conversation": 5}, "conversation"),
    ({"input": "x", "conversation": {"id": "conv_1", "x": 1}}, "conversation"),
    ({"input": "x", "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"input": "x", "n": 2}, "n"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "abc"}, {"role": "assistant", "content": "x"}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]}, {"role": "assistant", "content": "x"}]},
     "input"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),
    ({}, "input"),
]


@pytest.mark.parametrize("body,param", REFUSED, ids=[f"{p}-{i}" for i, (_, p) in enumerate(REFUSED)])
def test_refused_naming_the_field(live, body, param):
    r = post(live, body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text
    ok = post(live, {"input": "Weather?", "seed": 302})  # and the server goes on serving
    assert ok.status_code == 200 and message_text(ok.json()) == "It is sunny."


def test_logprobs_refused_with_a_reasoning_split(thinking):
    r = post(thinking, {"input": "x", "include": ["message.output_text.logprobs"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "include"


def test_effort_on_a_template_without_it(thinking):
    """The template reads enable_thinking only: effort 'none' turns thinking off (the prompt equals
    chat's with enable_thinking false); any other effort would change nothing and is refused."""
    r = post(thinking, {"input": "Hi", "seed": 302, "reasoning": {"effort": "none"}})
    ref = chat(thinking, [{"role": "user", "content": "Hi"}], seed=302, chat_template_kwargs={"enable_thinking": False})
    assert r.json()["usage"]["input_tokens"] == ref["usage"]["prompt_tokens"]
    assert r.json()["reasoning"]["effort"] == "none"
    bad = post(thinking, {"input": "Hi", "reasoning": {"effort": "low"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning"


CITY = [{"type": "function", "name": "get_weather",
         "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}]


@pytest.mark.parametrize("route", ["chat", "responses"])
def test_parallel_tool_calls_false_ends_the_output_after_one_call(live, route):
    """`parallel_tool_calls: false` is kept by the tool-call grammar (the first call ends the
    output); a bias towards opening calls makes the model write several when it is true."""
    tok = live.llm.engine.tokenizer
    [opener] = tok.encode("<tool_call>", add_special_tokens=False)
    kw = {"temperature": 0, "seed": 5, "logit_bias": {str(opener): 30}}
    counts = {}
    for parallel in (True, False):
        if route == "chat":
            r = chat(live, [{"role": "user", "content": "Weather?"}], tools=[{"type": "function", "function": {
                k: v for k, v in CITY[0].items() if k != "type"}}], max_tokens=150, parallel_tool_calls=parallel, **kw)
            counts[parallel] = len(r["choices"][0]["message"].get("tool_calls") or [])
            if not parallel:
                assert r["choices"][0]["finish_reason"] == "tool_calls"
        else:
            r = post(live, {"input": "Weather?", "tools": CITY, "max_output_tokens": 150, "parallel_tool_calls": parallel, **kw})
            assert r.status_code == 200, r.text
            resp = checked(r.json())
            assert resp["parallel_tool_calls"] is parallel
            counts[parallel] = sum(i["type"] == "function_call" for i in resp["output"])
            if not parallel:
                assert resp["status"] == "completed"
    assert counts[True] >= 2 and counts[False] == 1, counts


def test_developer_items_reach_the_prompt_as_system(live):
    """Codex-style input: a developer message. This template renders no developer role, so the
    message is rendered as the system message (not dropped, as the template alone would)."""
    inp = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
           {"role": "user", "content": "Weather?"}]
    r = post(live, {"input": inp, "seed": 302})
    assert r.status_code == 200, r.text
    ref = chat(live, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}], seed=302)
    bare = chat(live, [{"role": "user", "content": "Weather?"}], seed=302)
    assert r.json()["usage"]["input_tokens"] == ref["usage"]["prompt_tokens"] > bare["usage"]["prompt_tokens"]


def test_input_items_of_a_stored_response(live):
    """GET /v1/responses/{id}/input_items: the request's own input as items with ids (a client's
    id kept), as the SDK's `ResponseItemList` reads them, paged by limit / order / after, and the
    official client's `input_items.list` walks every page."""
    from openai.types.responses.response_item_list import ResponseItemList

    inp = [{"role": "developer", "content": "Be brief."}, {"type": "message", "id": "msg_mine", "role": "user",
                                                          "content": [{"type": "input_text", "text": "Weather?"}]},
           {"role": "assistant", "content": "Where?"}, {"role": "user", "content": "Paris"}]
    r = post(live, {"input": inp, "seed": 302}).json()
    url = f"{live.url}/v1/responses/{r['id']}/input_items"
    whole = httpx.get(url, timeout=30).json()
    ResponseItemList.model_validate(whole)
    assert [i["role"] for i in whole["data"]] == ["user", "assistant", "user", "developer"]  # newest first
    assert whole["data"][2]["id"] == "msg_mine" and whole["has_more"] is False
    assert whole["data"][0]["content"] == [{"type": "input_text", "text": "Paris"}]
    assert whole["data"][1]["content"] == [{"annotations": [], "type": "output_text", "text": "Where?"}]
    page = httpx.get(url, params={"order": "asc", "limit": 2}, timeout=30).json()
    assert [i["role"] for i in page["data"]] == ["developer", "user"] and page["has_more"] is True
    rest = httpx.get(url, params={"order": "asc", "after": page["last_id"]}, timeout=30).json()
    assert [i["role"] for i in rest["data"]] == ["assistant", "user"] and rest["has_more"] is False
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="none")
    assert [i.id for i in client.responses.input_items.list(r["id"], limit=1, order="asc")] == [i["id"] for i in whole["data"][::-1]]
    for bad, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after")):
        e = httpx.get(url, params=bad, timeout=30)
        assert e.status_code == 400 and e.json()["error"]["param"] == param
    assert httpx.get(f"{live.url}/v1/responses/resp_nope/input_items", timeout=30).status_code == 404


def _until_done(srv, rid: str, timeout: float = 60.0) -> dict:
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        r = httpx.get(f"{srv.url}/v1/responses/{rid}").json()
        if r["status"] != "in_progress":
            return r
        time.sleep(0.05)
    raise AssertionError(f"{rid} still in progress")


def test_background_response_is_fetched_when_done(live):
    """background: true answers at once, in_progress; GET later has the same response a
    foreground request gives (same text, usage), and it continues a conversation like any other.
    Through the official client: create(background=True), retrieve, cancel."""
    import openai

    client = openai.OpenAI(base_url=live.url + "/v1", api_key="none")
    body = {"input": "What is the weather?", "seed": 302, "temperature": 1.0, "max_output_tokens": 40}
    fg = checked(post(live, body).json())
    started = client.responses.create(model="test-model", background=True, **{k: v for k, v in body.items() if k != "seed"},
                                      extra_body={"seed": 302})
    assert started.status in ("in_progress", "completed") and started.background is True
    done = _until_done(live, started.id)
    assert done["status"] == "completed" and done["background"] is True
    assert message_text(done) == message_text(fg) == "It is sunny."
    assert done["usage"]["output_tokens"] == fg["usage"]["output_tokens"]
    assert client.responses.retrieve(started.id).status == "completed"
    assert client.responses.cancel(started.id).status == "completed"  # finished: returned as it is
    nxt = checked(post(live, {"input": "And tomorrow?", "previous_response_id": started.id, "seed": 302}).json())
    assert message_text(nxt) == "It is sunny."


def test_background_response_cancelled_mid_generation(live):
    """Cancel stops a background response being generated: status cancelled, its engine request
    aborted (the KV pool is whole again), and it cannot be continued; cancelling a foreground
    response is refused; a pending response cannot be continued either."""
    free = live.llm.engine.block_manager.num_free_blocks
    r = post(live, {"input": "Write a lot.", "seed": 9, "temperature": 1.0, "max_output_tokens": 1800, "ignore_eos": True,
                    "background": True}).json()
    assert r["status"] == "in_progress"
    early = post(live, {"input": "x", "previous_response_id": r["id"]})
    gone = httpx.post(f"{live.url}/v1/responses/{r['id']}/cancel").json()
    assert gone["status"] == "cancelled" and gone["output"] == [] and gone["usage"] is None
    assert httpx.get(f"{live.url}/v1/responses/{r['id']}").json()["status"] == "cancelled"
    if early.status_code != 200:  # (it may have finished first on a fast machine: then it was served)
        assert early.json()["error"]["param"] == "previous_response_id" and "in_progress" in early.json()["error"]["message"]
    after = post(live, {"input": "x", "previous_response_id": r["id"]})
    assert after.status_code == 400 and "cancelled" in after.json()["error"]["message"]
    import time

    for _ in range(100):
        if live.llm.engine.block_manager.num_free_blocks == free:
            break
        time.sleep(0.05)
    assert live.llm.engine.block_manager.num_free_blocks == free
    fg = post(live, {"input": "x", "seed": 302}).json()
    refused = httpx.post(f"{live.url}/v1/responses/{fg['id']}/cancel")
    assert refused.status_code == 400 and "background" in refused.json()["error"]["message"]
    assert httpx.post(f"{live.url}/v1/responses/resp_nope/cancel").status_code == 404


def test_sealed_reasoning_round_trips_statelessly(thinking):
    """include reasoning.encrypted_content (a stateless client, store false): reasoning items carry
    encrypted_content, whole and streamed alike; sent back alone it renders the turn exactly as
    its text would; altered, from another key, or contradicting its content, a 400 naming input."""
    import json as _json

    from cuttle.engine.server import responses as mod

    body = {"input": "Weather in Paris?", "seed": 303, "store": False, "include": ["reasoning.encrypted_content"]}
    whole = post(thinking, body).json()
    rs = whole["output"][0]
    assert rs["type"] == "reasoning" and rs["encrypted_content"].startswith("cuttle-rs1:")
    streamed = [e for e in events(thinking, body) if e["type"] == "response.output_item.done" and e["item"]["type"] == "reasoning"]
    assert streamed[0]["item"]["encrypted_content"] == rs["encrypted_content"]
    assert "encrypted_content" not in post(thinking, {**body, "include": []}).json()["output"][0]

    def turn(reasoning_item: dict) -> httpx.Response:
        inp = [{"role": "user", "content": "Hi"}, reasoning_item, {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
               {"role": "user", "content": "Weather?"}]
        return post(thinking, {"input": inp, "seed": 302, "reasoning": {"effort": "none"}, "store": False})

    text = rs["content"][0]["text"]
    plain = turn({"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}).json()
    sealed_only = turn({"type": "reasoning", "summary": [], "encrypted_content": rs["encrypted_content"]}).json()
    both = turn({"type": "reasoning", "summary": [], "content": rs["content"], "encrypted_content": rs["encrypted_content"]}).json()
    assert sealed_only["usage"]["input_tokens"] == plain["usage"]["input_tokens"] == both["usage"]["input_tokens"]
    assert message_text(sealed_only) == message_text(plain)
    tag, b64, mac = rs["encrypted_content"].split(":")
    import base64

    forged = f"{tag}:{base64.urlsafe_b64encode(b'other thoughts').decode()}:{mac}"
    other_key = mod.seal_reasoning(text).replace(mac, base64.urlsafe_b64encode(b"x" * 32).decode())
    for bad in (forged, other_key, "abc", 5):
        r = turn({"type": "reasoning", "summary": [], "encrypted_content": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", _json.dumps(r.json())
    r = turn({"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "edited"}],
              "encrypted_content": rs["encrypted_content"]})
    assert r.status_code == 400 and "differs" in r.json()["error"]["message"]
