"""gpt-oss's harmony output (engine/harmony.py): analysis messages are the reasoning, final messages
and preambles the content, messages to `functions.NAME` tool calls (the `openai` format), whole
and streamed at every split; and through the server on a checkpoint whose template writes harmony
(the model's ids scripted): reasoning_content, content and tool_calls, streamed alike, forced
calls, the markers kept in the text, and the parser choice checked at start."""
from __future__ import annotations

import json
import random

import httpx
import openai
import pytest
from harmony_checkpoint import make_harmony_checkpoint
from server_fixture import LiveServer, scripted_sampler

import cuttle.engine.llm_engine as llm_engine
from cuttle.engine.harmony import HarmonyParser, split_harmony
from cuttle.engine.reasoning_parsers import split_reasoning, start_state
from cuttle.engine.tool_parsers import StreamingToolParser, is_harmony_template, parse_tool_calls, parser_for_template

TURN = ("<|channel|>analysis<|message|>The user wants weather.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking the weather.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')
ANSWER = "<|channel|>analysis<|message|>Sunny it is.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny in Paris."
CALL_FIRST = '<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 1}<|call|>'
TEXTS = [TURN, ANSWER, " to=functions.add<|channel|>commentary json<|message|>{\"a\": 1}",
         "<|channel|>analysis<|message|>a<|start|>assistant<|channel|>final<|message|>b",  # a body left without <|end|>
         "<|channel|>analysis<|message|>look it up<|end|><|start|>assistant<|channel|>analysis to=browser.search<|message|>{\"q\": 1}<|call|>",
         "<|channel|>analysis<|message|>cut off<|end|><|start|>assistant<|chan",  # an unfinished header
         '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1}<|call|>' + CALL_FIRST]


def test_whole_turn_splits_by_channel():
    reasoning, content = split_harmony(TURN)
    assert reasoning == "The user wants weather."
    assert content == ("Checking the weather."
                       '<|start|>assistant to=functions.get_weather<|channel|>commentary<|message|>{"city": "Paris"}<|call|>')
    text, calls = parse_tool_calls(content, "openai")
    assert text == "Checking the weather." and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert split_harmony(ANSWER) == ("Sunny it is.", "It is sunny in Paris.")


def test_recipients_and_unfinished_headers():
    # the recipient in the role header, two calls in a row
    _, content = split_harmony(TEXTS[6])
    assert [c.name for c in parse_tool_calls(content, "openai")[1]] == ["add", "add"]
    assert split_harmony(TEXTS[2])[1] == '<|start|>assistant to=functions.add<|channel|>commentary<|message|>{"a": 1}<|call|>'
    assert split_harmony(TEXTS[3]) == ("a", "b")
    # a built-in tool's message (no function): reasoning, not a call
    assert split_harmony(TEXTS[4]) == ('look it up{"q": 1}', "")
    # a header never finished is kept as written (after its <|start|>)
    assert split_harmony(TEXTS[5]) == ("cut off", "assistant<|chan")


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", range(8))
def test_streaming_equals_whole_at_every_split(text, seed):
    rng = random.Random(seed)
    cuts = list(range(1, len(text))) if seed == 0 else sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 20))))
    parser, tools = HarmonyParser(), StreamingToolParser("openai", None)
    reasoning = content = fed = ""
    calls = []
    for c in cuts + [len(text)]:
        final = c == len(text)
        r, d = parser.feed(text[:c], final=final)
        assert "<|" not in r  # markers never reach the reasoning, not even a part of one
        reasoning += r
        fed += d
        shown, new = tools.feed(fed, final=final)
        assert final or "<|" not in shown
        content += shown
        calls += new
    whole_reasoning, whole_content = split_harmony(text)
    assert reasoning == whole_reasoning and fed == whole_content
    text_whole, calls_whole = parse_tool_calls(whole_content, "openai")
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in calls_whole]
    assert (content.strip() if calls else content) == text_whole


def test_forced_openings_read_as_the_first_message():
    from cuttle.engine.server.chat import _forced_prefix

    for choice, rest in (("named", '{"a": 1}'), ("required", 'add <|constrain|>json<|message|>{"a": 1}')):
        _, content = split_reasoning(_forced_prefix("openai", choice, "add") + rest, start_state("gpt_oss", ""))
        _, [call] = parse_tool_calls(content, "openai")
        assert (call.name, json.loads(call.arguments)) == ("add", {"a": 1})


def test_template_detection():
    from harmony_checkpoint import HARMONY_TEMPLATE

    assert is_harmony_template(HARMONY_TEMPLATE) and parser_for_template(HARMONY_TEMPLATE) == "openai"
    assert not is_harmony_template("{{ '<|im_start|>' }}")


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
SCRIPTS = {401: TURN, 402: ANSWER, 403: '{"city": "Oslo"}'}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    path = make_harmony_checkpoint(str(tmp_path_factory.mktemp("harmony")))
    with pytest.MonkeyPatch.context() as mp, LiveServer(path, dtype="float32", num_kv_blocks=256, max_model_len=2048) as srv:
        tok = srv.llm.engine.tokenizer
        call, ret = tok.encode("<|call|>", add_special_tokens=False), tok.encode("<|return|>", add_special_tokens=False)
        assert len(call) == len(ret) == 1
        scripts = {seed: tok.encode(text, add_special_tokens=False) + (ret if seed == 402 else call) for seed, text in SCRIPTS.items()}
        mp.setattr(llm_engine, "sample", scripted_sampler(llm_engine.sample, scripts))
        yield srv


def _streamed(client, **kw):
    reasoning = content = ""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            delta = c.delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                if t.id is not None:
                    calls[t.index] = {"name": t.function.name, "arguments": ""}
                calls[t.index]["arguments"] += t.function.arguments or ""
            finish = c.finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_server_splits_reasoning_content_and_calls(live, stream):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="none")
    kw = dict(model="test-model", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=WEATHER, max_tokens=200)
    if stream:
        reasoning, content, calls, finish = _streamed(client, seed=401, **kw)
    else:
        r = client.chat.completions.create(seed=401, **kw)
        msg = r.choices[0].message
        reasoning, content, finish = msg.model_dump()["reasoning_content"], msg.content, r.choices[0].finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls]
    assert reasoning == "The user wants weather." and content == "Checking the weather."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert finish == "tool_calls"
    # the answer after the tool's result: reasoning and content, no call
    kw["messages"] = kw["messages"] + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    if stream:
        reasoning, content, calls, finish = _streamed(client, seed=402, **kw)
    else:
        r = client.chat.completions.create(seed=402, **kw)
        reasoning, content, calls, finish = (r.choices[0].message.model_dump()["reasoning_content"], r.choices[0].message.content,
                                             r.choices[0].message.tool_calls or [], r.choices[0].finish_reason)
    assert (reasoning, content, calls, finish) == ("Sunny it is.", "It is sunny in Paris.", [], "stop")


def test_server_named_tool_choice_is_forced_as_a_harmony_header(live):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="none")
    r = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=WEATHER,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}}, seed=403, max_tokens=50)
    [call] = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})


def test_server_refuses_skipping_the_markers(live):
    r = httpx.post(live.url + "/v1/chat/completions", timeout=60, json={
        "model": "test-model", "messages": [{"role": "user", "content": "hi"}], "skip_special_tokens": True, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "skip_special_tokens"


def test_server_start_refuses_a_tag_reasoning_parser_for_harmony(live):
    from cuttle.engine.server.app import create_app

    with pytest.raises(ValueError, match="harmony"):
        create_app(live.engine, "x", reasoning_parser="qwen3")


def test_responses_api_reads_harmony_items(live):
    """/v1/responses frames the same split: a reasoning item and the message, or a function call."""
    r = httpx.post(live.url + "/v1/responses", timeout=60,
                   json={"model": "test-model", "input": "Weather?", "seed": 402, "max_output_tokens": 100}).json()
    assert [(o["type"], (o["content"][0]["text"])) for o in r["output"]] == [("reasoning", "Sunny it is."),
                                                                             ("message", "It is sunny in Paris.")]
    tools = [{"type": "function", **WEATHER[0]["function"]}]
    r = httpx.post(live.url + "/v1/responses", timeout=60,
                   json={"model": "test-model", "input": "Weather?", "seed": 401, "tools": tools, "max_output_tokens": 200}).json()
    kinds = [o["type"] for o in r["output"]]
    assert kinds[0] == "reasoning" and kinds[-1] == "function_call" and r["output"][-1]["name"] == "get_weather"


def test_beam_search_keeps_the_markers_and_splits_each_beam(live):
    """use_beam_search on a harmony template: each beam decoded with its markers and split."""
    r = httpx.post(live.url + "/v1/chat/completions", timeout=120, json={
        "model": "test-model", "messages": [{"role": "user", "content": "hi"}], "use_beam_search": True, "n": 2,
        "max_tokens": 6})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:  # random weights: whatever the beams wrote, no marker reaches the client's fields
        msg = choice["message"]
        assert "<|" not in (msg.get("content") or "") or "<|start|>assistant to=functions." in msg["content"]
        assert "<|" not in (msg.get("reasoning_content") or "")


def test_reasoning_effort_reaches_the_template(live):
    """OpenAI's chat field `reasoning_effort` is the template's `reasoning_effort` (gpt-oss's
    system message); an unknown effort, or one clashing with chat_template_kwargs, is a 400."""
    def prompt_tokens(**extra) -> int:
        r = httpx.post(live.url + "/v1/chat/completions", timeout=60, json={
            "model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "seed": 402, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    # a byte-level vocabulary: a token a byte, so "high" is two tokens fewer than the default "medium"
    assert prompt_tokens(reasoning_effort="high") == prompt_tokens() - 2
    assert prompt_tokens(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "low"}) == prompt_tokens() - 3
    for body in ({"reasoning_effort": "extreme"}, {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}):
        r = httpx.post(live.url + "/v1/chat/completions", timeout=60, json={
            "model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text


def test_server_named_call_follows_its_schema_under_a_grammar(live):
    """A named tool_choice on the harmony format: the server writes the header, the grammar the
    arguments under the tool's schema (sampled from random weights here, so only the grammar makes
    them parse), then only a stop token; `strict: true` is taken. A required call runs as a token
    program (engine/token_calls.py): the name under the grammar, then `<|constrain|>json<|message|>`
    (special tokens the grammar cannot write), the arguments, `<|call|>`."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]},
                                               "days": {"type": "integer"}},
              "required": ["city", "days"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": schema, "strict": True}}]
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="none")
    for seed in (11, 12, 13):
        r = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "Forecast?"}], tools=tools,
                                           tool_choice={"type": "function", "function": {"name": "forecast"}}, seed=seed,
                                           temperature=1.0, max_tokens=120)
        [call] = r.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "forecast" and args["city"] in ("Oslo", "Paris") and isinstance(args["days"], int)
        assert set(args) == {"city", "days"} and r.choices[0].finish_reason == "tool_calls"
    two = tools + [{"type": "function", "function": {"name": "fore", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "enum": [1, 2]}}, "required": ["n"]}, "strict": True}}]
    names = set()
    for seed in (21, 22, 23, 24, 25, 26):
        r = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "Forecast?"}], tools=two,
                                           tool_choice="required", seed=seed, temperature=1.0, max_tokens=120)
        [call] = r.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name in ("forecast", "fore")
        assert args["n"] in (1, 2) if call.function.name == "fore" else (args["city"] in ("Oslo", "Paris") and isinstance(args["days"], int))
        names.add(call.function.name)
    assert names == {"forecast", "fore"}  # (a name that is a prefix of another: both reachable)
