"""The embedded default model: shipped in HF format within budget, loadable by transformers with
identical greedy output, writes Python from a `def` prompt, and does a tool round trip through
the server with the official openai client."""
from __future__ import annotations

import json
import os
import re

import openai
import pytest
import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.default_model import DEFAULT_MODEL_DIR, default_model_path
from server_fixture import LiveServer

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md", "generation_config.json")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", num_kv_blocks=256)


def test_shipped_files_and_card():
    assert default_model_path() == DEFAULT_MODEL_DIR
    for f in FILES:
        assert os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, f)), f
    total = sum(os.path.getsize(os.path.join(DEFAULT_MODEL_DIR, f)) for f in os.listdir(DEFAULT_MODEL_DIR))
    assert total <= 25 * 2**20
    card = open(os.path.join(DEFAULT_MODEL_DIR, "README.md")).read()
    assert re.search(r"loss \*\*\d+\.\d+\*\*", card) and re.search(r"perplexity \*\*\d+\.\d+\*\*", card)
    assert "python -m cuttle.engine.train_default_model" in card
    cfg = json.load(open(os.path.join(DEFAULT_MODEL_DIR, "config.json")))
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg["squid_positions"] == "shared"  # trained with that layout (engine/train_default_model.py)


def test_engine_takes_the_models_squid_convention(llm):
    assert llm.engine.squid_positions == "shared"


def test_writes_python_from_def(llm):
    out = llm.generate(["def parse_header(line):"], SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0].outputs[0].text
    assert out.startswith("\n    ")  # an indented body
    # statements, not noise. (The model before squid training wrote an `if` in this body; the
    # current one returns at once and goes on to the next `def`, so no particular keyword is pinned.)
    assert re.search(r"\n\s+return\b", out)
    assert len(re.findall(r"^[ \t]*(?:return|if|for|while|def|class|with|try|raise)\b", out, re.M)) >= 2


def test_transformers_agrees(llm):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in ["import os\n", "class Stack:\n    def push(self, item):\n", "for i in range(10):\n"]]
    ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):]
        assert o.outputs[0].token_ids == ref.tolist()


def test_tool_round_trip_with_openai_client():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    with LiveServer(default_model_path(), name="cuttle-tiny-coder", dtype="float32", num_kv_blocks=256) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        r = client.chat.completions.create(model="cuttle-tiny-coder", messages=messages, tools=tools, temperature=0, max_tokens=64)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        # streaming gives the same call as deltas
        chunks = list(client.chat.completions.create(model="cuttle-tiny-coder", messages=messages, tools=tools, temperature=0,
                                                     max_tokens=64, stream=True))
        deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        # the first names the call (its id, type and name), the rest write its arguments as the model does
        assert deltas and deltas[0].id is not None and deltas[0].function.name == "get_weather"
        assert all(d.index == 0 and d.id is None for d in deltas[1:]) and len(deltas) > 2
        assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
        messages += [choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "Paris: sunny, 25 C"}]
        final = client.chat.completions.create(model="cuttle-tiny-coder", messages=messages, tools=tools, temperature=0, max_tokens=64)
        assert final.choices[0].finish_reason == "stop"
        answer = final.choices[0].message.content
        assert "Paris" in answer and "25 C" in answer and not final.choices[0].message.tool_calls  # uses the tool's result
        # a named tool_choice is honoured by writing the call's opening for the model
        forced = client.chat.completions.create(model="cuttle-tiny-coder", messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
                                                tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                temperature=0, max_tokens=64)
        assert forced.choices[0].message.tool_calls[0].function.name == "get_weather"
