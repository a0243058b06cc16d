"""Tool calls whose markers are special tokens, under token programs (engine/token_calls.py):
Mistral's `[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}` (v11; v13 without ids) for tool_choice required
and auto, and gpt-oss's auto calls, opened by `<|channel|>` then `commentary to=functions.` (its
required calls: tests/engine/test_harmony.py).

Seeded random walks over the mask stage with Mistral's Tekken vocabulary (v11 special tokens): each
step picks any token the row allows, so every output the program admits can come up; each decoded
output parses with cuttle's Mistral parser into calls of the given tools whose arguments meet
their schemas, including a tool whose name is a prefix of another's. Parallel calls follow one
another; with parallel_tool_calls false only EOS may follow the first call; auto leaves text before
the opening free. Through the server, a tiny Mistral with that vocabulary and a v11 template
answers required and auto calls that parse and validate. gpt-oss: free text (its analysis, a
mention of `to=functions.` included) until the header's opening, then random walks parse into calls
of either tool; an opening that ends inside a token hands the rest on. Malformed programs are
refused.
"""
from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

import mistral_common
from cuttle.engine.sampling_params import SamplingParams, StructuredOutputsParams
from cuttle.engine.structured_output import StructuredOutput, tool_call_structure
from cuttle.engine.token_calls import CallProgram
from cuttle.engine.tokenizer import Tokenizer
from cuttle.engine.tool_parsers import parse_tool_calls
from helpers import save_checkpoint, tiny_mistral

SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]",
            "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]", "[ARGS]", "[CALL_ID]"]
EOS, OPEN, ARGS, CALL_ID = 2, 9, 20, 21
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Bergen"]}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get", "parameters": {
             "type": "object", "properties": {"n": {"type": "integer", "enum": [1, 22, 333]}}, "required": ["n"]}}}]
V11 = "[TOOL_CALLS]{{ name }}[CALL_ID]{{ id }}[ARGS]{{ args }}"
V13 = "[TOOL_CALLS]{{ name }}[ARGS]{{ args }}"


@pytest.fixture(scope="module")
def tekken(tmp_path_factory) -> str:
    data = json.load(open(os.path.join(os.path.dirname(mistral_common.__file__), "data", "tekken_240911.json")))
    data["config"] = {**data["config"], "version": "v11"}
    data["special_tokens"] = [{"rank": i, "token_str": t, "is_control": True} for i, t in enumerate(SPECIALS)]
    d = tmp_path_factory.mktemp("tekken-calls")
    json.dump(data, open(d / "tekken.json", "w"))
    return str(d)


@pytest.fixture(scope="module")
def tok(tekken) -> Tokenizer:
    return Tokenizer(tekken)


def _walk(stage: StructuredOutput, so: StructuredOutputsParams, prompt: list[int], rng: random.Random, free_words: list[int],
          steps: int = 300) -> tuple[list[int], list[set[int]]]:
    """A random output under the program: each step any allowed token (EOS and markers, where
    allowed, half the time, so walks end), free text from `free_words` or the opening."""
    ctl = stage.prepare(SamplingParams(structured_outputs=so))
    bitmask = torch.full((1, stage.width), -1, dtype=torch.int32)
    bits = bitmask.numpy().view(np.uint32)
    out: list[int] = []
    seen: list[set[int]] = []
    for _ in range(steps):
        bits[0] = 0xFFFFFFFF
        assert stage.fill_row(ctl, 0, prompt + out, len(prompt), len(prompt) + len(out), bitmask, bits, 0) is None
        allowed = np.unpackbits(bits[0].view(np.uint8), bitorder="little").nonzero()[0]
        allowed = allowed[allowed < stage.vocab_size]
        if len(allowed) == stage.vocab_size:  # free text
            t = OPEN if rng.random() < 0.3 else rng.choice(free_words)
        else:
            seen.append(set(allowed.tolist()) if len(allowed) < 8 else set())
            ends = [t for t in (EOS, OPEN, ARGS, CALL_ID) if t in allowed]
            t = rng.choice(ends) if ends and rng.random() < 0.5 else int(rng.choice(allowed))
        out.append(int(t))
        if t == EOS:
            break
    return out, seen


def _valid(calls) -> None:
    schemas = {"get_weather": lambda a: a == {"city": a["city"]} and a["city"] in ("Oslo", "Bergen"),
               "get": lambda a: a == {"n": a["n"]} and a["n"] in (1, 22, 333)}
    for c in calls:
        assert schemas[c.name](json.loads(c.arguments)), (c.name, c.arguments)


@pytest.mark.parametrize("template", [V11, V13], ids=["v11", "v13"])
@pytest.mark.parametrize("choice", ["required", "auto"])
@pytest.mark.parametrize("parallel", [True, False])
def test_random_walks_under_the_program_parse_and_validate(tok, template, choice, parallel):
    so = tool_call_structure("mistral", choice, None, TOOLS, tok, parallel, template)
    assert so is not None and so.kind == "tool_calls"
    stage = StructuredOutput(tok, 131072, {EOS})
    words = tok.encode("Let me check the weather.", add_special_tokens=False)
    prompt = [1, 3] + words + [4] + ([OPEN] if choice == "required" else [])  # required: the server wrote [TOOL_CALLS]
    rng = random.Random(hash((template, choice, parallel)) % 1000)
    names = set()
    for _ in range(25):
        out, seen = _walk(stage, so, prompt, rng, words)
        if out[-1] != EOS:
            continue  # (cut by the step limit inside free text: nothing to check)
        text = tok.decode(([OPEN] if choice == "required" else []) + out[:-1], skip_special_tokens=False)
        content, calls = parse_tool_calls(text, "mistral")
        assert calls, text
        _valid(calls)
        names |= {c.name for c in calls}
        assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
        if not parallel:
            assert len(calls) == 1 and seen[-1] == {EOS}  # after the call only EOS
        if choice == "required":
            assert content == ""
    assert names == {"get_weather", "get"}


def test_programs_are_checked(tok):
    bad = CallProgram([[{"special": ARGS}, {"json": {}}]], [EOS]).to_json()
    with pytest.raises(ValueError, match="must alternate grammar and special segments"):
        StructuredOutput(tok, 131072, {EOS}).prepare(SamplingParams(structured_outputs=StructuredOutputsParams(tool_calls=bad)))
    no_open = CallProgram([[{"regex": "a"}, {"special": ARGS}, {"json": {}}]], [EOS]).to_json()
    with pytest.raises(ValueError, match="unless it starts in a call, opens"):
        StructuredOutput(tok, 131072, {EOS}).prepare(SamplingParams(structured_outputs=StructuredOutputsParams(tool_calls=no_open)))
    # a vocabulary without the markers as tokens: no program (the server then says there is no grammar)
    from cuttle.engine.default_model import default_model_path

    assert tool_call_structure("mistral", "required", None, TOOLS, Tokenizer(default_model_path()), True, V11) is None


V11_CHAT = (
    "{% for m in messages %}{% if m.role == 'user' %}{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ m.content }}[/INST]{% elif m.tool_calls %}{% for tc in m.tool_calls %}"
    "[TOOL_CALLS]{{ tc.function.name }}[CALL_ID]{{ tc.id }}[ARGS]{{ tc.function.arguments|tojson }}"
    "{% endfor %}</s>{% else %}{{ m.content }}</s>{% endif %}{% endfor %}")


def test_the_server_answers_required_and_auto_calls(tekken):
    """A tiny Mistral (random weights: only the program makes its calls parse) with the v11
    vocabulary and template: required calls parse and validate, one or more; auto with
    parallel_tool_calls false and the opening made likely (logit_bias) gives one call, then EOS."""
    import openai

    from server_fixture import LiveServer

    model = tiny_mistral(None, layers=1)
    model.resize_token_embeddings(131072)
    save_checkpoint(tekken, model)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # (save_checkpoint writes the test tokenizer: only tekken.json stays)
        os.remove(os.path.join(tekken, name))
    with LiveServer(tekken, dtype="float32", num_kv_blocks=256, block_size=8, app_kw={"chat_template": V11_CHAT}) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        user = [{"role": "user", "content": "Weather in Oslo?"}]
        for seed in range(4):
            r = c.chat.completions.create(model="test-model", messages=user, tools=TOOLS, tool_choice="required", seed=seed,
                                          temperature=1.0, max_tokens=200).choices[0]
            assert r.finish_reason == "tool_calls" and r.message.tool_calls, (r.finish_reason, r.message)
            _valid(r.message.tool_calls and [type("C", (), {"name": t.function.name, "arguments": t.function.arguments})
                                             for t in r.message.tool_calls])
        r = c.chat.completions.create(model="test-model", messages=user, tools=TOOLS, tool_choice="auto", seed=5, temperature=1.0,
                                      max_tokens=200, parallel_tool_calls=False, logit_bias={str(OPEN): 30}).choices[0]
        [call] = r.message.tool_calls
        assert r.finish_reason == "tool_calls" and call.function.name in ("get_weather", "get")


# ---- gpt-oss (harmony): auto calls open on `<|channel|>` + `commentary to=functions.` ---------------
HARMONY_TOOLS = [{"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {"k": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["k"]}}} for n in ("fore", "forecast")]


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    from harmony_checkpoint import make_harmony_checkpoint

    return Tokenizer(make_harmony_checkpoint(str(tmp_path_factory.mktemp("harmony-calls"))))


def _harmony_stage(tok):
    from harmony_checkpoint import HARMONY_TEMPLATE

    so = tool_call_structure("openai", "auto", None, HARMONY_TOOLS, tok, True, HARMONY_TEMPLATE)
    assert so is not None and so.kind == "tool_calls"
    call = tok.tok.token_to_id("<|call|>")
    stage = StructuredOutput(tok, 288, {call, tok.tok.token_to_id("<|return|>")})
    return stage, stage.prepare(SamplingParams(structured_outputs=so)), call


def _allowed(stage, ctl, ids, start):
    bitmask = torch.full((1, stage.width), -1, dtype=torch.int32)
    bits = bitmask.numpy().view(np.uint32)
    assert stage.fill_row(ctl, 0, ids, start, len(ids), bitmask, bits, 0) is None
    allowed = np.unpackbits(bits[0].view(np.uint8), bitorder="little").nonzero()[0]
    return allowed[allowed < stage.vocab_size].tolist()


def test_harmony_auto_calls_open_on_their_header_and_follow_the_schema(harmony):
    """The model's analysis (mentioning `to=functions.x` in its text: not an opening), then
    `<|start|>assistant<|channel|>commentary to=functions.`: from there each step allows only what
    the program does; random walks parse (gpt_oss reasoning split, then the openai format) into a
    call of one of the tools, both names (one a prefix of the other) reached."""
    from cuttle.engine.reasoning_parsers import split_reasoning, start_state

    tok = harmony
    head = tok.encode("<|channel|>analysis<|message|>I could call to=functions.x here.<|end|><|start|>assistant"
                      "<|channel|>commentary to=functions.", add_special_tokens=False)
    rng = random.Random(3)
    names = set()
    for _ in range(20):
        stage, ctl, call = _harmony_stage(tok)
        prompt = tok.encode("<|start|>user<|message|>hi<|end|><|start|>assistant", add_special_tokens=False)
        out = []
        for i, t in enumerate(head):  # free text: everything allowed until the opening is complete
            assert len(_allowed(stage, ctl, prompt + out, len(prompt))) == stage.vocab_size
            out.append(t)
        for _ in range(60):
            allowed = _allowed(stage, ctl, prompt + out, len(prompt))
            assert len(allowed) < stage.vocab_size
            t = call if call in allowed and rng.random() < 0.5 else rng.choice(allowed)
            out.append(t)
            if t == call:
                break
        assert out[-1] == call
        _, content = split_reasoning(tok.decode(out, skip_special_tokens=False), start_state("gpt_oss", ""))
        _, [c] = parse_tool_calls(content, "openai")
        assert c.name in ("fore", "forecast") and json.loads(c.arguments)["k"] in (1, 2, 3)
        names.add(c.name)
    assert names == {"fore", "forecast"}


def test_an_opening_inside_a_token_hands_its_rest_to_the_call(harmony):
    """A token that runs past the opening text (BPE merges `.fo`): the rest starts the name; a rest
    no tool's name can start leaves that call unconstrained rather than failing the request."""
    from cuttle.engine.token_calls import AFTER, CALL, fill_calls

    tok = harmony
    stage, ctl, _ = _harmony_stage(tok)
    channel = tok.tok.token_to_id("<|channel|>")
    texts = {1000: "commentary to=functions.fo", 1001: "commentary to=functions.zz"}

    def text_of(t):
        return texts.get(t) or tok.tok.decode([t], skip_special_tokens=False)

    bits = np.full((1, stage.width), 0xFFFFFFFF, dtype=np.uint32)
    for token, phase in ((1000, CALL), (1001, AFTER)):
        states: dict = {}
        assert fill_calls(ctl.calls, states, 0, [channel, token], 0, 2, bits, 0, stage.width, text_of) is None
        assert states[0][1] == phase
    # after `fo`: both tools alive, the next token may continue either name ("r" of "fore")
    states = {}
    bits[0] = 0xFFFFFFFF
    fill_calls(ctl.calls, states, 0, [channel, 1000], 0, 2, bits, 0, stage.width, text_of)
    allowed = np.unpackbits(bits[0].view(np.uint8), bitorder="little").nonzero()[0].tolist()
    assert tok.encode("r", add_special_tokens=False)[0] in allowed and len(allowed) < 20


# ---- JSON lists of calls after a special marker: Mistral v3 / v7, Granite (auto) ------------------
def _list_walks(tok, fmt: str, template: str | None, marker: int, eos: int, parallel: bool, seed: int) -> set[str]:
    so = tool_call_structure(fmt, "auto", None, TOOLS, tok, parallel, template)
    assert so is not None and so.kind == "tool_calls"
    stage = StructuredOutput(tok, tok.vocab_size, {eos})
    words = tok.encode("Let me check.", add_special_tokens=False)
    rng = random.Random(seed)
    names: set[str] = set()
    for _ in range(25):
        ctl = stage.prepare(SamplingParams(structured_outputs=so))
        bitmask = torch.full((1, stage.width), -1, dtype=torch.int32)
        bits = bitmask.numpy().view(np.uint32)
        prompt, out = words[:2], []
        for _ in range(300):
            bits[0] = 0xFFFFFFFF
            assert stage.fill_row(ctl, 0, prompt + out, len(prompt), len(prompt) + len(out), bitmask, bits, 0) is None
            allowed = np.unpackbits(bits[0].view(np.uint8), bitorder="little").nonzero()[0]
            allowed = allowed[allowed < stage.vocab_size]
            if len(allowed) == stage.vocab_size:
                t = marker if rng.random() < 0.3 else rng.choice(words)
            else:
                t = eos if eos in allowed and rng.random() < 0.5 else int(rng.choice(allowed))
            out.append(int(t))
            if t == eos:
                break
        if out[-1] != eos:
            continue
        content, calls = parse_tool_calls(tok.decode(out[:-1], skip_special_tokens=False), fmt.replace("_list", ""))
        assert calls and (parallel or len(calls) == 1)
        _valid(calls)
        names |= {c.name for c in calls}
    return names


@pytest.mark.parametrize("parallel", [True, False])
def test_mistral_list_layout_auto_calls(tmp_path_factory, parallel):
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    data = json.load(open(os.path.join(os.path.dirname(mistral_common.__file__), "data", "tekken_240911.json")))
    data["config"] = {**data["config"], "version": "v7"}
    data["special_tokens"] = [{"rank": t["rank"], "token_str": str(getattr(t["token_str"], "value", t["token_str"])), "is_control": True}
                              for t in Tekkenizer.DEPRECATED_SPECIAL_TOKENS]
    d = tmp_path_factory.mktemp("tekken-v7")
    json.dump(data, open(d / "tekken.json", "w"))
    tok = Tokenizer(str(d))
    assert _list_walks(tok, "mistral", "[TOOL_CALLS][{{ calls|tojson }}]", OPEN, EOS, parallel, 7) == {"get_weather", "get"}


def test_granite_auto_calls(tmp_path):
    """A byte-level vocabulary with Granite's `<|tool_call|>` and `<|end_of_text|>` as special tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    hf = HFTokenizer(models.BPE({ch: i for i, ch in enumerate(alphabet)}, []))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<|end_of_text|>", "<|tool_call|>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    tok = Tokenizer(str(tmp_path))
    names = _list_walks(tok, "granite", None, tok.tok.token_to_id("<|tool_call|>"), tok.eos_token_id, True, 11)
    assert names == {"get_weather", "get"}


# ---- Kimi-K2: `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>` --
KIMI_MARKERS = ["<|im_end|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>"]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> Tokenizer:
    """A byte-level vocabulary with Kimi-K2's call markers as special tokens (its own ships as
    tiktoken.model, which cuttle does not read)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    d = tmp_path_factory.mktemp("kimi")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    hf = HFTokenizer(models.BPE({ch: i for i, ch in enumerate(alphabet)}, []))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(KIMI_MARKERS)
    hf.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return Tokenizer(str(d))


@pytest.mark.parametrize("choice", ["named", "required", "auto"])
@pytest.mark.parametrize("parallel", [True, False])
def test_kimi_calls_follow_their_schemas(kimi, choice, parallel):
    """Random walks: calls numbered `functions.NAME:IDX` under the tools' schemas, then only
    `<|tool_calls_section_end|>` (or, with parallel calls and no named choice, another
    `<|tool_call_begin|>`); named: the server wrote the call up to its arguments."""
    from cuttle.engine.server.chat import _forced_prefix

    tok = kimi
    m = {t: tok.tok.token_to_id(t) for t in KIMI_MARKERS}
    so = tool_call_structure("kimi_k2", choice, "get" if choice == "named" else None, TOOLS, tok, parallel, None)
    assert so is not None and so.kind == "tool_calls"
    stage = StructuredOutput(tok, tok.vocab_size, {m["<|im_end|>"]})
    forced = tok.encode(_forced_prefix("kimi_k2", choice, "get", None, 3), add_special_tokens=False)
    words = tok.encode("ok", add_special_tokens=False)
    rng = random.Random(hash((choice, parallel)) % 1000)
    names = set()
    for _ in range(20):
        ctl = stage.prepare(SamplingParams(structured_outputs=so))
        bitmask = torch.full((1, stage.width), -1, dtype=torch.int32)
        bits = bitmask.numpy().view(np.uint32)
        prompt, out = words + forced, []
        for _ in range(400):
            bits[0] = 0xFFFFFFFF
            assert stage.fill_row(ctl, 0, prompt + out, len(prompt), len(prompt) + len(out), bitmask, bits, 0) is None
            allowed = np.unpackbits(bits[0].view(np.uint8), bitorder="little").nonzero()[0]
            allowed = set(allowed[allowed < stage.vocab_size].tolist())
            if len(allowed) == stage.vocab_size:  # free: the section and a call open now and then, else text, or the end
                if out and out[-1] == m["<|tool_calls_section_end|>"]:
                    t = m["<|im_end|>"]
                else:
                    t = rng.choice([m["<|tool_calls_section_begin|>"], m["<|tool_call_begin|>"], words[0], words[-1]])
                    if out and out[-1] == m["<|tool_calls_section_begin|>"]:
                        t = m["<|tool_call_begin|>"]
            else:
                if allowed <= {m["<|tool_calls_section_end|>"], m["<|tool_call_begin|>"]}:  # after a call
                    assert allowed == ({m["<|tool_calls_section_end|>"], m["<|tool_call_begin|>"]} if parallel and choice != "named"
                                       else {m["<|tool_calls_section_end|>"]})  # (a named call is one call)
                ends = [t for t in (m["<|tool_call_end|>"], m["<|tool_calls_section_end|>"], m["<|tool_call_argument_begin|>"])
                        if t in allowed]
                t = rng.choice(ends) if ends and rng.random() < 0.5 else rng.choice(sorted(allowed))
            out.append(t)
            if t == m["<|im_end|>"]:
                break
        if out[-1] != m["<|im_end|>"]:
            continue
        text = tok.decode(forced + out[:-1], skip_special_tokens=False)
        _, calls = parse_tool_calls(text, "kimi_k2")
        assert calls, text
        _valid(calls)
        assert all(c.id.startswith(f"functions.{c.name}:") for c in calls)
        names |= {c.name for c in calls}
    assert names == ({"get"} if choice == "named" else {"get_weather", "get"})
