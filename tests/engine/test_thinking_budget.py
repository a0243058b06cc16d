"""`thinking_token_budget` (vLLM's): once a sample has written that many tokens inside its thinking
block without closing it, only the closing tag may come next (engine/structured_output.py,
"Thinking budget").

The rule is checked row by row on the mask stage (where a block opens: in the prompt, in the
output, not at all; closed naturally; a second block; budget 0; samples apart), then through the
engine on a tiny Qwen3 whose tokenizer has `<think>` / `</think>` as single tokens: the output is
the model's own greedy output up to the budget, then the closing tag (its processed logprob 0),
then the model's greedy continuation of that text; seeded samples with n = 2 each close at their
budget; the server takes the field on chat completions and maps the Messages API's
`budget_tokens` to it (the RL trainer's replay: tests/rl/test_sampling_replay.py).
Refused, naming the field: a model without the tags, a negative budget, structured output with it.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.sampling_params import StructuredOutputsParams
from cuttle.engine.server.messages import to_chat
from cuttle.engine.structured_output import StructuredOutput
from cuttle.engine.tokenizer import Tokenizer
from helpers import make_checkpoint
from thinking_checkpoint import make_thinking_checkpoint


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_thinking_checkpoint(str(tmp_path_factory.mktemp("thinking-budget")))


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, dtype="float32", num_kv_blocks=256, block_size=4)


@pytest.fixture(scope="module")
def tags(path) -> tuple[int, int]:
    tok = Tokenizer(path)
    return tok.tok.token_to_id("<think>"), tok.tok.token_to_id("</think>")


def _forced(stage: StructuredOutput, budget: int, prompt: list[int], output: list[int], key: int = 0) -> list[bool]:
    """For each position of `output` (and the one after it): whether the row allows only the
    closing tag, asked position by position as the engine asks."""
    ctl = stage.prepare(SamplingParams(thinking_token_budget=budget))
    ids = prompt + output
    bitmask = torch.full((1, stage.width), -1, dtype=torch.int32)
    bits = bitmask.numpy().view(np.uint32)
    out = []
    for end in range(len(prompt), len(ids) + 1):
        bits[0] = 0xFFFFFFFF
        assert stage.fill_row(ctl, key, ids, len(prompt), end, bitmask, bits, 0) is None
        allowed = np.unpackbits(bits[0].view(np.uint8), bitorder="little").nonzero()[0].tolist()
        assert len(allowed) in (1, stage.vocab_size) or allowed[-1] >= stage.vocab_size  # all, or the tag alone
        out.append(allowed == [ctl.think[1]])
    return out


def test_where_the_block_opens_and_what_is_counted(path, tags):
    opening, closing = tags
    stage = StructuredOutput(Tokenizer(path), 288, {258})
    assert stage.thinking_tags() == tags
    words = [40, 41, 42, 43, 44, 45]
    # the prompt leaves a block open: the 3rd token of the output may be only the tag
    assert _forced(stage, 2, [5, opening, 7], words[:4]) == [False, False, True, True, True]
    # budget 0 inside an open block: the first token already
    assert _forced(stage, 0, [opening], words[:1]) == [True, True]
    # the prompt closed its block (Qwen3 with enable_thinking false): never
    assert _forced(stage, 0, [opening, 9, closing, 10], words) == [False] * 7
    # no tag in the prompt: counting starts at the opening tag the output writes
    assert _forced(stage, 2, [5, 6], [40, opening, 41, 42, 43]) == [False, False, False, False, True, True]
    # closed in time: free afterwards, and a second block is not budgeted
    assert _forced(stage, 2, [opening], [40, closing, 41, opening, 42, 43, 44]) == [False] * 8
    # samples keep their own state (one key each)
    ctl_free = _forced(stage, 1, [opening], [40, closing, 41], key=1)
    assert ctl_free == [False, True, False, False]


def test_the_engine_forces_the_closing_tag_at_the_budget(llm, tags):
    """Greedy: the model's own tokens up to the budget, then the tag (processed logprob 0), then
    the model's greedy continuation of prompt + those tokens + the tag."""
    opening, closing = tags
    prompt = [7, 8, 9, opening, 10]
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    [plain] = llm.generate([prompt], free, use_tqdm=False)
    assert closing not in plain.outputs[0].token_ids  # (the random model would not close it itself)
    budget = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0, thinking_token_budget=5)
    [out] = llm.generate([prompt], budget, use_tqdm=False)
    got = out.outputs[0].token_ids
    assert got[:5] == plain.outputs[0].token_ids[:5] and got[5] == closing
    assert out.outputs[0].logprobs[5][closing].logprob == 0.0
    [rest] = llm.generate([prompt + got[:6]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert got[6:] == rest.outputs[0].token_ids
    # seeded samples, n = 2: each closes at its budget, and its tokens before equal the free draw's
    drawn = SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=8, ignore_eos=True)
    [free2] = llm.generate([prompt], drawn, use_tqdm=False)
    [cut2] = llm.generate([prompt], SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=8, ignore_eos=True,
                                                   thinking_token_budget=3), use_tqdm=False)
    for a, b in zip(free2.outputs, cut2.outputs):
        assert b.token_ids[:3] == a.token_ids[:3] and b.token_ids[3] == closing


def test_refusals(tmp_path, llm):
    with pytest.raises(ValueError, match=r"thinking_token_budget must be in \[0, "):
        SamplingParams(thinking_token_budget=-1)
    with pytest.raises(ValueError, match="thinking_token_budget cannot be combined with structured_outputs"):
        SamplingParams(thinking_token_budget=4, structured_outputs=StructuredOutputsParams(regex="a+"))
    make_checkpoint(str(tmp_path), "qwen3", vocab_size=256)  # the test tokenizer: no thinking tags
    plain = LLM(str(tmp_path), dtype="float32", num_kv_blocks=32, block_size=4)
    with pytest.raises(ValueError, match="thinking_token_budget needs thinking tags that are single tokens"):
        plain.generate([[5, 6]], SamplingParams(thinking_token_budget=4), use_tqdm=False)
    assert plain.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids  # still serving


def test_the_server_takes_the_field(path, tags):
    """/v1/completions and /v1/chat/completions (its reasoning split: the forced tag ends the
    reasoning) take thinking_token_budget; a bad value is a 400 naming it."""
    import httpx

    from server_fixture import LiveServer

    opening, closing = tags
    with LiveServer(path, dtype="float32", num_kv_blocks=256, block_size=4, app_kw={"reasoning_parser": "qwen3"}) as srv:
        body = {"model": "test-model", "prompt": "Hi<think>", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "thinking_token_budget": 3}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"][3] == closing
        chat = {"model": "test-model", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "thinking_token_budget": 2,
                "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\n"}],
                "continue_final_message": True, "add_generation_prompt": False, "return_token_ids": True}
        r = httpx.post(srv.url + "/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"][2] == closing and choice["message"]["reasoning_content"] is not None
        r = httpx.post(srv.url + "/v1/completions", json={**body, "thinking_token_budget": -2}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"


def test_messages_budget_tokens_is_the_thinking_token_budget():
    body = {"model": "m", "max_tokens": 3000, "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "enabled", "budget_tokens": 2048}}
    chat, _ = to_chat(body, {"enable_thinking"}, False)
    assert chat["chat_template_kwargs"] == {"enable_thinking": True} and chat["thinking_token_budget"] == 2048
    chat, _ = to_chat({**body, "thinking": {"type": "disabled"}}, {"enable_thinking"}, False)
    assert "thinking_token_budget" not in chat
    chat, _ = to_chat(body, {"reasoning_effort"}, False)  # gpt-oss: its effort levels, no tags to force
    assert chat["chat_template_kwargs"] == {"reasoning_effort": "low"} and "thinking_token_budget" not in chat
