"""Chat template rendering (engine/tokenizer.py) against transformers' `apply_chat_template` on a
Qwen3-style template: `enable_thinking`, tools, multi-turn tool loops with reasoning,
`continue_final_message`; and `--chat-template`'s path-or-inline rule (server/chat_prompt.py)."""
from __future__ import annotations

import pytest

from thinking_checkpoint import write_thinking_tokenizer

from cuttle.engine.server.chat_prompt import load_chat_template
from cuttle.engine.tokenizer import Tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATIONS = {
    "one_turn": [{"role": "user", "content": "What is 2 + 2?"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    "tool_loop": [  # the reasoning of the turn after the last query is kept, older turns' is dropped
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "<think>\nold thought\n</think>\n\nIt is sunny."},
        {"role": "user", "content": "And Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call the tool.", "tool_calls": [CALL]},
        {"role": "tool", "content": '{"temp": 21}'},
    ],
    "reasoning_alias": [  # a client sending vLLM's newer `reasoning` field: templates read reasoning_content
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": "", "reasoning": "Look it up.", "tool_calls": [CALL]},
        {"role": "tool", "content": "21"},
    ],
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    path = str(tmp_path_factory.mktemp("qwen3_template"))
    write_thinking_tokenizer(path)
    tok = Tokenizer(path)
    hf = PreTrainedTokenizerFast(tokenizer_file=f"{path}/tokenizer.json", eos_token="<|im_end|>",
                                 chat_template=tok.chat_template)
    return tok, hf


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no_tools", "tools"])
@pytest.mark.parametrize("thinking", [{}, {"enable_thinking": False}, {"enable_thinking": True}], ids=["default", "off", "on"])
def test_renders_as_transformers_does(tokenizers, name, tools, thinking):
    tok, hf = tokenizers
    msgs = CONVERSATIONS[name]
    ours = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, **thinking)
    theirs = hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True, **thinking)
    assert ours == theirs
    if thinking.get("enable_thinking") is False:
        assert ours.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    else:
        assert ours.endswith("<|im_start|>assistant\n")
    assert tok.encode(ours, add_special_tokens=False) == hf.apply_chat_template(
        msgs, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False, **thinking)


@pytest.mark.parametrize("final", ["The answer is", "The answer is  ", "<think>\nLet me see"])
def test_continue_final_message_as_transformers(tokenizers, final):
    tok, hf = tokenizers
    msgs = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": final}]
    ours = tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    theirs = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert ours == theirs and not ours.endswith("<|im_end|>\n")
    with pytest.raises(ValueError, match="cannot both be true"):
        tok.apply_chat_template(msgs, add_generation_prompt=True, continue_final_message=True)


def test_template_variables_and_other_templates(tokenizers):
    tok, _ = tokenizers
    assert {"enable_thinking", "messages", "tools", "add_generation_prompt"} <= tok.template_variables(None)
    assert "namespace" not in tok.template_variables(None)  # the environment's globals are not the caller's
    other = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if greet %}hello{% endif %}"
    assert tok.template_variables(other) == {"messages", "greet"}
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=other, greet=True) == "[user] x\nhello"
    with pytest.raises(ValueError, match="does not compile"):
        tok.compile_template("{% for %}")


def test_chat_template_argument_is_a_path_or_inline(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}\n")
    assert load_chat_template(str(f)) == "{{ messages[0].content }}\n"
    assert load_chat_template("{{ messages[0].content }}\\n") == "{{ messages[0].content }}\n"  # escapes decoded, as vLLM
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    assert load_chat_template(None) is None


def test_developer_messages_render_as_system_where_the_template_drops_them(tokenizers):
    """OpenAI's developer role is its system role. Qwen3's template renders system, user,
    assistant and tool only, and transformers renders a developer message there as nothing (the
    instructions silently lost); cuttle renders it as the system message. A template that writes
    the developer role keeps it."""
    tok, hf = tokenizers
    dev = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    sysm = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    assert "Answer in French." not in hf.apply_chat_template(dev, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(dev) == tok.apply_chat_template(sysm) == hf.apply_chat_template(
        sysm, tokenize=False, add_generation_prompt=True)
    own = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    assert tok.apply_chat_template(dev, chat_template=own) == "<developer>Answer in French.<user>Hi"


# the tool-call loops of Qwen3-Coder's and GLM-4.5's templates, which iterate a call's arguments
# as an object (`|items`, `.items()`): what transformers documents and vLLM sends them
CODER_TEMPLATE = ("{% for m in messages %}{% if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>\n<function={{ tc.function.name }}>\n"
                  "{% for k, v in tc.function.arguments|items %}<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}</function>\n"
                  "</tool_call>{% endfor %}{% else %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}")
GLM_TEMPLATE = ("{% for m in messages %}{% if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>{{ tc.function.name }}\n"
                "{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v | tojson if v is not string "
                "else v }}</arg_value>\n{% endfor %}</tool_call>{% endfor %}{% else %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}")

# Mistral's two layouts write the arguments with tojson: JSON text would reach the model quoted
MISTRAL_TEMPLATE = ("{% for m in messages %}{% if m.tool_calls %}{% for tc in m.tool_calls %}[TOOL_CALLS]{{ tc.function.name }}"
                    "[ARGS]{{ tc.function.arguments|tojson }}{% endfor %}{% else %}[{{ m.role }}]{{ m.content }}{% endif %}{% endfor %}")
MISTRAL_LIST_TEMPLATE = ("{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS] [{% for tc in m.tool_calls %}"
                         "{{ tc.function|tojson }}{% endfor %}]{% else %}[{{ m.role }}]{{ m.content }}{% endif %}{% endfor %}")

# Llama 3.1's layout: the call is the reply, its arguments written with tojson
LLAMA_TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{% if m.tool_calls %}"
                  "{% set tc = m.tool_calls[0].function %}{{ '{\"name\": \"' + tc.name + '\", ' }}{{ '\"parameters\": ' }}"
                  "{{ tc.arguments|tojson }}{{ '}' }}{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}")

# Qwen2.5's layout: hermes calls whose arguments are written with tojson whatever they are
QWEN25_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>\n"
                   "{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments|tojson }}}\n</tool_call>"
                   "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}")


@pytest.mark.parametrize("template", [CODER_TEMPLATE, GLM_TEMPLATE, MISTRAL_TEMPLATE, MISTRAL_LIST_TEMPLATE, LLAMA_TEMPLATE, QWEN25_TEMPLATE],
                         ids=["qwen3_coder", "glm45", "mistral", "mistral_list", "llama3", "qwen2.5"])
def test_templates_that_iterate_arguments_get_them_as_an_object(tokenizers, template):
    """A client sends a call back with OpenAI's JSON-text arguments: a template that iterates them
    as an object, or writes them with tojson (Mistral's, Llama's), gets the object (transformers' rendering of the same call with dict arguments
    is the oracle); Qwen3's template, which writes text as is, keeps the text; arguments that are
    not a JSON object are a clear error, not a server error."""
    tok, hf = tokenizers
    args = '{"city": "Paris", "days": 3, "units": ["C"]}'
    sent = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "content": "21"}]
    as_object = [sent[0], {**sent[1], "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": {
        "city": "Paris", "days": 3, "units": ["C"]}}}]}, sent[2]]
    got = tok.apply_chat_template(sent, chat_template=template, add_generation_prompt=False)
    assert got == hf.apply_chat_template(as_object, chat_template=template, tokenize=False, add_generation_prompt=False)
    assert "<parameter=days>\n3\n" in got or "<arg_value>3</arg_value>" in got or '"arguments": {"city": "Paris", "days": 3' in got \
        or '[ARGS]{"city": "Paris", "days": 3' in got or '"parameters": {"city": "Paris", "days": 3' in got \
        or '"arguments": {"city": "Paris", "days": 3' in got
    assert '"arguments": ' + args in tok.apply_chat_template(sent, add_generation_prompt=False)  # Qwen3's: the text as sent
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\].function.arguments must be a JSON object"):
        tok.apply_chat_template([sent[0], {**sent[1], "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}]}],
                                chat_template=template, add_generation_prompt=False)
    deep = "[" * 50000 + "]" * 50000  # nested past json's recursion limit: the same clear error, not a crash
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\].function.arguments must be a JSON object"):
        tok.apply_chat_template([sent[0], {**sent[1], "tool_calls": [{**CALL, "function": {"name": "f", "arguments": deep}}]}],
                                chat_template=template, add_generation_prompt=False)
