"""POST /v1/messages (Anthropic's Messages API, engine/server/messages.py) against its oracle, the
chat route: the same conversation gives the same prompt, text, reasoning split and tool calls; the
responses and the event stream parse as the `anthropic` SDK's types, the stream adds up to the
whole message, and the SDK's own client reads both; tool_use / tool_result round-trip as a
prefix-cache hit; thinking blocks come back signed and are refused altered; count_tokens equals
the prompt chat renders; errors are Anthropic's shape, naming the field; the API key is read from
`x-api-key`."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter
from server_fixture import LiveServer, named_events, thinking_fixtures


BS = 4
WEATHER = [{"name": "get_weather", "description": "weather in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
WEATHER_CHAT = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                                  "parameters": WEATHER[0]["input_schema"]}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
THOUGHT = "<think>\nWhere is Paris?\n</think>\n\nIt is sunny."
SCRIPTS = {301: CALL, 302: "It is sunny.", 303: THOUGHT, 304: "It is sunny. Bye now."}
EVENTS = TypeAdapter(RawMessageStreamEvent)


checkpoint, live, thinking = thinking_fixtures("qwen3_messages", SCRIPTS, BS)


def post(srv, body: dict, path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(srv.url + path, json={"model": "test-model", **body}, timeout=120)


def message(srv, body: dict) -> dict:
    r = post(srv, body)
    assert r.status_code == 200, r.text
    Message.model_validate(r.json())
    return r.json()


def events(srv, body: dict) -> list[dict]:
    """A streamed message's events, each checked against the SDK's event types and its SSE name."""
    out = []
    for obj in named_events(srv, "/v1/messages", body):
        EVENTS.validate_python(obj)
        out.append(obj)
    assert out[0]["type"] == "message_start" and out[-1]["type"] == "message_stop"
    return out


def assembled(evs: list[dict]) -> dict:
    """The message a stream adds up to (as the SDK's accumulator builds it)."""
    msg = dict(evs[0]["message"])
    blocks: list[dict] = []
    for e in evs:
        if e["type"] == "content_block_start":
            blocks.append(dict(e["content_block"]))
            if blocks[-1]["type"] == "tool_use":
                blocks[-1]["partial"] = ""
        elif e["type"] == "content_block_delta":
            b, d = blocks[e["index"]], e["delta"]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                b["signature"] = d["signature"]
            else:
                b["partial"] += d["partial_json"]
        elif e["type"] == "message_delta":
            msg.update(e["delta"])
            msg["usage"] = e["usage"]
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = json.loads(b.pop("partial") or "{}")
    msg["content"] = blocks
    return msg


def chat(srv, messages: list[dict], **kw) -> dict:
    r = post(srv, {"messages": messages, **kw}, "/v1/chat/completions")
    assert r.status_code == 200, r.text
    return r.json()


def whole_or_streamed(srv, body: dict, stream: bool) -> dict:
    if stream:
        msg = assembled(events(srv, body))
        Message.model_validate(msg)
        return msg
    return message(srv, body)


@pytest.mark.parametrize("stream", [False, True])
def test_text_equals_chat(live, stream):
    """A system prompt + a user turn of text blocks: chat's text for the system message and the
    joined text (greedy, no EOS, so both run the full length); stop_reason max_tokens."""
    body = {"system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello"}]}],
            "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    ref = chat(live, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}], max_tokens=12,
               temperature=0, ignore_eos=True)
    msg = whole_or_streamed(live, body, stream)
    assert [b["type"] for b in msg["content"]] == ["text"]
    assert msg["content"][0]["text"] == ref["choices"][0]["message"]["content"]
    assert msg["stop_reason"] == "max_tokens" and msg["stop_sequence"] is None
    u = msg["usage"]
    assert u["output_tokens"] == 12
    assert u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"] == ref["usage"]["prompt_tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_end_turn_and_stop_sequence(live, stream):
    msg = whole_or_streamed(live, {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 40, "seed": 302}, stream)
    assert msg["content"] == [{"type": "text", "text": "It is sunny."}] and msg["stop_reason"] == "end_turn"
    msg = whole_or_streamed(live, {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 40, "seed": 304,
                                   "stop_sequences": ["Bye", "zzz"]}, stream)
    assert msg["content"][0]["text"] == "It is sunny. " and msg["stop_reason"] == "stop_sequence"
    assert msg["stop_sequence"] == "Bye"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trip_is_a_prefix_cache_hit(live, stream):
    """A tool_use block (the chat parser's call), its tool_result sent back, and the next turn's
    prompt hits the prefix cache for the whole first turn: the model's exact text of the call is
    replayed, as on chat; chat renders the same next prompt."""
    user = {"role": "user", "content": f"Weather in Paris? ({'streamed' if stream else 'whole'} messages)"}
    msg = whole_or_streamed(live, {"messages": [user], "tools": WEATHER, "max_tokens": 60, "seed": 301}, stream)
    [use] = [b for b in msg["content"] if b["type"] == "tool_use"]
    assert use["name"] == "get_weather" and use["input"] == {"city": "Paris"} and msg["stop_reason"] == "tool_use"
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "sunny"}]}
    follow = message(live, {"messages": [user, {"role": "assistant", "content": msg["content"]}, result], "tools": WEATHER,
                            "max_tokens": 40, "seed": 302})
    assert follow["content"] == [{"type": "text", "text": "It is sunny."}]
    first_turn = msg["usage"]["input_tokens"] + msg["usage"]["cache_read_input_tokens"] + msg["usage"]["cache_creation_input_tokens"]
    assert follow["usage"]["cache_read_input_tokens"] >= (first_turn + 10) // BS * BS - BS
    # chat's equivalent conversation renders the same prompt (count_tokens answers its length)
    calls = [{"id": use["id"], "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(use["input"])}}]
    ref = chat(live, [user, {"role": "assistant", "content": "", "tool_calls": calls},
                      {"role": "tool", "tool_call_id": use["id"], "content": "sunny"}], tools=WEATHER_CHAT, max_tokens=40, seed=302)
    u = follow["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"] == ref["usage"]["prompt_tokens"]
    n = post(live, {"messages": [user, {"role": "assistant", "content": msg["content"]}, result], "tools": WEATHER},
             "/v1/messages/count_tokens")
    assert n.status_code == 200 and n.json() == {"input_tokens": ref["usage"]["prompt_tokens"]}


def test_forced_tool_choice(live):
    """tool_choice any / tool: chat's required / named call, under its grammar (random weights
    write a call that parses; the city an enum, so a sampled string cannot outrun max_tokens)."""
    tools = [{**WEATHER[0], "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                                             "required": ["city"]}}]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        msg = message(live, {"messages": [{"role": "user", "content": "Weather?"}], "tools": tools, "tool_choice": choice,
                             "max_tokens": 120, "temperature": 0})
        uses = [b for b in msg["content"] if b["type"] == "tool_use"]
        assert uses and uses[0]["name"] == "get_weather" and isinstance(uses[0]["input"], dict), msg
        assert msg["stop_reason"] == "tool_use"


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_block_signed_and_sent_back(thinking, stream):
    msg = whole_or_streamed(thinking, {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 60, "seed": 303}, stream)
    assert [b["type"] for b in msg["content"]] == ["thinking", "text"]
    th = msg["content"][0]
    assert th["thinking"].strip() == "Where is Paris?" and msg["content"][1]["text"].strip() == "It is sunny."
    turns = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": msg["content"]},
             {"role": "user", "content": "And tomorrow?"}]
    assert post(thinking, {"messages": turns, "max_tokens": 4}).status_code == 200
    altered = [turns[0], {"role": "assistant", "content": [{**th, "thinking": "Something else."}, msg["content"][1]]}, turns[2]]
    r = post(thinking, {"messages": altered, "max_tokens": 4})
    assert r.status_code == 400 and "signature" in r.json()["error"]["message"]
    # thinking disabled: the template's own switch (enable_thinking: false)
    off = post(thinking, {"messages": [{"role": "user", "content": "Hi"}], "thinking": {"type": "disabled"}, "max_tokens": 4})
    assert off.status_code == 200, off.text


def test_official_client(live):
    client = anthropic.Anthropic(base_url=live.url, api_key="none")
    m = client.messages.create(model="test-model", max_tokens=40, messages=[{"role": "user", "content": "Weather?"}],
                               extra_body={"seed": 302})
    assert m.content[0].text == "It is sunny." and m.stop_reason == "end_turn"
    with client.messages.stream(model="test-model", max_tokens=60, tools=WEATHER,
                                messages=[{"role": "user", "content": "Weather in Paris? (sdk stream)"}],
                                extra_body={"seed": 301}) as s:
        final = s.get_final_message()
    [use] = [b for b in final.content if b.type == "tool_use"]
    assert use.input == {"city": "Paris"} and final.stop_reason == "tool_use"
    assert client.messages.count_tokens(model="test-model", messages=[{"role": "user", "content": "Weather?"}]).input_tokens > 0


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "w"}]},
     "tools"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 2000}},
     "thinking"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "container": "c"}, "container"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "stop_sequences": "Bye"}, "stop_sequences"),
])
def test_refused_in_anthropics_error_shape(live, body, field):
    r = post(live, body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(field) or field in err["error"]["message"], err


def test_api_key_as_x_api_key(checkpoint):
    with LiveServer(checkpoint, api_key="sekret", dtype="float32", num_kv_blocks=128, block_size=BS, max_model_len=512) as srv:
        body = {"model": "test-model", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
        assert httpx.post(srv.url + "/v1/messages", json=body, headers={"x-api-key": "sekret"}, timeout=60).status_code == 200
        bad = httpx.post(srv.url + "/v1/messages", json=body, headers={"x-api-key": "nope"}, timeout=60)
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        assert httpx.post(srv.url + "/v1/chat/completions", json={"model": "test-model", "max_tokens": 2, "messages": body["messages"]},
                          headers={"x-api-key": "sekret"}, timeout=60).status_code == 401  # OpenAI routes: Bearer only


def test_malformed_bodies_are_400s_in_anthropics_shape(live):
    """Random malformed content blocks, tools, tool_choice, thinking and sampling fields (seeded):
    every answer is a 200 or a 400 in Anthropic's shape, never a 500, and the server stays up."""
    import random

    rng = random.Random(0)
    atoms = [None, True, 0, -1, 1.5, "", "x", [], {}, [1], {"type": "text"}, {"type": "text", "text": 3}, {"type": "tool_use"},
             {"type": "tool_result", "tool_use_id": 5}, {"type": "thinking", "thinking": "t", "signature": "zz"},
             {"type": "image", "source": {"type": "base64"}}, [{"type": "text", "text": "hi", "citations": [1]}], {"role": "user"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": []}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "zz", "content": [{"type": "image"}]}]}]
    keys = ["role", "content", "type", "text", "name", "input", "id", "tool_use_id", "input_schema", "budget_tokens"]

    def rand(depth: int = 0):
        r = rng.random()
        if depth > 2 or r < 0.5:
            return rng.choice(atoms)
        if r < 0.75:
            return [rand(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(keys): rand(depth + 1) for _ in range(rng.randint(0, 3))}

    fields = ["messages", "system", "tools", "tool_choice", "thinking", "stop_sequences", "max_tokens", "metadata", "temperature",
              "top_k"]
    seen = set()
    for _ in range(60):
        body = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        for f in rng.sample(fields, rng.randint(1, 3)):
            body[f] = rand()
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = post(live, body, path)
            seen.add(r.status_code)
            assert r.status_code in (200, 400), (path, body, r.text)
            if r.status_code == 400:
                assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert seen == {200, 400}
    assert httpx.get(live.url + "/health").status_code == 200
