"""Mistral's tool calls (`mistral` parser) against mistral_common, which writes them as the models
were trained: each layout's assistant message encoded by mistral_common's own instruct tokenizer
(v3 / v7: one `[TOOL_CALLS][{...}, ...]` list; v11: `[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}` per
call; v13: no call id), decoded by cuttle's tokenizer from the tokenizer.json transformers makes of
the vocabulary (as the engine decodes sampled ids, special tokens kept), then parsed whole and
streamed token by token. Also the opening written for a forced call, as the oracle's tokens."""
from __future__ import annotations

import json
import os

import pytest

from cuttle.engine.server.chat import _forced_prefix
from cuttle.engine.tokenizer import Tokenizer
from cuttle.engine.tool_parsers import StreamingToolParser, parser_for_template, split_tool_calls
from helpers import mistral_tokenizer_dir

mistral_common = pytest.importorskip("mistral_common", reason="the oracle is mistral_common (the test extra installs it)")
from mistral_common.protocol.instruct.messages import AssistantMessage  # noqa: E402
from mistral_common.protocol.instruct.tool_calls import FunctionCall  # noqa: E402
from mistral_common.protocol.instruct.tool_calls import ToolCall as OracleCall  # noqa: E402
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer  # noqa: E402
from mistral_common.tokens.tokenizers.tekken import Tekkenizer  # noqa: E402

DATA = os.path.join(os.path.dirname(mistral_common.__file__), "data")
# layout -> (vocabulary shipped with mistral_common, the tokenizer version it is read as)
LAYOUTS = {"tekken_v3": ("tekken_240911.json", "v3"), "tekken_v7": ("tekken_240911.json", "v7"),
           "tekken_v11": ("tekken_240911.json", "v11"), "tekken_v13": ("tekken_240911.json", "v13"),
           "sentencepiece_v7": ("mistral_instruct_tokenizer_241114.model.v7", None)}
CALLS = [  # (name, arguments, id)
    [("run_tests", {"selection": "tests/a.py::t[1]", "count": 3}, "abc123def")],
    [("read_file", {"path": "naïve/☺.py", "note": "a \"quoted\" } ] [TOOL_CALLS] word"}, "A1b2C3d4E"),
     ("list_files", {}, "zzz999aaa"), ("add", {"a": {"b": [1, 2.5, None, True]}, "c": "\n\t\\"}, "000000001")],
]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, tmp_path_factory):
    """(cuttle's Tokenizer, mistral_common's instruct tokenizer, layout name) for one layout."""
    src_name, version = LAYOUTS[request.param]
    d = tmp_path_factory.mktemp(request.param)
    src = os.path.join(DATA, src_name)
    if version is not None:
        # the shipped Tekken file read as `version`; v11 / v13 need [ARGS] and [CALL_ID], which
        # the v3 file's special tokens lack, so they are added after the deprecated defaults
        j = json.load(open(src))
        specials = [dict(rank=t["rank"], token_str=str(getattr(t["token_str"], "value", t["token_str"])), is_control=True)
                    for t in Tekkenizer.DEPRECATED_SPECIAL_TOKENS]
        n = len(specials)
        specials += [dict(rank=n, token_str="[ARGS]", is_control=True), dict(rank=n + 1, token_str="[CALL_ID]", is_control=True)]
        j["config"] = {**j["config"], "version": version}
        j["special_tokens"] = specials
        src = str(d / "tekken.json")
        json.dump(j, open(src, "w"))
    return Tokenizer(mistral_tokenizer_dir(src, d)), MistralTokenizer.from_file(src).instruct_tokenizer, request.param


def _sampled(oracle, calls, content: str | None = None) -> list[int]:
    """The ids a model trained by mistral_common writes for this assistant turn (its EOS left
    out: the engine stops there and never decodes it)."""
    msg = AssistantMessage(content=content, tool_calls=[OracleCall(id=cid, function=FunctionCall(name=n, arguments=json.dumps(a)))
                                                        for n, a, cid in calls])
    ids = oracle.encode_assistant_message(msg, False)
    return ids[:-1] if ids[-1] == oracle.tokenizer.eos_id else ids


@pytest.mark.parametrize("calls", CALLS, ids=["one", "three"])
def test_calls_as_mistral_common_writes_them(layout, calls):
    tok, oracle, name = layout
    text = tok.decode(_sampled(oracle, calls), skip_special_tokens=False)
    parsed = split_tool_calls(text, "mistral")
    assert parsed.malformed == [] and parsed.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [(n, a) for n, a, _ in calls]
    if name.endswith("v13"):  # no id written: ids of 9 letters or digits, as Mistral's templates demand
        assert all(len(c.id) == 9 and c.id.isalnum() for c in parsed.calls) and len({c.id for c in parsed.calls}) == len(calls)
    else:  # the model's own ids (v3 / v7 inside the list, v11 after [CALL_ID])
        assert [c.id for c in parsed.calls] == [cid for _, _, cid in calls]
    # each call's exact text is in the model's text, in order, without overlap
    at = 0
    for c in parsed.calls:
        at = text.index(c.text, at) + len(c.text)


def test_streamed_token_by_token_equals_whole(layout):
    """Fed as the engine decodes it, one sampled token at a time: no piece of a call leaks as
    content, and the calls and content equal the whole-text parse (ids aside where the model
    wrote none)."""
    tok, oracle, _ = layout
    ids = tok.encode("Let me look.", add_special_tokens=False) + _sampled(oracle, CALLS[1])
    whole = split_tool_calls(tok.decode(ids, skip_special_tokens=False), "mistral")
    parser = StreamingToolParser("mistral")
    content, calls = "", []
    for k in range(1, len(ids) + 1):
        d, new = parser.feed(tok.decode(ids[:k], skip_special_tokens=False), final=k == len(ids))
        assert "[TOOL_CALLS]" not in d and "{" not in d
        content += d
        calls += new
    assert content.strip() == whole.content == "Let me look."
    assert [(c.name, c.arguments, c.text) for c in calls] == [(c.name, c.arguments, c.text) for c in whole.calls]
    assert len(calls) == 3


def test_content_before_the_calls(layout):
    tok, oracle, name = layout
    if name == "tekken_v3":  # v3 writes no content beside calls: mistral_common refuses such a message
        with pytest.raises(Exception, match="Cannot have tool calls and content"):  # noqa: PT011 - mistral_common's own error type
            _sampled(oracle, CALLS[0], content="I will run them.")
        return
    ids = _sampled(oracle, CALLS[0], content="I will run them.")
    parsed = split_tool_calls(tok.decode(ids, skip_special_tokens=False), "mistral")
    assert parsed.content == "I will run them." and [c.name for c in parsed.calls] == ["run_tests"]


def test_forced_opening_is_the_oracles_tokens(layout):
    """The opening written for tool_choice named / required encodes to the tokens the oracle
    writes for such a call (a prefix cut mid-merge would be text the model never saw); v11's
    written id is a fresh one, which the parsed call then carries."""
    tok, oracle, name = layout
    # each layout's template as its checkpoints spell it (SentencePiece ones write a space after
    # [TOOL_CALLS]: the vocabulary's dummy prefix, which the model saw there)
    template = {"tekken_v11": "[TOOL_CALLS]{{ n }}[CALL_ID]{{ id }}[ARGS]", "tekken_v13": "[TOOL_CALLS]{{ n }}[ARGS]",
                "sentencepiece_v7": "'[TOOL_CALLS] [' + calls|tojson"}.get(name, "'[TOOL_CALLS][' + calls|tojson")
    want = _sampled(oracle, [("read_file", {"path": "a.py"}, "abc123def")])
    for choice in ("named", "required"):
        forced = _forced_prefix("mistral", choice, "read_file", template)
        got = tok.encode(forced, add_special_tokens=False)
        if name == "tekken_v11" and choice == "named":
            cid = forced[forced.index("[CALL_ID]") + 9:forced.index("[ARGS]")]
            assert len(cid) == 9 and cid.isalnum()
            want_v11 = tok.encode(forced.replace(cid, "abc123def"), add_special_tokens=False)
            assert want[:len(want_v11)] == want_v11
            rest = tok.decode(want[len(want_v11):], skip_special_tokens=False)
            assert split_tool_calls(forced + rest, "mistral").calls[0].id == cid
        else:
            assert want[:len(got)] == got, (forced, tok.decode(want[:len(got) + 2], skip_special_tokens=False))
        assert len(got) >= (3 if choice == "named" else 1)


def test_malformed_blocks_stay_content_and_end_where_they_must():
    ok = '[TOOL_CALLS]add[ARGS]{"a": 1}'
    cases = {
        "[TOOL_CALLS]bad name[ARGS]{\"a\": 1}": 1,   # not a function name
        '[TOOL_CALLS]add[ARGS]["a"]': 1,             # arguments not an object
        '[TOOL_CALLS]add[ARGS]"a"': 1,               # not a JSON object or array at all
        "[TOOL_CALLS]add{\"a\": 1}": 1,              # no [ARGS]
        '[TOOL_CALLS][{"arguments": {}}]': 1,        # an element without a name
        "[TOOL_CALLS][]": 1,
        '[TOOL_CALLS]add[ARGS]{"a": 1': 1,           # cut off: unterminated
    }
    for bad, n in cases.items():
        parsed = split_tool_calls(bad, "mistral")
        assert parsed.calls == [] and parsed.content == bad and len(parsed.malformed) == n, bad
    # a malformed block ends at the next call's opening; the call after it is read
    parsed = split_tool_calls('[TOOL_CALLS]add[ARGS]"a" ' + ok + " done", "mistral")
    assert [c.name for c in parsed.calls] == ["add"] and parsed.malformed == ['[TOOL_CALLS]add[ARGS]"a" ']
    assert parsed.content == '[TOOL_CALLS]add[ARGS]"a"  done'.strip()
    # text after a call's JSON value is content; braces inside strings do not end it
    parsed = split_tool_calls('[TOOL_CALLS]add[ARGS]{"a": "}{"} and more', "mistral")
    assert json.loads(parsed.calls[0].arguments) == {"a": "}{"} and parsed.content == "and more"


def test_template_detection():
    assert parser_for_template("{{- '[TOOL_CALLS]' + tool_call.function.name + '[ARGS]' }}") == "mistral"
    assert parser_for_template("{{- '[TOOL_CALLS] [' }}{{ calls|tojson }}") == "mistral"
    assert _forced_prefix("mistral", "named", "f", "{{- '[TOOL_CALLS] [' }}") == '[TOOL_CALLS] [{"name": "f", "arguments":'
    assert _forced_prefix("mistral", "auto", "f", "[ARGS]") == ""


# a Mistral v11-style template (the layout and id rule of the published ones, written for this test)
V11_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ m.content }}[/INST]{% elif m.tool_calls %}{% for tc in m.tool_calls %}"
    "{% if tc.id is not string or tc.id|length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with "
    "length 9!') }}{% endif %}[TOOL_CALLS]{{ tc.function.name }}[CALL_ID]{{ tc.id }}[ARGS]{{ tc.function.arguments|tojson }}"
    "{% endfor %}</s>{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.tool_call_id }}[TOOL_CONTENT]{{ m.content }}[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}</s>{% endif %}{% endfor %}")
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_server_with_a_mistral_template():
    """Through the server: tools are taken (the template's format is parsed, not refused), a named
    call's opening is written with a fresh 9-character id (cut by max_tokens, it stays content;
    with room, the grammar makes its arguments follow the schema: a call), and a call sent back renders its JSON-text arguments as
    the object the template writes, while an id the template refuses is a 400 naming messages."""
    import httpx
    import openai

    from cuttle.engine.default_model import default_model_path
    from server_fixture import LiveServer

    user = {"role": "user", "content": "What is the weather in Oslo?"}
    with LiveServer(default_model_path(), dtype="float32", num_kv_blocks=128, max_num_seqs=4, app_kw={"chat_template": V11_TEMPLATE}) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        assert c.chat.completions.create(model="test-model", messages=[user], tools=WEATHER, max_tokens=4, temperature=0).choices
        r = c.chat.completions.create(model="test-model", messages=[user], tools=WEATHER, max_tokens=6, temperature=0,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
        assert r.finish_reason == "length" and not r.message.tool_calls
        head = "[TOOL_CALLS]get_weather[CALL_ID]"
        assert r.message.content.startswith(head) and r.message.content[len(head) + 9:].startswith("[ARGS]")
        # with room to finish, the grammar writes the arguments under the schema: a call (the city
        # bounded, so a sampled string cannot outrun max_tokens: an unbounded one did in a CI run)
        bounded = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Bergen"]}}, "required": ["city"]}
        strict = [{"type": "function", "function": {"name": "get_weather", "parameters": bounded, "strict": True}}]
        for seed in (1, 2):
            r = c.chat.completions.create(model="test-model", messages=[user], tools=strict, max_tokens=120, temperature=1.0,
                                          seed=seed, tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
            [tc] = r.message.tool_calls
            assert r.finish_reason == "tool_calls" and tc.function.name == "get_weather" and len(tc.id) == 9
            assert isinstance(json.loads(tc.function.arguments)["city"], str)
        call = {"id": "abc123def", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        turn = [user, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "abc123def", "content": "-3 C"}]
        ids = httpx.post(srv.url + "/tokenize", json={"model": "test-model", "messages": turn, "tools": WEATHER}).json()["tokens"]
        text = httpx.post(srv.url + "/detokenize", json={"model": "test-model", "tokens": ids}).json()["prompt"]
        assert '[TOOL_CALLS]get_weather[CALL_ID]abc123def[ARGS]{"city": "Oslo"}</s>[TOOL_RESULTS]abc123def' in text
        bad = [turn[0], {**turn[1], "tool_calls": [{**call, "id": "call_1"}]}]
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="test-model", messages=bad, tools=WEATHER, max_tokens=4)
        assert e.value.body["param"] == "messages" and "length 9" in e.value.body["message"]


def test_a_vocabulary_cuttle_does_not_read_is_named(tmp_path):
    """A checkpoint with a tiktoken vocabulary (Kimi-K2's) and no tokenizer.json: the error says
    which file it has and how to make the one cuttle reads (tekken.json is read:
    tests/engine/test_tekken.py)."""
    (tmp_path / "tiktoken.model").write_text("")
    with pytest.raises(FileNotFoundError, match="has tiktoken.model.*TikTokenConverter"):
        Tokenizer(str(tmp_path))
