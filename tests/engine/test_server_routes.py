"""The server's vLLM-shaped chat features on a Qwen3-style checkpoint, through the official `openai`
client (httpx where the client has no method): `--reasoning-parser qwen3` splitting scripted
Qwen3 outputs (thinking + tool calls) whole and streamed, `chat_template_kwargs`, per-request
`chat_template`, `add_generation_prompt` / `continue_final_message`, chat `echo`, /tokenize,
/detokenize, /version, and `Logprob.decoded_token`.

The model is random, so its outputs are scripted: the engine's sampler is replaced by one that
returns a fixed token sequence for a request whose `seed` names a script (then <|im_end|>), and
samples normally otherwise. Everything after sampling (detokenizing, stops, deltas, the parsers,
the wire format) is the real path.
"""
from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
import uvicorn
from server_fixture import LiveServer, scripted_sampler
from thinking_checkpoint import QWEN3_TEMPLATE, make_thinking_checkpoint

import cuttle.engine.llm_engine as llm_engine
from cuttle.engine.server import create_app

WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
SCRIPTS = {  # seed -> the text the "model" writes
    101: '<think>\nThe user wants the weather in Paris, so I call get_weather.\n</think>\n\n<tool_call>\n'
         '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    102: '<think>\nA call such as <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call> '
         'is not needed.\n</think>\n\nIt is mild in Paris, about 20 °C.',
    103: "Plain answer <think> with a tag in it.",
    104: " and the rest of it.",
}


class ChatServer(LiveServer):
    """LiveServer with the chat options of `cuttle serve` (--reasoning-parser etc.)."""

    def __init__(self, model: str, **app_kw):
        super().__init__(model, dtype="float32", num_kv_blocks=512, max_model_len=2048)
        self.app = create_app(self.engine, "test-model", **app_kw)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_thinking_checkpoint(str(tmp_path_factory.mktemp("qwen3_thinking")))


@pytest.fixture(scope="module")
def live(path):
    with pytest.MonkeyPatch.context() as mp, ChatServer(path, reasoning_parser="qwen3", trust_request_chat_template=True) as srv:
        tok = srv.llm.engine.tokenizer
        scripts = {seed: tok.encode(text, add_special_tokens=False) + [tok.eos_token_id] for seed, text in SCRIPTS.items()}
        real = llm_engine.sample

        mp.setattr(llm_engine, "sample", scripted_sampler(real, scripts))
        yield srv


@pytest.fixture()
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none")


def post(live, route: str, body: dict) -> httpx.Response:
    return httpx.post(live.url + route, json=body, timeout=60)


def streamed(client, **kw) -> tuple[str, str, list, str | None]:
    """(reasoning, content, tool calls as (name, arguments), finish_reason) of a streamed chat."""
    reasoning = content = ""
    calls: dict[int, list] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        content += d.content or ""
        for c in d.tool_calls or []:  # a call's first piece names it, the rest add arguments
            if c.id is not None:
                calls[c.index] = [c.function.name, ""]
            calls[c.index][1] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, [(name, json.loads(args)) for name, args in (calls[i] for i in sorted(calls))], finish


def test_thinking_then_tool_call_whole_and_streamed(client):
    kw = dict(model="test-model", messages=USER, tools=WEATHER, seed=101, max_tokens=400)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "\nThe user wants the weather in Paris, so I call get_weather.\n"
    assert msg.content is None and r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [("get_weather", {"city": "Paris"})]
    reasoning, content, calls, finish = streamed(client, **kw)
    assert (reasoning, calls, finish) == (msg.model_extra["reasoning_content"], [("get_weather", {"city": "Paris"})], "tool_calls")
    assert content == "\n\n"  # the blank line after </think>: a whole response strips content around calls, a stream cannot
    # include_reasoning: false drops the thinking (vLLM's field); the call is still parsed
    lean = client.chat.completions.create(**kw, extra_body={"include_reasoning": False}).choices[0].message
    assert lean.model_extra["reasoning_content"] is None and len(lean.tool_calls) == 1


def test_tool_call_inside_thinking_is_not_a_call(client):
    kw = dict(model="test-model", messages=USER, tools=WEATHER, seed=102, max_tokens=400)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert "<tool_call>" in msg.model_extra["reasoning_content"]
    assert msg.content == "\n\nIt is mild in Paris, about 20 °C."
    assert streamed(client, **kw) == (msg.model_extra["reasoning_content"], msg.content, [], "stop")


def test_enable_thinking_false_renders_the_closed_block_and_all_is_content(live, client):
    kw = dict(model="test-model", messages=USER, seed=103, max_tokens=100, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == SCRIPTS[103] and r.choices[0].message.model_extra["reasoning_content"] is None
    assert streamed(client, **kw) == ("", SCRIPTS[103], [], "stop")
    tokens = post(live, "/tokenize", {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}).json()
    text = post(live, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tokens["count"] == r.usage.prompt_tokens
    # thinking on (the default) but the model wrote no <think>: qwen3 reads it as content too
    plain = client.chat.completions.create(model="test-model", messages=USER, seed=103, max_tokens=100).choices[0].message
    assert plain.content == SCRIPTS[103] and plain.model_extra["reasoning_content"] is None


def test_template_fields_are_checked(live):
    for extra, param in [
        ({"chat_template_kwargs": {"no_such_switch": True}}, "chat_template_kwargs"),  # the template never reads it
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),  # a field of its own
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
        ({"add_generation_prompt": False, "continue_final_message": True}, "continue_final_message"),  # last message empty
        ({"chat_template": "{% for %}"}, "chat_template"),
        ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
    ]:
        msgs = USER + [{"role": "assistant", "content": ""}] if "continue_final_message" in extra else USER
        for route in ("/v1/chat/completions", "/tokenize"):
            r = post(live, route, {"messages": msgs, "max_tokens": 2, **extra} if route != "/tokenize" else {"messages": msgs, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, extra, r.text)


def test_request_chat_template_continue_final_message_and_echo(live, client):
    own = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
          "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    tok = live.llm.engine.tokenizer
    r = post(live, "/tokenize", {"messages": USER, "chat_template": own, "return_token_strs": True}).json()
    assert tok.decode(r["tokens"], skip_special_tokens=False) == "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert r["token_strs"] == [tok.tok.id_to_token(t) for t in r["tokens"]] and r["max_model_len"] == 2048
    # that template opens the thinking block: the output starts in reasoning (no <think> from the model)
    out = client.chat.completions.create(model="test-model", messages=USER, seed=104, max_tokens=50,
                                         extra_body={"chat_template": own}).choices[0].message
    assert out.model_extra["reasoning_content"] == SCRIPTS[104] and out.content is None
    # ... and a forced tool call would be written inside it: refused
    bad = post(live, "/v1/chat/completions", {"messages": USER, "chat_template": own, "tools": WEATHER, "tool_choice": "required"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
    # continue the assistant's own words; echo puts them first in the reply, whole and streamed
    msgs = USER + [{"role": "assistant", "content": "It is mild"}]
    body = dict(model="test-model", messages=msgs, seed=104, max_tokens=50,
                extra_body={"add_generation_prompt": False, "continue_final_message": True, "echo": True})
    r = client.chat.completions.create(**body)
    assert r.choices[0].message.content == "It is mild" + SCRIPTS[104] and r.choices[0].message.role == "assistant"
    assert streamed(client, **body)[1] == "It is mild" + SCRIPTS[104]
    prompt = post(live, "/tokenize", {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True}).json()
    # Qwen3's template closes an empty thinking block before the final turn's text: so the
    # continuation is content, though thinking is on
    assert tok.decode(prompt["tokens"], skip_special_tokens=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nIt is mild")
    assert prompt["count"] == r.usage.prompt_tokens


def test_tokenize_detokenize_version(live):
    tok = live.llm.engine.tokenizer
    r = post(live, "/tokenize", {"model": "test-model", "prompt": "def f(x):\n    return x"}).json()
    assert r["tokens"] == tok.encode("def f(x):\n    return x") and r["count"] == len(r["tokens"]) and r["token_strs"] is None
    assert post(live, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "def f(x):\n    return x"}
    special = tok.encode("<|im_start|>user", add_special_tokens=False)
    assert post(live, "/detokenize", {"tokens": special}).json()["prompt"] == "<|im_start|>user"  # specials kept, as vLLM
    for route, body, param in [
        ("/tokenize", {"prompt": "a", "messages": USER}, "messages"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
        ("/tokenize", {"prompt": ["a"]}, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ]:
        resp = post(live, route, body)
        status = 404 if param == "model" else 400  # an unknown model is a 404, as vLLM answers it
        assert resp.status_code == status and resp.json()["error"]["param"] == param, (route, body, resp.text)
    v = httpx.get(live.url + "/version").json()
    assert set(v) == {"version"} and v["version"]


def test_logprobs_carry_decoded_tokens(path):
    from cuttle.engine import LLM, SamplingParams

    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    tok = llm.get_tokenizer()
    params = SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2, temperature=0, ignore_eos=True)
    out = llm.generate(["Weather <think>"], params, use_tqdm=False)[0]
    got = out.outputs[0].logprobs + [d for d in out.prompt_logprobs if d]
    assert len(got) == 6 + len(out.prompt_token_ids) - 1
    for lps in got:
        assert len(lps) >= 2 and all(lp.decoded_token == tok.decode([t], skip_special_tokens=False) for t, lp in lps.items())
    assert "<think>" in [lp.decoded_token for d in out.prompt_logprobs if d for lp in d.values()]


def test_auto_tool_choice_can_be_switched_off(path):
    with ChatServer(path, enable_auto_tool_choice=False, chat_template=QWEN3_TEMPLATE.replace("# Tools", "# Functions")) as srv:
        r = post(srv, "/v1/chat/completions", {"messages": USER, "tools": WEATHER, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        r = post(srv, "/v1/chat/completions", {"messages": USER, "tools": WEATHER, "tool_choice": "none", "max_tokens": 2})
        assert r.status_code == 200
        # --chat-template's text is what renders (with the tools in the system turn)
        tokens = post(srv, "/tokenize", {"messages": USER, "tools": WEATHER}).json()["tokens"]
        assert "# Functions" in srv.llm.engine.tokenizer.decode(tokens)
        # no reasoning parser: no reasoning_content key at all
        assert "reasoning_content" not in r.json()["choices"][0]["message"]


def test_cli_serve_takes_the_model_positionally_and_checks_the_template_first(path, tmp_path):
    """`cuttle serve MODEL` (vLLM's form) and --model name the same thing; a --chat-template that
    is neither a readable file nor Jinja fails at once, before the model loads."""
    import subprocess
    import sys

    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cuttle.engine.cli", "serve", *args], capture_output=True, text=True, timeout=60)

    r = serve(path, "--chat-template", str(tmp_path / "missing.jinja"), "--no-enable-prefix-caching", "--enable-auto-tool-choice",
              "--reasoning-parser", "qwen3")
    assert r.returncode != 0 and "looks like a file path" in r.stderr
    r = serve(path, "--model", str(tmp_path))
    assert r.returncode != 0 and "the model is given twice" in r.stderr


def test_beam_search_replies_split_reasoning_as_any_reply(live):
    """Chat's use_beam_search: one beam is the greedy reply, and its message is split into
    reasoning and content as the greedy chat reply's is (here inside the thinking block the
    continued assistant message opened)."""
    body = {"model": "test-model", "messages": USER + [{"role": "assistant", "content": "<think>\nhm"}], "max_tokens": 6,
            "ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True}
    greedy = post(live, "/v1/chat/completions", {**body, "temperature": 0}).json()["choices"][0]["message"]
    beam = post(live, "/v1/chat/completions", {**body, "use_beam_search": True, "n": 1})
    assert beam.status_code == 200, beam.text
    assert beam.json()["choices"][0]["message"] == greedy and greedy["reasoning_content"]
    lean = post(live, "/v1/chat/completions", {**body, "use_beam_search": True, "include_reasoning": False}).json()
    assert lean["choices"][0]["message"]["reasoning_content"] is None
