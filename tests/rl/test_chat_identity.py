"""Token identity (issue 17, acceptance 2): a finished agent conversation rendered by the chat
template is the trajectory's ids, with the engine's own renderer and with transformers'
`apply_chat_template` on the same tokenizer as the oracle; where a template is not append-only
(Qwen3-style thinking: past reasoning dropped after a new user query, the reasoning block's
whitespace normalised) the turn is refused with `TemplateNotAppendOnly`, never trained on."""
from __future__ import annotations

import pytest
import transformers
from agent_scripts import FakeEnvironment, ScriptedSampler, call
from thinking_checkpoint import write_thinking_tokenizer

from cuttle.engine.default_model import default_model_path
from cuttle.engine.sampling_params import SamplingParams
from cuttle.engine.tokenizer import Tokenizer
from cuttle.rl.agent import AgentRollout
from cuttle.rl.chat import ChatTokens, TemplateNotAppendOnly
from cuttle.sandbox.tools import agent_tool_schemas


def test_finished_episode_renders_to_its_ids_with_the_engine_and_transformers():
    path = default_model_path()
    tok = Tokenizer(path)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    script = [call("read_file", path="pkg/a.py") + "\n" + call("search", pattern="def f"),  # two calls in one turn
              'Looking at it. ' + call("edit_file", path="pkg/a.py", old_str="x = 1", new_str='x = "é\\n"'),
              call("fail"),  # a tool error goes back as a tool message too
              "Done: the bug is fixed."]
    sampler = ScriptedSampler(tok, {"Task fake/": script})
    runner = AgentRollout(sampler, lambda spec: FakeEnvironment(spec), tokenizer=tok, eos_token_ids=sampler.eos_token_ids)
    try:
        groups = runner.run([{"seed": 3}], 2, SamplingParams(temperature=1.0))
    finally:
        runner.close()
    tools = agent_tool_schemas()
    for e in groups[0].episodes:
        assert e.finish == "answered" and len(e.turns) == 4
        ids = e.trajectory.token_ids
        messages = e.chat.messages
        # the template closes the last turn with "\n" after its end-of-turn token: the one id the
        # stream does not hold (nothing is sampled after it)
        closing = tok.encode("\n", add_special_tokens=False)
        ours = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=False)
        assert tok.encode(ours, add_special_tokens=False) == ids + closing
        oracle = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=False, tokenize=False)
        assert oracle == ours
        assert list(hf(oracle, add_special_tokens=False)["input_ids"]) == ids + closing
        # every turn's prompt was the rendering of the conversation so far, with the generation prompt
        spans = [i for i, m in enumerate(e.trajectory.loss_mask) if m and (i == 0 or not e.trajectory.loss_mask[i - 1])]
        assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        for start, k in zip(spans, assistant_at):
            prefix = hf.apply_chat_template(messages[:k], tools=tools, add_generation_prompt=True, tokenize=False)
            assert list(hf(prefix, add_special_tokens=False)["input_ids"]) == ids[:start]


@pytest.fixture(scope="module")
def qwen3_chat(tmp_path_factory) -> tuple[ChatTokens, Tokenizer, object]:
    path = str(tmp_path_factory.mktemp("qwen3_chat"))
    write_thinking_tokenizer(path)
    tok = Tokenizer(path)
    eos = tok.encode("<|im_end|>", add_special_tokens=False)
    return ChatTokens(tok, agent_tool_schemas(), set(eos)), tok, transformers.AutoTokenizer.from_pretrained(path)


def sampled(tok: Tokenizer, chat: ChatTokens, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [chat.end_of_turn_id]


THINK_CALL = "<think>\nI should read the file first.\n</think>\n\n" + call("read_file", path="a.py")


def test_qwen3_thinking_is_append_only_within_an_agent_episode(qwen3_chat):
    """Tool results are `tool` messages, so the episode's one user query stays the last: Qwen3 keeps
    every turn's reasoning, and a reasoning block written the way the template writes it renders back
    verbatim."""
    chat, tok, hf = qwen3_chat
    state, ids = chat.start([{"role": "system", "content": "sys"}, {"role": "user", "content": "fix a.py"}])
    stream = list(ids)
    for k, text in enumerate([THINK_CALL, "<think>\nNow edit.\n</think>\n\n" + call("edit_file", path="a.py", old_str="1", new_str="2")]):
        turn = sampled(tok, chat, text)
        delta = chat.append_turn(state, turn, [{"role": "tool", "tool_call_id": f"c{k}", "name": "x", "content": f"result {k}"}])
        stream += turn + delta
    final = sampled(tok, chat, "<think>\nDone.\n</think>\n\nFixed.")
    chat.finish_turn(state, final)
    stream += final
    oracle = hf.apply_chat_template(state.messages, tools=chat.tools, add_generation_prompt=False, tokenize=False)
    assert oracle == tok.decode(stream, skip_special_tokens=False) + "\n"
    assert list(hf(oracle, add_special_tokens=False)["input_ids"]) == stream + tok.encode("\n", add_special_tokens=False)
    assert oracle.count("<think>") == 3  # no reasoning dropped


def test_qwen3_drops_past_thinking_after_a_new_user_query_and_the_turn_is_refused(qwen3_chat):
    chat, tok, _ = qwen3_chat
    state, _ = chat.start([{"role": "user", "content": "fix a.py"}])
    with pytest.raises(TemplateNotAppendOnly, match="turn 1: the template's rendering of the conversation differs"):
        chat.append_turn(state, sampled(tok, chat, THINK_CALL), [{"role": "user", "content": "and b.py too"}])
    assert state.num_turns == 0  # nothing recorded: the stream stays what was sampled


def test_qwen3_normalises_reasoning_whitespace_and_the_turn_is_refused(qwen3_chat):
    chat, tok, _ = qwen3_chat
    state, _ = chat.start([{"role": "user", "content": "fix a.py"}])
    # the template re-renders the reasoning as "<think>\n...\n</think>\n\n": written another way,
    # the past turn would come back as other tokens than the sampled ones
    squeezed = "<think>I should read.</think>" + call("read_file", path="a.py")
    with pytest.raises(TemplateNotAppendOnly, match="differs from the token stream"):
        chat.append_turn(state, sampled(tok, chat, squeezed), [{"role": "tool", "tool_call_id": "c", "name": "x", "content": "r"}])
