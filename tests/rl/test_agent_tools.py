"""A subset of the agent tools (`AgentConfig.tools`): unknown names are refused; the system prompt
carries exactly the offered schemas (the product's own, fewer of them), a call of a tool not
offered is an error message the model reads while the episode goes on, and `submit` ends an
episode only when it is offered."""
from __future__ import annotations

import pytest
from agent_scripts import FakeEnvironment, ScriptedSampler, call

from cuttle.engine.default_model import default_model_path
from cuttle.engine.sampling_params import SamplingParams
from cuttle.engine.tokenizer import Tokenizer
from cuttle.rl.agent import AgentConfig, AgentRollout, offered_tools
from cuttle.sandbox.tools import agent_tool_schemas


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(default_model_path())


def run(tok, script, tools):
    sampler = ScriptedSampler(tok, {"fake/0": script})
    runner = AgentRollout(sampler, lambda spec: FakeEnvironment(spec), AgentConfig(max_turns=4, tools=tools),
                          tokenizer=tok, eos_token_ids=sampler.eos_token_ids)
    try:
        [group] = runner.run([{"seed": 0}], 1, SamplingParams(temperature=1.0))
    finally:
        runner.close()
    return group.episodes[0]


@pytest.mark.parametrize("tools, message", [
    (("edit_file", "read_fil"), "unknown tool(s) 'read_fil'; available: read_file"),
    (("submit", "submit"), "named twice"),
    ((), "non-empty sequence"),
    ("edit_file", "non-empty sequence"),
])
def test_bad_tool_subsets_are_refused_naming_the_field(tools, message):
    with pytest.raises(ValueError, match="AgentConfig.tools") as err:
        AgentConfig(tools=tools)
    assert message in str(err.value)


def test_the_prompt_offers_only_the_subset_and_other_tools_are_refused(tok):
    e = run(tok, [call("read_file", path="a.py"), call("edit_file", path="a.py", old_str="x", new_str="y"),
                  call("submit")], ("submit", "edit_file"))
    # the product's own schemas, in the product's order, only the two offered
    assert offered_tools(("submit", "edit_file")) == [s for s in agent_tool_schemas()
                                                     if s["function"]["name"] in ("edit_file", "submit")]
    prompt = tok.decode(e.trajectory.token_ids[:e.trajectory.prompt_length], skip_special_tokens=False)
    full = tok.apply_chat_template(e.chat.messages[:2], tools=agent_tool_schemas(), add_generation_prompt=True)
    assert '"name": "edit_file"' in prompt and '"name": "submit"' in prompt
    assert '"name": "read_file"' not in prompt and '"name": "run_tests"' not in prompt
    assert e.trajectory.prompt_length < len(tok.encode(full, add_special_tokens=False)) / 2
    # read_file exists in the environment, but was not offered: an error for the model, the episode goes on
    assert [(r.name, r.ok, r.content) for t in e.turns for r in t.results] == [
        ("read_file", False, "Error: unknown tool 'read_file'; available: edit_file, submit"),
        ("edit_file", True, 'edit_file ok {"new_str": "y", "old_str": "x", "path": "a.py"}'),
        ("submit", True, "submitted")]
    assert (e.finish, e.reward) == ("submitted", 1.0)


def test_submit_ends_an_episode_only_when_offered(tok):
    e = run(tok, [call("submit"), "done"], ("edit_file",))
    assert e.turns[0].results[0].content == "Error: unknown tool 'submit'; available: edit_file"
    assert e.finish == "answered" and len(e.turns) == 2
