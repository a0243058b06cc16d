"""Tool-call parsing on recorded model outputs, whole and streamed at awkward split points."""
from __future__ import annotations

import json
import random

import pytest

from cuttle.engine.tool_parsers import StreamingToolParser, parse_tool_calls, parser_for_template, split_tool_calls

HERMES = (
    "Let me check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
    "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 40}}\n</tool_call>"
)
CODER = (
    "<tool_call>\n<function=run_tests>\n<parameter=selection>\ntests/test_app.py::test_x\n</parameter>\n"
    "<parameter=verbose>\ntrue\n</parameter>\n<parameter=count>\n3\n</parameter>\n</function>\n</tool_call>"
)
# Seed-OSS's: qwen3_coder's XML inside <seed:tool_call>
SEED = "Running.\n" + CODER.replace("<tool_call>", "<seed:tool_call>").replace("</tool_call>", "</seed:tool_call>")
# GLM-4.5 / 4.6's layout (newlines between the tags), then GLM-4.7's (none) in one text
GLM = (
    "I'll run them.<tool_call>run_tests\n<arg_key>selection</arg_key>\n<arg_value>tests/test_app.py::test_x</arg_value>\n"
    "<arg_key>verbose</arg_key>\n<arg_value>true</arg_value>\n<arg_key>count</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    "<tool_call>run_tests<arg_key>selection</arg_key><arg_value> two  words\n</arg_value></tool_call>"
)
# DeepSeek-V3's layout (function / ```json fences) and V3.1's (NAME<｜tool▁sep｜>ARGS), two calls in one section
DS_V3 = ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>run_tests\n```json\n"
         '{"selection": "tests/a.py", "count": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>run_tests\n'
         '```json\n{"verbose": true}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DS_V31 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>run_tests<｜tool▁sep｜>{"selection": "é \\"x\\"", "count": 3}<｜tool▁call▁end｜>'
          '<｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜> then text')
# MiniMax-M2's: two invokes in one section, typed and string values
MINIMAX = ('Let me run them.\n<minimax:tool_call>\n<invoke name="run_tests">\n<parameter name="selection">tests/a.py</parameter>\n'
           '<parameter name="count">3</parameter>\n<parameter name="verbose">true</parameter>\n</invoke>\n<invoke name="run_tests">\n'
           '<parameter name="selection">\n  two  words\n\n</parameter>\n</invoke>\n</minimax:tool_call>')
# Mistral's: v11's calls (one with its id) with text before, and v3's list, spaced as SentencePiece writes it
MISTRAL = ('Running.[TOOL_CALLS]run_tests[CALL_ID]a1B2c3D4e[ARGS]{"selection": "t[1] ]}", "count": 3}'
           '[TOOL_CALLS]add[ARGS] {"a": {"b": [2]}}')
MISTRAL_LIST = '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2}}, {"name": "list_files", "arguments": {}, "id": "xyz987QRS"}]'
# Llama 3.x: the reply is the call(s), `;` between them; a <|python_tag|> may come first
LLAMA = '{"name": "run_tests", "parameters": {"selection": "t[1] }", "count": 3}}; {"name": "add", "arguments": {"a": 2}}'
LLAMA_TAG = '<|python_tag|>{"name": "add", "parameters": {}}'
# Kimi-K2's: two calls in a section, each id `functions.NAME:IDX`
KIMI = ('Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.run_tests:0<|tool_call_argument_begin|>'
        '{"selection": "t.py", "count": 3}<|tool_call_end|>\n<|tool_call_begin|> functions.add:1 <|tool_call_argument_begin|>'
        '{"a": 2}<|tool_call_end|><|tool_calls_section_end|> done')
# Granite 3.x's: <|tool_call|> then a JSON list of calls
GRANITE = 'Sure.<|tool_call|>[{"name": "add", "arguments": {"a": "[1]"}}, {"name": "run_tests", "arguments": {"count": 3}}]'
TOOLS = [{"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object", "properties": {
    "selection": {"type": "string"}, "verbose": {"type": "boolean"}, "count": {"type": "integer"}}}}}]


def test_hermes_whole():
    content, calls = parse_tool_calls(HERMES, "hermes")
    assert content == "Let me check both."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 40})]
    assert len({c.id for c in calls}) == 2


def test_qwen3_coder_whole_uses_schema_types():
    content, calls = parse_tool_calls(CODER, "qwen3_coder", TOOLS)
    assert content == ""
    assert calls[0].name == "run_tests"
    assert json.loads(calls[0].arguments) == {"selection": "tests/test_app.py::test_x", "verbose": True, "count": 3}


def test_seed_oss_whole_uses_schema_types():
    """Seed-OSS's calls are qwen3_coder's XML in `<seed:tool_call>`: the same arguments; a plain
    `<tool_call>` is not one of its calls."""
    content, calls = parse_tool_calls(SEED, "seed_oss", TOOLS)
    assert content == "Running." and calls[0].text.startswith("<seed:tool_call>")
    assert json.loads(calls[0].arguments) == {"selection": "tests/test_app.py::test_x", "verbose": True, "count": 3}
    assert parse_tool_calls(CODER, "seed_oss", TOOLS) == (CODER, [])
    assert parser_for_template("{{- '<seed:tool_call>\\n<function=' + tc.name }}") == "seed_oss"
    from cuttle.engine.server.chat import _forced_prefix

    assert _forced_prefix("seed_oss", "named", "run_tests") == "<seed:tool_call>\n<function=run_tests>\n"


def test_glm45_whole_both_layouts():
    """String values are the text between the value tags less one whitespace character beside
    each tag (the separator xgrammar's glm_xml style admits there, as for qwen3_coder); typed
    ones follow the tool's schema."""
    content, calls = parse_tool_calls(GLM, "glm45", TOOLS)
    assert content == "I'll run them."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("run_tests", {"selection": "tests/test_app.py::test_x", "verbose": True, "count": 3}),
        ("run_tests", {"selection": "two  words"})]
    assert "".join(c.text for c in calls) == GLM[len("I'll run them."):]
    _, [bare] = parse_tool_calls("<tool_call>list_files\n</tool_call>", "glm45")
    assert (bare.name, bare.arguments) == ("list_files", "{}")
    # no name, or text between the name and the first pair, is not a call: the block stays content
    for broken in ("<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
                   "<tool_call>run now<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"):
        assert parse_tool_calls(broken, "glm45") == (broken, [])


def test_deepseek_whole_both_layouts():
    """The calls of a section, the section markers neither content nor calls; arguments as
    json.dumps writes them; a call that does not parse stays content, its markers with it."""
    content, calls = parse_tool_calls(DS_V3, "deepseek_v3", TOOLS)
    assert content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("run_tests", {"selection": "tests/a.py", "count": 3}),
                                                                  ("run_tests", {"verbose": True})]
    content, calls = parse_tool_calls(DS_V31, "deepseek_v31", TOOLS)
    assert content == "then text"
    assert [(c.name, c.arguments) for c in calls] == [("run_tests", '{"selection": "\\u00e9 \\"x\\"", "count": 3}'), ("add", '{"a": 2}')]
    assert all(c.text.startswith("<｜tool▁call▁begin｜>") and c.text.endswith("<｜tool▁call▁end｜>") for c in calls)
    broken = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{not json}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    parsed = split_tool_calls(broken, "deepseek_v31")
    assert parsed.calls == [] and parsed.content == "<｜tool▁call▁begin｜>add<｜tool▁sep｜>{not json}<｜tool▁call▁end｜>"
    assert parsed.malformed == [parsed.content]
    assert parse_tool_calls(DS_V31, "deepseek_v3", TOOLS)[1] == []  # V3.1's layout is not V3's


def test_minimax_whole_uses_schema_types():
    content, calls = parse_tool_calls(MINIMAX, "minimax_m2", TOOLS)
    assert content == "Let me run them."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("run_tests", {"selection": "tests/a.py", "count": 3, "verbose": True}), ("run_tests", {"selection": "  two  words\n"})]
    assert calls[0].text.startswith('<invoke name="run_tests">') and calls[0].text.endswith("</invoke>")
    assert parse_tool_calls('<minimax:tool_call><invoke name=run_tests></invoke></minimax:tool_call>', "minimax_m2")[1] == []


@pytest.mark.parametrize("before,after,value", [
    ("\n", "\n", "a b "),   # the template's layout: a value's own trailing space is kept
    ("", " ", "abc"),         # the grammar's other separators: one space / tab / CR beside a tag
    ("\t", "\r", "abc"),
    ("\n", "", "  x"),       # indentation after the separator is the value's
    ("\n", "\n", "x\n"),    # one separator only; the rest is the value's
])
def test_qwen3_coder_one_whitespace_beside_each_tag_is_the_separator(before, after, value):
    text = f"<tool_call>\n<function=run_tests>\n<parameter=selection>{before}{value}{after}</parameter>\n</function>\n</tool_call>"
    _, calls = parse_tool_calls(text, "qwen3_coder", TOOLS)
    assert json.loads(calls[0].arguments) == {"selection": value}


def test_mistral_whole_both_layouts():
    """v11 / v13's `[TOOL_CALLS]NAME[ARGS]{...}` calls (the model's [CALL_ID] is the call's id,
    others get 9 letters or digits, as Mistral's templates demand) and v3 / v7's list, each
    element a call with its own text; a call ends where its JSON value does."""
    content, calls = parse_tool_calls(MISTRAL, "mistral", TOOLS)
    assert content == "Running."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("run_tests", {"selection": "t[1] ]}", "count": 3}),
                                                                  ("add", {"a": {"b": [2]}})]
    assert calls[0].id == "a1B2c3D4e" and len(calls[1].id) == 9 and calls[1].id.isalnum()
    assert "".join(c.text for c in calls) == MISTRAL[len("Running."):]
    content, calls = parse_tool_calls(MISTRAL_LIST, "mistral")
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("add", '{"a": 2}'), ("list_files", "{}")]
    assert calls[1].id == "xyz987QRS" and calls[0].text == '{"name": "add", "arguments": {"a": 2}}'


def test_granite_whole():
    """Granite's `<|tool_call|>` list (or one object): each element a call with its own text; a
    list with a nameless element, or JSON that is no list of calls, stays content."""
    content, calls = parse_tool_calls(GRANITE, "granite")
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": "[1]"}), ("run_tests", {"count": 3})]
    assert calls[0].text == '{"name": "add", "arguments": {"a": "[1]"}}' and calls[0].id.startswith("call_")
    assert parse_tool_calls('<|tool_call|>{"name": "add", "arguments": {}}', "granite")[1][0].name == "add"
    for bad in ('<|tool_call|>[{"arguments": {}}]', "<|tool_call|>[1, 2]", '<|tool_call|>"add"'):
        assert split_tool_calls(bad, "granite").malformed == [bad], bad
    assert parser_for_template("{{- '<|tool_call|>' + message.tool_calls|tojson }}") == "granite"


def test_kimi_k2_whole():
    """The calls of a section (its markers neither content nor calls), each call's id the
    `functions.NAME:IDX` the model wrote (Kimi's templates write it back); a call without such an
    id, or with arguments that are not an object, stays content."""
    content, calls = parse_tool_calls(KIMI, "kimi_k2", TOOLS)
    assert content == "Checking.\n done"
    assert [(c.id, c.name, json.loads(c.arguments)) for c in calls] == [
        ("functions.run_tests:0", "run_tests", {"selection": "t.py", "count": 3}), ("functions.add:1", "add", {"a": 2})]
    for bad in ("<|tool_call_begin|>functions.add<|tool_call_argument_begin|>{}<|tool_call_end|>",
                "<|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>[1]<|tool_call_end|>"):
        assert split_tool_calls(bad, "kimi_k2").malformed == [bad]
    assert parser_for_template("{{- '<|tool_calls_section_begin|>' -}}") == "kimi_k2"
    # a forced call is numbered after the conversation's calls, as Kimi numbers them
    from cuttle.engine.server.chat import _calls_before, _forced_prefix

    turns = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": "functions.a:0"}, {"id": "functions.b:1"}]},
             {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    forced = _forced_prefix("kimi_k2", "named", "add", None, _calls_before(turns))
    assert forced == "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:2<|tool_call_argument_begin|>"
    assert parse_tool_calls(forced + '{"a": 1}<|tool_call_end|><|tool_calls_section_end|>', "kimi_k2")[1][0].id == "functions.add:2"
    replayed = [turns[0], {"role": "assistant", "content": "<|tool_calls_section_begin|>..."}, *turns[2:]]  # (ToolCallReplay's form)
    assert _calls_before(replayed) == 2


def test_llama3_json_whole():
    """Llama 3.x's calls are the reply itself: JSON objects from its start (`parameters`, or
    `arguments`), `;` between them, an optional <|python_tag|> first; JSON later in an answer,
    or JSON that is no call, is content; a call broken or cut off is malformed content."""
    content, calls = parse_tool_calls(LLAMA, "llama3_json")
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("run_tests", {"selection": "t[1] }", "count": 3}), ("add", {"a": 2})]
    assert [c.text for c in calls] == [LLAMA[:LLAMA.index(";")], LLAMA[LLAMA.index(";") + 2:]]
    assert [(c.name, c.arguments) for c in parse_tool_calls(LLAMA_TAG, "llama3_json")[1]] == [("add", "{}")]
    for text in ('Sure: {"name": "add", "parameters": {}}', '{"result": 1}', '<|python_tag|>brave_search.call(query="x")', ""):
        assert parse_tool_calls(text, "llama3_json") == (text, [])
    parsed = split_tool_calls('{"name": "add", "parameters": [1]}', "llama3_json")
    assert parsed.calls == [] and parsed.malformed == ['{"name": "add", "parameters": [1]}']
    parsed = split_tool_calls('{"name": "add", "parameters": {}} and then some', "llama3_json")
    assert [c.name for c in parsed.calls] == ["add"] and parsed.content == "and then some"
    cut = split_tool_calls('{"name": "add", "parameters": {"a": 1}}; {"name": "add", "param', "llama3_json")
    assert len(cut.calls) == 1 and cut.malformed == ['{"name": "add", "param'] and cut.content == '; {"name": "add", "param'


def test_llama3_json_streams_content_at_once_when_the_reply_is_no_call():
    """Text that cannot start a call is sent as it comes; a reply that may be one is held."""
    parser = StreamingToolParser("llama3_json")
    assert parser.feed("  <|python") == ("", [])
    assert parser.feed('  <|python_tag|>{"name": "add", "par') == ("", [])
    parser = StreamingToolParser("llama3_json")
    assert parser.feed("Hello") == ("Hello", [])
    assert parser.feed('Hello {"name": "add"') == (' {"name": "add"', [])


def test_plain_text_and_broken_calls_stay_content():
    text = "def f():\n    return 1  # <tool_call> is just a word here"
    assert parse_tool_calls(text) == (text, [])
    broken = "<tool_call>\n{not json}\n</tool_call> done"
    content, calls = parse_tool_calls(broken)
    assert calls == [] and content == broken


@pytest.mark.parametrize("fmt,text", [("hermes", HERMES), ("qwen3_coder", CODER), ("glm45", GLM), ("deepseek_v3", DS_V3),
                                      ("deepseek_v31", DS_V31), ("deepseek_v31", "no call <｜tool▁calls▁begin｜>just text"),
                                      ("minimax_m2", MINIMAX), ("mistral", MISTRAL), ("mistral", MISTRAL_LIST),
                                      ("mistral", 'x [TOOL_CALLS]add[ARGS]"a" [TOOL_CALLS]add[ARGS]{"a": 1} [TOOL_CALLS]add[ARGS]{"a'),
                                      ("kimi_k2", KIMI), ("granite", GRANITE), ("granite", '<|tool_call|>{"name": "add"'),
                                      ("seed_oss", SEED), ("llama3_json", LLAMA), ("llama3_json", "  " + LLAMA_TAG + "\n"),
                                      ("llama3_json", 'As JSON: {"name": "add", "parameters": {}}'),
                                      ("llama3_json", '{"result": [1, 2]} is the answer'),
                                      ("llama3_json", '{"name": "add", "parameters": {"a": 1}}; then {"name": "x"'),
                                      ("llama3_json", '{"name": "add", "parameters": {"a": 1}}; {"name": "bro'),
                                      ("hermes", "no calls at all <tool_ca"),
                                      ("hermes", "text <tool_call>\n{\"name\": \"x\", \"argu")])
@pytest.mark.parametrize("seed", range(12))
def test_streaming_equals_whole_for_any_split(fmt, text, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 25))))
    if seed == 0:
        cuts = list(range(1, len(text)))  # one character at a time
    parser = StreamingToolParser(fmt, TOOLS)
    content, calls = "", []
    # a block already known malformed is content mid-stream; anything that may still be a call never is
    settled = any(text.index(m) + len(m) < len(text) for m in split_tool_calls(text, fmt, TOOLS).malformed)
    for c in cuts + [len(text)]:
        final = c == len(text)
        d, new = parser.feed(text[:c], final=final)
        assert final or settled or not any(m in d for m in ("<tool_call", "<｜tool", "<invoke", "<minimax", "[TOOL_CALLS]", "[ARGS]", "<|tool_call", "<seed:", "<|tool_call|>"))
        content += d
        calls += new
    whole_content, whole_calls = parse_tool_calls(text, fmt, TOOLS)
    assert [(c.name, c.arguments, c.text) for c in calls] == [(c.name, c.arguments, c.text) for c in whole_calls]
    if whole_calls:
        assert content.strip() == whole_content
    else:
        assert content == whole_content


def test_parser_choice_from_template():
    assert parser_for_template("... <function=example> ...") == "qwen3_coder"
    assert parser_for_template("{{ '<tool_call>' }}") == "hermes"
    assert parser_for_template("<tool_call>{{ tc.name }}\n{% for k, v in a %}<arg_key>{{ k }}</arg_key>") == "glm45"
    v3 = "'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json'"
    assert parser_for_template(v3) == "deepseek_v3"
    assert parser_for_template("'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>'") == "deepseek_v31"
    assert parser_for_template("{{ '<minimax:tool_call>' }}\n<invoke name=") == "minimax_m2"
    assert parser_for_template("{{- '[TOOL_CALLS]' + tool_call.function.name + '[ARGS]' }}") == "mistral"
    llama = "<|start_header_id|>assistant<|end_header_id|>\n\n{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}"
    assert parser_for_template(llama) == "llama3_json"
    with pytest.raises(ValueError, match="tool-call parser"):
        parse_tool_calls("x", "pythonic")


def test_foreign_formats_are_named():
    from cuttle.engine.tool_parsers import foreign_tool_format

    assert foreign_tool_format("{{ '[TOOL_CALLS]' + tool_calls|tojson }}") is None  # Mistral's is parsed
    assert foreign_tool_format("{{- '<|python_tag|>' + tool_call.name }}") == "Llama's <|python_tag|> calls"
    assert foreign_tool_format("<|tool_calls_section_begin|><|tool_call_begin|>") is None  # Kimi-K2's is parsed
    assert foreign_tool_format("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>") is None  # DeepSeek's is parsed
    assert foreign_tool_format("{{ '<tool_call>' }} ... <|python_tag|>") is None  # one of ours is there
    assert foreign_tool_format("{{ messages }}") is None and foreign_tool_format(None) is None


def test_calls_keep_the_exact_block_the_model_wrote():
    # spacing and key order the canonical re-serialisation would change: the text keeps them
    text = 'ok <tool_call>\n{"arguments": {"path":"a.py"},  "name": "read_file"}\n</tool_call>\n' + CODER
    _, calls = parse_tool_calls(text, "hermes")
    assert calls[0].arguments == '{"path": "a.py"}'
    assert calls[0].text == '<tool_call>\n{"arguments": {"path":"a.py"},  "name": "read_file"}\n</tool_call>'
    assert text.count(calls[0].text) == 1
    _, coder = parse_tool_calls(CODER, "qwen3_coder", TOOLS)
    assert coder[0].text == CODER
    assert "text" not in json.dumps(coder[0].to_openai())  # the wire format is unchanged


def test_split_reports_malformed_blocks_verbatim():
    broken = '<tool_call>\n{not json}\n</tool_call>'
    good = '<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>'
    cut = '<tool_call>\n{"name": "y", "argu'
    parsed = split_tool_calls(f"a {broken} b {good} c {cut}")
    assert [c.name for c in parsed.calls] == ["x"]
    assert parsed.malformed == [broken, cut]
    assert parsed.content == f"a {broken} b  c {cut}".strip()
    assert split_tool_calls(HERMES).malformed == []


# calls as the tool-call grammar writes them, with what a JSON writer may do inside the arguments:
# compact or spaced separators, escapes (\u, \/, surrogate pairs), raw non-ASCII, numbers Python
# writes back differently (1E3, -0, 2.50), nesting, a string VALUE
GRAMMAR_CALLS = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "write_file", "arguments": {"path":"a/b.py","text":"def f():\\n    return \\"é\\u00e9\\ud83d\\ude00 \\/\\"\\n","n":1E3,'
               '"xs":[ -0 ,2.50,true,null,{}],"o":{"k":[]}}}\n</tool_call>\nDone.'),
    ("hermes", '<tool_call>\n{"name": "say", "arguments": "plain \\u00e9 text"}\n</tool_call>'
               '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>'),
    ("qwen3_coder", CODER),
    ("qwen3_coder", "<tool_call>\n<function=run_tests>\n<parameter=selection>\n  indented \"q\" é\n\n</parameter>\n"
                    "<parameter=count>\nnot a number\n</parameter>\n</function>\n</tool_call>"),
    ("glm45", GLM),
    ("glm45", "<tool_call>run_tests\n<arg_key>count</arg_key>\n<arg_value>not a number</arg_value>\n<arg_key>selection</arg_key>\n"
              "<arg_value>  \"q\" é <arg_key>\ud83d\ude00</arg_value>\n</tool_call> after"),
    ("deepseek_v3", DS_V3),
    ("deepseek_v31", DS_V31),
    ("seed_oss", SEED),
    ("minimax_m2", MINIMAX),
    ("llama3_json", '{"name": "write_file", "parameters": {"path":"a/b.py","text":"def f():\\n    return \\"\\u00e9\\ud83d\\ude00 \\/\\"","n":1E3,'
                    '"xs":[ -0 ,2.50,true,null,{}],"o":{"k":[]}}}'),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 40}}; {"name": "say", "parameters": {"t": "}{;"}}'
                    ' and then some text'),
    # not as the grammar writes it (compact, `arguments`): read whole, the same either way
    ("llama3_json", '{"name":"add","arguments":{"a": 1}}; {"name": "add", "parameters": {"a": 3}}'),
]


@pytest.mark.parametrize("fmt,text", GRAMMAR_CALLS)
@pytest.mark.parametrize("seed", range(10))
def test_incremental_calls_add_up_to_the_whole_parse(fmt, text, seed):
    """Streamed with `incremental` (calls under the grammar), a call's id and name come once its
    opening is complete and its arguments piece by piece; for any split the pieces add up to the
    whole-text parse's arguments, and the content to its content."""
    rng = random.Random(seed)
    cuts = list(range(1, len(text))) if seed == 0 else sorted(rng.sample(range(1, len(text)), k=rng.randint(1, 40)))
    parser = StreamingToolParser(fmt, TOOLS, incremental=True)
    content, args, firsts = "", {}, []
    for c in cuts + [len(text)]:
        d, pieces = parser.feed_deltas(text[:c], final=c == len(text))
        assert c == len(text) or not any(m in d for m in ("<tool_call", "<｜tool", "<seed:", "<invoke", "<minimax"))
        content += d
        for p in pieces:
            if p.first:
                firsts.append((p.index, p.call.name))
            args[p.index] = args.get(p.index, "") + p.arguments
    whole_content, whole_calls = parse_tool_calls(text, fmt, TOOLS)
    assert firsts == [(i, c.name) for i, c in enumerate(whole_calls)]
    assert [args[i] for i in range(len(whole_calls))] == [c.arguments for c in whole_calls]
    assert [(c.text, c.complete) for c in parser.calls] == [(c.text, True) for c in whole_calls]
    assert content.strip() == whole_content
    if seed == 0:  # a character at a time: the arguments really come in many pieces
        assert max(len(a) for a in args.values()) > 1 and len(cuts) > 10


@pytest.mark.parametrize("fmt,text", GRAMMAR_CALLS)
def test_a_call_cut_off_is_a_call_with_its_arguments_so_far(fmt, text):
    """Cut anywhere after a call's opening (max_tokens), the call is reported with the arguments
    written so far, `complete` false: the same streamed (any split) as whole (`final` at once);
    cut before its opening is complete, the text is content, as without calls."""
    for n in range(1, len(text)):
        cut = text[:n]
        whole = StreamingToolParser(fmt, TOOLS, incremental=True)
        content, _ = whole.feed_deltas(cut, final=True)
        streamed = StreamingToolParser(fmt, TOOLS, incremental=True)
        s_content, args = "", {}
        for c in range(1, n + 1, 3):
            d, pieces = streamed.feed_deltas(cut[:c], final=False)
            s_content += d
            for p in pieces:
                args[p.index] = args.get(p.index, "") + p.arguments
        d, pieces = streamed.feed_deltas(cut, final=True)
        s_content += d
        for p in pieces:
            args[p.index] = args.get(p.index, "") + p.arguments
        assert s_content == content
        assert [(c.name, c.arguments, c.complete) for c in streamed.calls] == [(c.name, c.arguments, c.complete) for c in whole.calls]
        assert [args[i] for i in range(len(whole.calls))] == [c.arguments for c in whole.calls]
        assert all(c.complete for c in whole.calls[:-1])
        full = parse_tool_calls(text, fmt, TOOLS)[1]
        for c, f in zip(whole.calls, full):  # what was written is the start of the finished arguments
            assert f.arguments.startswith(c.arguments) and c.name == f.name


@pytest.mark.parametrize("fmt", ["deepseek_v3", "deepseek_v31", "glm45", "minimax_m2"])
def test_forced_openings_parse_with_what_the_model_writes_after_them(fmt):
    """The server writes a required / named call's opening for the model (chat._forced_prefix) and
    parses it with the output: each format's opening plus a well-formed rest is that call."""
    from cuttle.engine.server.chat import _forced_prefix

    rest = {"deepseek_v3": ('{"a": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', 'add\n```json\n{"a": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
            "deepseek_v31": ('{"a": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', 'add<｜tool▁sep｜>{"a": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
            "glm45": ("\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
                      "add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"),
            "minimax_m2": ('<parameter name="a">1</parameter>\n</invoke>\n</minimax:tool_call>',
                           'add">\n<parameter name="a">1</parameter>\n</invoke>\n</minimax:tool_call>')}[fmt]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
    for choice, after in zip(("named", "required"), rest):
        content, [call] = parse_tool_calls(_forced_prefix(fmt, choice, "add") + after, fmt, tools)
        assert (content, call.name, json.loads(call.arguments)) == ("", "add", {"a": 1})


def test_cli_offers_every_parser(capsys):
    from cuttle.engine.cli import main
    from cuttle.engine.tool_parsers import PARSERS

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    from cuttle.engine.reasoning_parsers import REASONING_PARSERS

    out = "".join(capsys.readouterr().out.split())
    assert "{" + ",".join(PARSERS) + "}" in out and "{" + ",".join(REASONING_PARSERS) + "}" in out


def test_json_scan_resumed_at_any_cut_finds_the_one_shot_end():
    """The streaming parsers scan a call's JSON once in all (`_JsonScanner`, resumed as the text
    grows: Mistral's and Llama's calls have no closing tag, and rescanning a long argument at
    every token made a 21 KB call cost seconds): resumed at every cut, escapes and quotes cut in
    half included, it finds the end a one-shot scan finds."""
    from cuttle.engine.tool_parsers import _json_end, _JsonScanner

    text = 'x{"a": "q\\\\\\"}[ {", "b": [1, {"c": "\\\\"}], "d": "}"} tail'
    start = text.index("{")
    want = _json_end(text, start, len(text))
    assert text[want - 1] == "}" and text[want:] == " tail"
    for cut in range(start, len(text) + 1):
        for step in (1, 3):
            scan, got = _JsonScanner(start), None
            for c in list(range(start, cut, step)) + [cut, len(text)]:
                got = scan.end(text[:c], c)
                if got is not None:
                    break
            assert got == want, (cut, step)


def test_json_nested_past_the_recursion_limit_is_malformed_not_a_crash():
    """A model can write JSON nested deeper than json.loads recurses (RecursionError): such a call
    is malformed content in every JSON format, whole and streamed, never an exception."""
    deep = "[" * 50000 + "]" * 50000
    texts = {"hermes": f'<tool_call>\n{{"name": "add", "arguments": {{"a": {deep}}}}}\n</tool_call>',
             "mistral": f'[TOOL_CALLS]add[ARGS]{{"a": {deep}}}', "llama3_json": f'{{"name": "add", "parameters": {{"a": {deep}}}}}',
             "deepseek_v31": f"<｜tool▁call▁begin｜>add<｜tool▁sep｜>{{\"a\": {deep}}}<｜tool▁call▁end｜>",
             "kimi_k2": f"<|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>{{\"a\": {deep}}}<|tool_call_end|>",
             "granite": f'<|tool_call|>[{{"name": "add", "arguments": {{"a": {deep}}}}}]'}
    for fmt, text in texts.items():
        parsed = split_tool_calls(text, fmt)
        assert parsed.calls == [] and parsed.malformed, fmt
        streamed = StreamingToolParser(fmt)
        content, calls = streamed.feed(text[: len(text) // 2])
        more, later = streamed.feed(text, final=True)
        assert calls + later == [] and content + more == text, fmt
