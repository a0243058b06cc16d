"""Structured output and the token-level controls through the OpenAI server, driven by the official
`openai` client (raw HTTP for refusals): response_format, guided_*, structured_outputs, forced and
auto tool calls under their schemas, logit_bias / allowed_token_ids / bad_words; streamed equals
whole; what cannot be honoured is a 400 naming the field."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from cuttle.engine.default_model import default_model_path
from server_fixture import LiveServer
from xgrammar_probe import LONG_PATTERN, xgrammar_compiles_long_pattern

SCHEMA = {"type": "object", "properties": {"path": {"type": "string", "maxLength": 16}, "line": {"type": "integer", "minimum": 1, "maximum": 9999},
                                           "fix": {"enum": ["add", "remove", "rename"]}},
          "required": ["path", "line", "fix"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "read a file",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 20},
                                                                                      "start": {"type": "integer", "minimum": 0, "maximum": 500}},
                                                     "required": ["path", "start"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object", "properties": {"verbose": {"type": "boolean"}},
                                                                          "required": ["verbose"], "additionalProperties": False}}},
]
MSGS = [{"role": "user", "content": "Find the failing test in utils.py and fix it."}]


@pytest.fixture(scope="module")
def live():
    with LiveServer(default_model_path(), dtype="float32", num_kv_blocks=512, max_num_seqs=32) as srv:
        yield srv


def _served_with_parser(parser: str):
    """The embedded model served with tool-call format `parser`, as an OpenAI client (a fixture's body)."""
    with LiveServer(default_model_path(), dtype="float32", num_kv_blocks=512, max_num_seqs=32,
                    app_kw={"tool_call_parser": parser}) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none")


@pytest.fixture()
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none")


def test_response_format_json_schema_validates_and_streams_equal(client):
    rf = {"type": "json_schema", "json_schema": {"name": "fix", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="test-model", messages=MSGS, response_format=rf, temperature=1.0, seed=3, n=8, max_tokens=80)
    for ch in r.choices:
        assert ch.finish_reason == "stop"
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)
    whole = r.choices[0].message.content
    chunks = list(client.chat.completions.create(model="test-model", messages=MSGS, response_format=rf, temperature=1.0, seed=3,
                                                 max_tokens=80, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    obj = client.chat.completions.create(model="test-model", messages=MSGS, response_format={"type": "json_object"}, temperature=0,
                                         max_tokens=120)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra,check", [
    ({"guided_regex": r"[a-z_]{1,12}\.py:[0-9]{1,4}"}, lambda t: re.fullmatch(r"[a-z_]{1,12}\.py:[0-9]{1,4}", t)),
    ({"guided_choice": ["pass", "fail", "skip"]}, lambda t: t in ("pass", "fail", "skip")),
    ({"guided_json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_grammar": 'root ::= "x = " [0-9] [0-9]?', "guided_decoding_backend": "xgrammar"}, lambda t: re.fullmatch(r"x = [0-9]{1,2}", t)),
    ({"structured_outputs": {"regex": "(yes|no)!"}}, lambda t: t in ("yes!", "no!")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, lambda t: t in ("a", "b")),
])
def test_guided_fields_on_completions_and_chat(client, extra, check):
    c = client.completions.create(model="test-model", prompt="def check(path):\n    return ", temperature=1.0, seed=5, n=4,
                                  max_tokens=60, extra_body=extra)
    assert all(ch.finish_reason == "stop" and check(ch.text) for ch in c.choices), [ch.text for ch in c.choices]
    whole = [ch.text for ch in c.choices]
    streamed = [""] * 4
    for chunk in client.completions.create(model="test-model", prompt="def check(path):\n    return ", temperature=1.0, seed=5, n=4,
                                           max_tokens=60, extra_body=extra, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] += ch.text
    assert streamed == whole
    r = client.chat.completions.create(model="test-model", messages=MSGS, temperature=1.0, seed=9, n=3, max_tokens=60, extra_body=extra)
    assert all(ch.finish_reason == "stop" and check(ch.message.content) for ch in r.choices)


def test_empty_schema_is_any_json(client):
    """guided_json {} is the schema every JSON value meets (it was taken for "nothing set": a 500)."""
    c = client.completions.create(model="test-model", prompt="x = ", temperature=0, max_tokens=40,
                                  extra_body={"guided_json": {}})
    choice = c.choices[0]
    if choice.finish_reason == "stop":
        json.loads(choice.text)
    else:
        assert choice.finish_reason == "length"


def _check_forced_calls(client, tool_choice, schemas: dict, max_tokens: int) -> None:
    """n=4 x 3 seeds of forced calls: each a tool call of the right tool whose arguments validate;
    streamed arguments equal the whole ones."""
    for seed in range(3):
        r = client.chat.completions.create(model="test-model", messages=MSGS, tools=TOOLS, tool_choice=tool_choice, temperature=1.0,
                                           seed=seed, n=4, max_tokens=max_tokens)
        for ch in r.choices:
            assert ch.finish_reason == "tool_calls", ch
            [call] = ch.message.tool_calls
            if isinstance(tool_choice, dict):
                assert call.function.name == "read_file"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    kw = dict(model="test-model", messages=MSGS, tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=1, max_tokens=max_tokens)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kw) if c.choices and c.choices[0].delta.tool_calls]
    args = "".join(d.tool_calls[0].function.arguments or "" for d in deltas)
    assert json.loads(args) == json.loads(whole.function.arguments)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "read_file"}}, "required"])
def test_forced_tool_call_always_parses_and_validates(client, tool_choice):
    _check_forced_calls(client, tool_choice, {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}, max_tokens=80)
    # cut by max_tokens: finish_reason "length", not a server error
    cut = client.chat.completions.create(model="test-model", messages=MSGS, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=2)
    assert cut.choices[0].finish_reason == "length"


def test_auto_tool_calls_follow_the_schema_once_opened(client):
    """With tool_choice auto the model writes freely; pushed (logit_bias) to open calls, every call
    it opens is a valid call of one of the tools. A call that max_tokens cuts off is the last,
    with the arguments written so far and finish_reason length (as OpenAI reports it)."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    r = client.chat.completions.create(model="test-model", messages=MSGS, tools=TOOLS, tool_choice="auto", temperature=1.0, seed=2, n=4,
                                       max_tokens=120, logit_bias={"8192": 100})
    calls = cut = 0
    for ch in r.choices:
        for k, call in enumerate(ch.message.tool_calls or []):
            try:
                args = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                assert ch.finish_reason == "length" and k == len(ch.message.tool_calls) - 1, call
                cut += 1
                continue
            jsonschema.validate(args, schemas[call.function.name])
            calls += 1
    assert calls >= 4


def test_logit_bias_allowed_token_ids_bad_words(client, live):
    tok = live.llm.get_tokenizer()
    r = client.completions.create(model="test-model", prompt="import os\n", temperature=0, max_tokens=6, logit_bias={"300": 100},
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.choices[0].model_extra["token_ids"] == [300] * 6
    allowed = [300, 301, 302, 4000]
    r = client.completions.create(model="test-model", prompt="import os\n", temperature=1.0, seed=1, max_tokens=12,
                                  extra_body={"return_token_ids": True, "allowed_token_ids": allowed, "ignore_eos": True})
    assert set(r.choices[0].model_extra["token_ids"]) <= set(allowed)
    free = client.completions.create(model="test-model", prompt="import os\nimport sys\n", temperature=0, max_tokens=12,
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = free.choices[0].model_extra["token_ids"]
    word = tok.decode(ids[1:3])
    banned = client.completions.create(model="test-model", prompt="import os\nimport sys\n", temperature=0, max_tokens=12,
                                       extra_body={"return_token_ids": True, "ignore_eos": True, "bad_words": [word]})
    got = banned.choices[0].model_extra["token_ids"]
    assert got[:2] == ids[:2] and got[2] != ids[2]
    chat = client.chat.completions.create(model="test-model", messages=MSGS, temperature=0, max_tokens=4, logit_bias={"300": 100})
    assert chat.choices[0].message.content == tok.decode([300] * 4)


def _post(live, path, body):
    return httpx.post(live.url + path, json=body, timeout=60)


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ("/v1/chat/completions", {"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ("/v1/chat/completions", {"response_format": {"type": "structural_tag"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}}}}, "response_format"),
    ("/v1/chat/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"}, "response_format"),
    ("/v1/completions", {"guided_regex": "(a"}, "guided_regex"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"guided_grammar": "root ::= nothing"}, "guided_grammar"),
    # parses, then fails one of xgrammar 0.2.8's own checks while compiling (a 500 before; 0.2.9 compiles it)
    ("/v1/completions", {"guided_json": {"type": "string", "pattern": LONG_PATTERN}}, "guided_json"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": LONG_PATTERN}}}}}}, "response_format"),
    ("/v1/chat/completions", {"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": LONG_PATTERN}}}}}]}, "tools"),
    # pattern parts xgrammar would drop or misread with only a log warning: a lookahead, \Z
    ("/v1/completions", {"guided_json": {"type": "string", "pattern": "^(?!x)[a-z]+$"}}, "guided_json"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-z]+\\Z"}}}}}}, "response_format"),
    ("/v1/completions", {"guided_regex": "(?=a)a"}, "guided_regex"),
    ("/v1/completions", {"structured_outputs": "a"}, "structured_outputs"),
    ("/v1/completions", {"guided_json": {"type": "object"}, "ignore_eos": True}, "ignore_eos"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {"allowed_token_ids": [1, 999999]}, "allowed_token_ids"),
    ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"bad_words": [5]}, "bad_words"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(live, path, extra, param):
    body = {"messages": MSGS} if "chat" in path else {"prompt": "a"}
    r = _post(live, path, {**body, "max_tokens": 4, **extra})
    if LONG_PATTERN in json.dumps(extra) and xgrammar_compiles_long_pattern():
        assert r.status_code == 200, r.text  # xgrammar 0.2.9 compiles it: served
        return
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert _post(live, "/v1/completions", {"prompt": "a", "max_tokens": 2}).status_code == 200


@pytest.fixture(scope="module")
def xml_client():
    """The same model served with Qwen3-Coder's XML tool-call format (`<function=...>` /
    `<parameter=...>`), whose calls the tool parser reads back by the tools' parameter types."""
    yield from _served_with_parser("qwen3_coder")


def test_strict_tool_using_an_unenforced_keyword_is_refused(client):
    """A strict tool whose parameters use a keyword the grammar compiles without enforcing ("not",
    uniqueItems true) is a 400 naming where (strict promises adherence; it was served and the call
    could break the keyword); without strict, or with a property merely named "not", it is served."""
    params = {"type": "object", "properties": {"verbose": {"type": "boolean", "not": {"const": False}},
                                               "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
              "required": ["verbose"]}
    tool = {"type": "function", "function": {"name": "run_tests", "parameters": params}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="test-model", messages=MSGS, tools=[TOOLS[0], {**tool, "function": {**tool["function"], "strict": True}}],
                                       tool_choice="auto", max_tokens=4)
    assert e.value.body["param"] == "tools"
    assert "tools[1].function.parameters" in e.value.body["message"] and "$.properties.verbose.not" in e.value.body["message"]
    assert "uniqueItems" in e.value.body["message"]
    # a pattern with a lookahead, which xgrammar would drop: refused under strict too
    look = {"type": "object", "properties": {"path": {"type": "string", "pattern": "^(?!/etc)[a-z/]+$"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="test-model", messages=MSGS, tool_choice="auto", max_tokens=4,
                                       tools=[{"type": "function", "function": {"name": "read", "parameters": look, "strict": True}}])
    assert e.value.body["param"] == "tools" and "$.properties.path.pattern (a lookaround (?!...))" in e.value.body["message"]
    r = client.chat.completions.create(model="test-model", messages=MSGS, tools=[tool], tool_choice="required", max_tokens=4)
    assert r.choices[0].finish_reason in ("length", "tool_calls", "stop")
    named = {"type": "object", "properties": {"not": {"type": "boolean"}}, "required": ["not"], "additionalProperties": False}
    r = client.chat.completions.create(model="test-model", messages=MSGS, tool_choice="required", max_tokens=40, temperature=1.0, seed=3,
                                       tools=[{"type": "function", "function": {"name": "flag", "parameters": named, "strict": True}}])
    assert r.choices[0].finish_reason in ("length", "tool_calls")


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "read_file"}}, "required"])
def test_forced_qwen3_coder_tool_call_always_parses_and_validates(xml_client, tool_choice):
    """Every forced XML call parses, names a tool, has its required parameters, each of its type
    and within its string bounds (the grammar admits one whitespace character beside each tag,
    which the parser takes as the separator)."""
    _check_forced_calls(xml_client, tool_choice, {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}, max_tokens=200)


def test_strict_tools_are_kept_under_the_grammar_and_refused_without_one(client, monkeypatch):
    """`strict: true` is honoured where the calls run under their schemas (here: a forced call
    validates), and a 400 naming `tools` where the server cannot constrain them."""
    import cuttle.engine.server.chat as chat

    strict_tools = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    r = client.chat.completions.create(model="test-model", messages=MSGS, tools=strict_tools, tool_choice="required", temperature=1.0, seed=5,
                                       max_tokens=80)
    [call] = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name])
    monkeypatch.setattr(chat, "tool_call_structure", lambda *a: None)  # as without xgrammar
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="test-model", messages=MSGS, tools=strict_tools, tool_choice="required", max_tokens=8)
    assert e.value.body["param"] == "tools" and "strict" in e.value.body["message"]
    # parallel_tool_calls: false is kept by the grammar alone: refused without one
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="test-model", messages=MSGS, tools=TOOLS, parallel_tool_calls=False, max_tokens=8)
    assert e.value.body["param"] == "parallel_tool_calls"
    # without strict the same request is served (prefix forcing, no guarantee), as documented
    r = client.chat.completions.create(model="test-model", messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=8)
    assert r.choices[0].finish_reason in ("length", "tool_calls", "stop")


@pytest.fixture(scope="module")
def glm_client():
    """The same model served with GLM-4.5's tool-call format (`<tool_call>NAME` and
    `<arg_key>` / `<arg_value>` pairs), its calls under xgrammar's glm_xml style."""
    yield from _served_with_parser("glm45")


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "read_file"}}, "required"])
def test_forced_glm45_tool_call_always_parses_and_validates(glm_client, tool_choice):
    """Every forced GLM call parses, names a tool, has its required keys, each value of its type
    and string values within their bounds (taken verbatim between the value tags); streamed
    arguments, written as the model writes them, equal the whole ones."""
    _check_forced_calls(glm_client, tool_choice, {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}, max_tokens=200)


def test_auto_glm45_calls_follow_the_schema_once_opened(glm_client):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    r = glm_client.chat.completions.create(model="test-model", messages=MSGS, tools=TOOLS, tool_choice="auto", temperature=1.0, seed=2,
                                           n=4, max_tokens=200, logit_bias={"8192": 100})
    calls = 0
    for ch in r.choices:
        for k, call in enumerate(ch.message.tool_calls or []):
            if ch.finish_reason == "length" and k == len(ch.message.tool_calls) - 1:
                continue  # cut off by max_tokens: its arguments so far
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            calls += 1
        assert "<arg_key>" not in (ch.message.content or "")
    assert calls >= 4


@pytest.fixture(scope="module")
def seed_client():
    """The same model served with Seed-OSS's tool-call format (qwen3_coder's XML inside
    `<seed:tool_call>`), its calls under xgrammar's qwen_xml style."""
    yield from _served_with_parser("seed_oss")


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "read_file"}}, "required"])
def test_forced_seed_oss_tool_call_always_parses_and_validates(seed_client, tool_choice):
    _check_forced_calls(seed_client, tool_choice, {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}, max_tokens=200)


@pytest.fixture(scope="module", params=["deepseek_v31", "deepseek_v3", "minimax_m2"])
def deepseek_client(request):
    """The same model served with DeepSeek's tool-call formats and MiniMax-M2's (their markers
    plain text in this vocabulary, so the calls run under the grammar)."""
    yield from _served_with_parser(request.param)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "read_file"}}, "required"])
def test_forced_deepseek_and_minimax_tool_calls_always_parse_and_validate(deepseek_client, tool_choice):
    """Every forced call parses and validates; streamed arguments (as written, under the grammar)
    equal the whole ones; one call only when parallel_tool_calls is false."""
    _check_forced_calls(deepseek_client, tool_choice, {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS},
                        max_tokens=160)
    r = deepseek_client.chat.completions.create(model="test-model", messages=MSGS, tools=TOOLS, tool_choice=tool_choice,
                                                parallel_tool_calls=False, temperature=1.0, seed=5, max_tokens=160).choices[0]
    assert r.finish_reason == "tool_calls" and len(r.message.tool_calls) == 1


@pytest.fixture(scope="module")
def llama_client():
    """The same model served with Llama 3.x's tool-call format: the reply is the call,
    `{"name": NAME, "parameters": ARGS}`, its arguments under the tool's schema."""
    yield from _served_with_parser("llama3_json")


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "read_file"}}, "required"])
def test_forced_llama3_json_tool_call_always_parses_and_validates(llama_client, tool_choice):
    _check_forced_calls(llama_client, tool_choice, {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}, max_tokens=120)
    # one call only when asked: the grammar ends the reply after it (a promise kept, so not refused)
    r = llama_client.chat.completions.create(model="test-model", messages=MSGS, tools=TOOLS, tool_choice=tool_choice,
                                             parallel_tool_calls=False, temperature=1.0, seed=5, max_tokens=120).choices[0]
    assert r.finish_reason == "tool_calls" and len(r.message.tool_calls) == 1 and not r.message.content


def test_call_markers_marked_special_are_read_and_left_unconstrained(tmp_path):
    """A checkpoint whose tokenizer marks its call markers special (GLM-4.5's may): with tools the
    output is decoded with them (vLLM's parsers do the same), so the model's own `<tool_call>`
    reaches the parser; without tools, or with `skip_special_tokens` given, they are skipped as
    asked. The calls are not put under the grammar there (xgrammar never emits a special token:
    the markers would be spelled in pieces the model never saw), so `strict` is refused, naming
    `tools`, as on a server without xgrammar."""
    import os

    src = default_model_path()
    for name in os.listdir(src):
        if name != "tokenizer.json":
            os.symlink(os.path.join(src, name), tmp_path / name)
    tok = json.load(open(os.path.join(src, "tokenizer.json")))
    for a in tok["added_tokens"]:
        if a["content"] in ("<tool_call>", "</tool_call>"):
            a["special"] = True
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    with LiveServer(str(tmp_path), dtype="float32", num_kv_blocks=256, max_num_seqs=8) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        auto = dict(model="test-model", messages=MSGS, tools=TOOLS, tool_choice="auto", temperature=1.0, seed=2, max_tokens=24,
                    logit_bias={"8192": 100, "8193": 100}, extra_body={"return_token_ids": True})
        r = c.chat.completions.create(**auto).choices[0]
        assert 8192 in r.token_ids
        assert "<tool_call>" in (r.message.content or "") or r.message.tool_calls  # read, not skipped
        skipped = c.chat.completions.create(**{**auto, "extra_body": {"return_token_ids": True, "skip_special_tokens": True}}).choices[0]
        assert 8192 in skipped.token_ids and "<tool_call>" not in (skipped.message.content or "") and not skipped.message.tool_calls
        plain = c.chat.completions.create(model="test-model", messages=MSGS, max_tokens=24, temperature=1.0, seed=2,
                                          logit_bias={"8192": 100}, extra_body={"return_token_ids": True}).choices[0]
        assert 8192 in plain.token_ids and "<tool_call>" not in (plain.message.content or "")  # no tools: skipped, as before
        strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="test-model", messages=MSGS, tools=strict, tool_choice="required", max_tokens=8)
        assert e.value.body["param"] == "tools"


def test_a_template_in_a_format_no_parser_reads_refuses_tools():
    """A chat template teaching Llama's <|python_tag|> calls only (no parser here): a request with tools is a
    400 naming `tools` (its calls would come back as text), `tool_choice: none` and requests
    without tools are served, and `--tool-call-parser` given by the operator is taken as said."""
    tmpl = ("{% for m in messages %}[INST]{{ m['content'] }}[/INST]{% endfor %}"
            "{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}{# <|python_tag|> #}")
    with LiveServer(default_model_path(), dtype="float32", num_kv_blocks=128, max_num_seqs=4, app_kw={"chat_template": tmpl}) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="test-model", messages=MSGS, tools=TOOLS, max_tokens=4)
        assert e.value.body["param"] == "tools" and "Llama's <|python_tag|>" in e.value.body["message"]
        assert c.chat.completions.create(model="test-model", messages=MSGS, tools=TOOLS, tool_choice="none", max_tokens=4).choices
        assert c.chat.completions.create(model="test-model", messages=MSGS, max_tokens=4).choices
    with LiveServer(default_model_path(), dtype="float32", num_kv_blocks=128, max_num_seqs=4,
                    app_kw={"chat_template": tmpl, "tool_call_parser": "hermes"}) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        assert c.chat.completions.create(model="test-model", messages=MSGS, tools=TOOLS, max_tokens=4).choices


@pytest.fixture(scope="module", params=["granite", "mistral"])
def list_client(request):
    """The embedded model served with a format whose calls are a JSON list after a marker the
    server writes (Granite's `<|tool_call|>[...]`, Mistral's v3 / v7 `[TOOL_CALLS][...]`: the
    served template has no `[ARGS]`), its named and required calls under a grammar."""
    yield from _served_with_parser(request.param)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "read_file"}}, "required"])
def test_forced_list_format_calls_always_parse_and_validate(list_client, tool_choice):
    _check_forced_calls(list_client, tool_choice, {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}, max_tokens=120)


def test_list_format_auto_has_no_grammar(list_client):
    """With tool_choice auto the call opens on the marker, which a token program reads as one
    special token (tests/engine/test_token_calls.py); the embedded model's vocabulary spells it in
    pieces, so there is no grammar: strict tools and parallel_tool_calls false are refused naming
    the format and the choice."""
    strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}]
    with pytest.raises(openai.BadRequestError) as e:
        list_client.chat.completions.create(model="test-model", messages=MSGS, tools=strict, tool_choice="auto", max_tokens=4)
    assert e.value.body["param"] == "tools" and "no grammar for tool_choice auto" in e.value.body["message"]
