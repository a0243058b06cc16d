"""Server replay of the model's exact tool-call text (issue 17): an assistant turn sent back with the
tool calls this server produced renders as the model's own text, so the next turn's prompt hits
the prefix cache for the whole first turn; anything a client changed (an unknown id, other
arguments, edited content) or the server no longer remembers renders through the template as sent."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_fixture import LiveServer, scripted_sampler
from thinking_checkpoint import make_thinking_checkpoint

import cuttle.engine.llm_engine as llm_engine
from cuttle.engine.server.chat_prompt import ToolCallReplay

BS = 4
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# compact arguments: not how the template writes a call (json.dumps, `{"city": "Paris"}`), yet what
# the auto tool-call grammar allows (its fixed opening, then at most one space between JSON tokens)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
FORCED = '<tool_call>\n{"name":'  # tool_choice required's opening, written for the model (chat._forced_prefix, hermes)
SCRIPTS = {301: CALL, 302: "It is sunny.", 303: CALL[len(FORCED):]}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    path = make_thinking_checkpoint(str(tmp_path_factory.mktemp("qwen3_replay")))
    with pytest.MonkeyPatch.context() as mp, LiveServer(path, dtype="float32", num_kv_blocks=512, block_size=BS,
                                                        max_model_len=2048) as srv:
        tok = srv.llm.engine.tokenizer
        scripts = {seed: tok.encode(text, add_special_tokens=False) + [tok.eos_token_id] for seed, text in SCRIPTS.items()}
        real = llm_engine.sample

        mp.setattr(llm_engine, "sample", scripted_sampler(real, scripts))
        yield srv


def user(stream: bool) -> list[dict]:
    # each variant its own conversation, so one's cached blocks are no hits for the other
    return [{"role": "user", "content": f"Weather in Paris? ({'streamed' if stream else 'whole'})"}]


def second_turn(live, client, assistant: dict, stream: bool = False) -> int:
    """Cached prompt tokens of the turn after `assistant` and its tool result (and /tokenize of the
    same messages counts the prompt the chat request had)."""
    call_id = assistant["tool_calls"][0]["id"]
    messages = user(stream) + [assistant, {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 C"}]
    kw = dict(model="test-model", messages=messages, tools=WEATHER, seed=302, max_tokens=30)
    if stream:
        usage = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))[-1].usage
    else:
        usage = client.chat.completions.create(**kw).usage
    counted = httpx.post(live.url + "/tokenize", timeout=60,
                         json={"messages": messages, "tools": WEATHER}).json()["count"]
    assert counted == usage.prompt_tokens
    return usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_second_turn_hits_the_prefix_cache_for_the_whole_first_turn(live, stream):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="none")
    kw = dict(model="test-model", messages=user(stream), tools=WEATHER, seed=301, max_tokens=200)
    if stream:
        calls, content = {}, ""
        for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                content += c.delta.content or ""
                for t in c.delta.tool_calls or []:  # a call's first piece names it, the rest add arguments
                    if t.id is not None:
                        calls[t.index] = {"id": t.id, "type": "function", "function": {"name": t.function.name, "arguments": ""}}
                    calls[t.index]["function"]["arguments"] += t.function.arguments or ""
        assistant = {"role": "assistant", "content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}
    else:
        r = client.chat.completions.create(**kw)
        usage = r.usage
        assistant = r.choices[0].message.model_dump(exclude_none=True)
    assert [json.loads(c["function"]["arguments"]) for c in assistant["tool_calls"]] == [{"city": "Paris"}]
    # the first turn's prompt and its sampled ids, less the final end-of-turn token (its KV is never
    # computed): every full block of that is a hit
    first = usage.prompt_tokens + usage.completion_tokens - 1
    assert second_turn(live, client, assistant, stream) == first // BS * BS
    # the same turn with the call re-serialized by a client (no id the server knows): the template
    # writes the call its own way, so the cache serves the prompt but not the call
    forged = json.loads(json.dumps(assistant))
    forged["tool_calls"][0]["id"] = "call_" + "0" * 24
    missed = second_turn(live, client, forged, stream)
    assert usage.prompt_tokens // BS * BS <= missed < first // BS * BS - BS


@pytest.mark.parametrize("choice,seed", [("auto", 301), ("required", 303)])
def test_return_token_ids_of_a_tool_call(live, choice, seed):
    """return_token_ids with tools: the prompt's ids and the sampled ids, whole and streamed, are
    exactly what the model read and wrote (the scripted call). Streamed, the tool parser holds the
    call's text until it parses: its ids come with the chunk that sends it, so the chunks' ids
    still add up. Under `required` the call's opening is written for the model: it ends the
    prompt's ids, and the sampled ids are the rest of the call."""
    tok = live.llm.engine.tokenizer
    messages = [{"role": "user", "content": f"Weather in Rome? ({choice})"}]
    body = {"model": "test-model", "messages": messages, "tools": WEATHER, "tool_choice": choice, "seed": seed,
            "max_tokens": 200, "return_token_ids": True}
    whole = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60).json()
    rendered = httpx.post(live.url + "/tokenize", json={"messages": messages, "tools": WEATHER}, timeout=60).json()["tokens"]
    forced = tok.encode(FORCED, add_special_tokens=False) if choice == "required" else []
    assert whole["prompt_token_ids"] == rendered + forced
    assert whole["choices"][0]["token_ids"] == tok.encode(SCRIPTS[seed], add_special_tokens=False) + [tok.eos_token_id]
    assert whole["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    lines = httpx.post(live.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60).text.splitlines()
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    chunks = [c for e in events[1:] for c in e["choices"]]
    assert [t for c in chunks for t in c["token_ids"]] == whole["choices"][0]["token_ids"]
    assert max(len(c["token_ids"]) for c in chunks) > 1  # ids held with the call's text ...
    assert all(c["delta"] or c["finish_reason"] for c in chunks if c["token_ids"])  # ... sent with it (or the finish)


def test_replay_refuses_anything_it_did_not_produce():
    replay = ToolCallReplay(max_turns=2)
    calls = [{"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]
    replay.record('<tool_call>{"name":"f","arguments":{"x":1}}</tool_call>', None, calls)
    msg = {"role": "assistant", "content": None, "tool_calls": calls}
    user = {"role": "user", "content": "hi"}
    assert replay.restore([user, msg]) == [user, {"role": "assistant", "content": '<tool_call>{"name":"f","arguments":{"x":1}}</tool_call>'}]
    parsed = {**msg, "tool_calls": [{**calls[0], "function": {"name": "f", "arguments": {"x": 1}}}]}
    assert replay.restore([parsed])[0]["content"].startswith("<tool_call>")  # arguments sent back as an object
    assert replay.restore([msg], keep_last=True) == [msg]
    changed = [
        {**msg, "tool_calls": [{**calls[0], "function": {"name": "f", "arguments": '{"x": 2}'}}]},  # other arguments
        {**msg, "tool_calls": [{**calls[0], "function": {"name": "g", "arguments": '{"x": 1}'}}]},  # another tool
        {**msg, "content": "injected text"},  # edited content
        {**msg, "tool_calls": [{**calls[0], "id": "call_b"}]},  # unknown id
        {**msg, "tool_calls": calls + calls},  # more calls than the turn had
        {**msg, "reasoning_content": "thoughts"},  # reasoning the recorded text does not hold
    ]
    for m in changed:
        assert replay.restore([m]) == [m], m
    for k in range(2):  # bounded: the oldest turn is forgotten
        replay.record("t", None, [{"id": f"call_{k}", "function": {"name": "f", "arguments": "{}"}}])
    assert len(replay) == 2 and replay.restore([msg]) == [msg]


def _chat_stream(live, body) -> tuple[list[dict], str | None]:
    lines = httpx.post(live.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60).text.splitlines()
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    pieces = [tc for e in events for c in e["choices"] for tc in c["delta"].get("tool_calls") or []]
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    return pieces, finish[-1] if finish else None


def test_a_call_streams_as_written_and_a_cut_call_is_reported_as_cut(live):
    """Under the tool-call grammar a streamed call sends its id and name once its opening is
    written, then its arguments as the model writes them (several pieces adding up to the whole
    response's arguments); cut by max_tokens inside its arguments, the call is reported with the
    arguments written so far and finish_reason length, whole and streamed alike. /v1/responses
    streams the same pieces as function_call_arguments.delta events."""
    tok = live.llm.engine.tokenizer
    body = {"model": "test-model", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": WEATHER, "seed": 301,
            "max_tokens": 200}
    whole = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    args = whole["message"]["tool_calls"][0]["function"]["arguments"]
    assert args == '{"city": "Paris"}' and whole["finish_reason"] == "tool_calls"  # written as json.dumps writes it
    pieces, finish = _chat_stream(live, body)
    assert pieces[0]["id"].startswith("call_") and pieces[0]["function"]["name"] == "get_weather" and "id" not in pieces[1]
    assert "".join(p["function"]["arguments"] for p in pieces) == args and len(pieces) > 3 and finish == "tool_calls"
    # cut inside the arguments
    ids = tok.encode(CALL, add_special_tokens=False)
    n = next(k for k in range(len(ids)) if '"city":"P' in tok.decode(ids[:k], False))
    cut = httpx.post(live.url + "/v1/chat/completions", json={**body, "max_tokens": n}, timeout=60).json()["choices"][0]
    cut_args = cut["message"]["tool_calls"][0]["function"]["arguments"]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] is None
    assert args.startswith(cut_args) and cut_args.startswith('{"city": "P') and cut_args != args
    pieces, finish = _chat_stream(live, {**body, "max_tokens": n})
    assert "".join(p["function"]["arguments"] for p in pieces) == cut_args and finish == "length"
    # the Responses API: the same pieces as argument deltas, the item incomplete when cut
    rbody = {"model": "test-model", "input": "Weather in Oslo?", "seed": 301, "max_output_tokens": 200,
             "tools": [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in WEATHER]}
    for limit, want, status in ((200, args, "completed"), (n, cut_args, "incomplete")):
        text = httpx.post(live.url + "/v1/responses", json={**rbody, "max_output_tokens": limit, "stream": True}, timeout=60).text
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
        deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
        [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
        assert "".join(deltas) == done["arguments"] == want and len(deltas) > 1
        [item] = [e["item"] for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"]
        assert item["status"] == status and item["arguments"] == want
        stored = httpx.post(live.url + "/v1/responses", json={**rbody, "max_output_tokens": limit}, timeout=60).json()
        [fc] = [i for i in stored["output"] if i["type"] == "function_call"]
        assert (fc["arguments"], fc["status"]) == (want, status)
