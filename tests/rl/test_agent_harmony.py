"""The agent loop on a gpt-oss-style model (harmony turns, rl/harmony_chat.py): the scripted fix
earns reward 1; the stream is the template's first prompt, then each turn's sampled ids as they
are (closed by <|call|>) and the tool results as harmony messages; the loss mask sits exactly on
the sampled ids; the analysis never becomes a call; and the turns that cannot go on are named."""
from __future__ import annotations

import pytest
from agent_scripts import ScriptedSampler, fix_script, script_logprob
from harmony_checkpoint import make_harmony_checkpoint

from cuttle.engine.sampling_params import SamplingParams
from cuttle.engine.tokenizer import Tokenizer
from cuttle.rl.agent import AgentConfig, AgentRollout
from cuttle.rl.chat import TemplateNotAppendOnly
from cuttle.rl.environment import sandbox_factory
from cuttle.rl.harmony_chat import HarmonyChatTokens
from cuttle.sandbox.tasks import make_task
from cuttle.sandbox.tools import agent_tool_schemas

PARAMS = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def htok(tmp_path_factory) -> Tokenizer:
    return Tokenizer(make_harmony_checkpoint(str(tmp_path_factory.mktemp("harmony"))))


def _ids(tok: Tokenizer) -> tuple[int, int]:
    return tok.encode("<|call|>", add_special_tokens=False)[0], tok.encode("<|return|>", add_special_tokens=False)[0]


def _sampler(tok: Tokenizer, scripts: dict[str, list[str]]) -> ScriptedSampler:
    call, ret = _ids(tok)
    # a prompt's turn: the turns it already holds, each closed by <|call|>
    return ScriptedSampler(tok, scripts, end_of_turn=call, eos_token_ids={call, ret}, turn_of=lambda text: text.count("<|call|>"))


def test_scripted_fix_with_harmony_turns(htok, namespaces):
    spec = {"kind": "synthetic", "seed": 1}
    script = fix_script(spec, "openai")
    sampler = _sampler(htok, {make_task(spec).prompt: script})
    # (a byte-level vocabulary: every byte of the tool schemas and results is a token)
    config = AgentConfig(max_total_tokens=60_000, max_tokens_per_turn=1024)
    runner = AgentRollout(sampler, sandbox_factory(), config, tokenizer=htok, eos_token_ids=sampler.eos_token_ids)
    try:
        assert runner.parser == "openai" and isinstance(runner.chat, HarmonyChatTokens)  # chosen from the template
        [group] = runner.run([spec], 1, PARAMS)
    finally:
        runner.close()
    [e] = group.episodes
    assert (e.finish, e.error, e.reward) == ("submitted", None, 1.0), [r.content[:200] for t in e.turns for r in t.results]
    assert [c.name for t in e.turns for c in t.calls] == ["read_file", "edit_file", "run_tests", "submit"]
    assert all(t.content == "" for t in e.turns)  # the analysis is not content, and never a call
    ids, traj = e.trajectory.token_ids, e.trajectory
    assert htok.decode(ids, skip_special_tokens=False) == e.chat.text
    # the first prompt: the template's rendering, encoded once
    first = htok.encode(htok.apply_chat_template(e.chat.messages[:2], tools=agent_tool_schemas(), add_generation_prompt=True),
                        add_special_tokens=False)
    assert ids[: len(first)] == first and traj.prompt_length == len(first)
    call, _ = _ids(htok)
    runs = []
    start = None
    for i, m in enumerate(traj.loss_mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    assert len(runs) == 4
    for turn, (a, b) in enumerate(runs):
        assert ids[a:b] == htok.encode(script[turn], add_special_tokens=False) + [call]
        assert traj.logprobs[a:b] == [script_logprob(turn, i) for i in range(b - a)]
    # between turns: the tool's result as a harmony message, then the generation prompt, encoded as a whole would be
    between = htok.decode(ids[runs[0][1]:runs[1][0]], skip_special_tokens=False)
    assert between.startswith("<|start|>functions.read_file to=assistant<|channel|>commentary<|message|>")
    assert between.endswith("<|end|><|start|>assistant") and "def rotate" in between
    assert htok.encode(between, add_special_tokens=False) == ids[runs[0][1]:runs[1][0]]
    # the product's view: each assistant turn's call, each tool message answering its id
    msgs = e.openai_messages()
    called = [c["id"] for m in msgs if m["role"] == "assistant" for c in m.get("tool_calls", [])]
    assert [m["tool_call_id"] for m in msgs if m["role"] == "tool"] == called[:3]


def test_an_answer_ends_the_episode_and_cannot_be_continued(htok):
    call, ret = _ids(htok)
    chat = HarmonyChatTokens(htok, None, {call, ret})
    state, _ = chat.start([{"role": "user", "content": "hi"}])
    answer = htok.encode("<|channel|>final<|message|>hello", add_special_tokens=False) + [ret]
    assert chat.turn_text(answer) == ("<|channel|>final<|message|>hello", True)
    with pytest.raises(TemplateNotAppendOnly, match="<\\|return\\|>"):
        chat.append_turn(state, answer, [{"role": "user", "content": "more"}])
    with pytest.raises(TemplateNotAppendOnly, match="cut before its stop token"):
        chat.append_turn(state, answer[:-1], [])
    with pytest.raises(ValueError, match="EOS"):
        HarmonyChatTokens(htok, None, {call})
