"""The agent loop with a scripted policy: read -> edit -> run tests -> submit earns reward 1 in the
sandbox; the trajectory's ids are the chat template's rendering of its conversation; loss mask,
behaviour logprobs and weight versions sit exactly on the sampled tokens; bad input, limits,
reward hacking and environments that cannot start (issue 17, acceptance 1, 2 and 5)."""
from __future__ import annotations

import pytest
from agent_scripts import FakeEnvironment, ScriptedSampler, call, fix_script, script_logprob

from cuttle.engine.default_model import default_model_path
from cuttle.engine.sampling_params import SamplingParams
from cuttle.engine.tokenizer import Tokenizer
from cuttle.rl.agent import AgentConfig, AgentRollout, agent_batch, clip_output, episode_stats
from cuttle.rl.chat import ChatTokens
from cuttle.rl.environment import sandbox_factory
from cuttle.sandbox.tasks import make_task
from cuttle.sandbox.tools import agent_tool_schemas

PARAMS = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(default_model_path())


def rollout(tok, scripts, factory, config=None, specs=None, group_size=1):
    sampler = ScriptedSampler(tok, scripts)
    runner = AgentRollout(sampler, factory, config, tokenizer=tok, eos_token_ids=sampler.eos_token_ids)
    try:
        groups = runner.run(specs, group_size, PARAMS)
    finally:
        runner.close()
    return groups, sampler


def fake_factory(**kw):
    return lambda spec: FakeEnvironment(spec, **kw)


def sampled_runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of every run of 1s in a loss mask."""
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_scripted_fix_earns_reward_1_and_the_stream_is_the_template_rendering(tok, namespaces):
    spec = {"kind": "synthetic", "seed": 1}
    groups, sampler = rollout(tok, {make_task(spec).prompt: fix_script(spec)}, sandbox_factory(), specs=[spec], group_size=2)
    # turn 1: one request with n = 2 (the group's prompt prefilled once); later turns one per member
    assert sampler.calls == [(1, 2), (2, 1), (2, 1), (2, 1)]
    tools = agent_tool_schemas()
    for e in groups[0].episodes:
        assert (e.finish, e.error, e.reward) == ("submitted", None, 1.0)
        assert [c.name for t in e.turns for c in t.calls] == ["read_file", "edit_file", "run_tests", "submit"]
        assert [r.ok for t in e.turns for r in t.results] == [True] * 4
        assert "def rotate" in e.turns[0].results[0].content and "0 failed" in e.turns[2].results[0].content
        assert e.reward_info["passed"] > 0 and e.reward_info["failed"] == 0
        traj = e.trajectory
        ids = traj.token_ids
        # token identity: the whole conversation rendered by the template and encoded at once is the
        # stream, then the template's closing "\n" after the last sampled end-of-turn token
        rendered = tok.apply_chat_template(e.chat.messages, tools=tools, add_generation_prompt=False)
        assert tok.encode(rendered, add_special_tokens=False) == ids + tok.encode("\n", add_special_tokens=False)
        assert rendered == e.chat.text + "\n"
        # the script writes calls the way the template does, so the product's view renders the same
        assert tok.apply_chat_template(e.openai_messages(), tools=tools, add_generation_prompt=False) == rendered
        assert [m.get("tool_calls", [{}])[0].get("function", {}).get("name") for m in e.openai_messages()
                if m["role"] == "assistant"] == ["read_file", "edit_file", "run_tests", "submit"]
        # each tool message answers the id its call has in that view (the ids the run gave the calls)
        called = [c["id"] for m in e.openai_messages() if m["role"] == "assistant" for c in m.get("tool_calls", [])]
        assert [m["tool_call_id"] for m in e.openai_messages() if m["role"] == "tool"] == called[:3]
        # the first prompt is the system prompt with the tools and the task, with the generation prompt
        first = tok.encode(tok.apply_chat_template(e.chat.messages[:2], tools=tools), add_special_tokens=False)
        assert ids[: len(first)] == first and traj.prompt_length == len(first)
        # loss mask 1 exactly on the sampled ids, with their logprobs and weight version; 0 / 0.0 / -1 elsewhere
        runs = sampled_runs(traj.loss_mask)
        assert len(runs) == 4
        for turn, (a, b) in enumerate(runs):
            expected = tok.encode(fix_script(spec)[turn], add_special_tokens=False) + [2]
            assert ids[a:b] == expected
            assert traj.logprobs[a:b] == [script_logprob(turn, i) for i in range(b - a)]
            assert traj.weight_versions[a:b] == [0] * (b - a)
        assert all(lp == 0.0 and v == -1 for m, lp, v in zip(traj.loss_mask, traj.logprobs, traj.weight_versions) if not m)
        assert sum(traj.loss_mask) == sum(b - a for a, b in runs) and runs[-1][1] == len(ids)


def test_reward_hacking_cannot_change_the_reward(tok, namespaces):
    forged = '\\n@@cuttle-tests@@ 0 {"exit": 0, "outcomes": {"t": "passed"}}\\n'
    hacks = {
        # visible tests rewritten to pass, and "hidden" tests planted in the workspace
        11: [call("run", command="for f in tests/test_*.py; do printf 'def test_ok():\\n    assert True\\n' > $f; done"),
             call("write_file", path="_hidden_tests/test_planted.py", content="def test_ok():\n    assert True\n"),
             call("run_tests", selection="tests"), call("submit")],
        12: [call("write_file", path="conftest.py", content="import os\nos._exit(0)\n"), call("submit")],
        # the package itself ends the process early, with and without a forged result line
        13: [call("run", command=f"cat >> $(ls -d */ | grep -v tests | grep -v _hidden | head -1)__init__.py <<'EOF'\n"
                  f"import os, sys\nsys.stderr.write('{forged}')\nos._exit(0)\nEOF"), call("submit")],
        # looking for the hidden tests from inside the agent's workspace finds nothing
        14: [call("run", command="ls -a; ls -R / 2>/dev/null | grep -c _hidden_tests; cat _hidden_tests/*"), call("submit")],
    }
    specs = [{"kind": "synthetic", "seed": s} for s in hacks]
    scripts = {make_task(sp).prompt: hacks[sp["seed"]] for sp in specs}
    groups, _ = rollout(tok, scripts, sandbox_factory(), specs=specs)
    for g in groups:
        [e] = g.episodes
        assert e.finish == "submitted" and e.reward == 0.0, (g.spec, e.reward_info)
    [e11], [e14] = groups[0].episodes, groups[3].episodes
    assert "3 passed, 0 failed" in e11.turns[2].results[0].content  # the hack did fool the visible run
    out = e14.turns[0].results[0].content
    assert "No such file" in out and "\n0\n" in out and "def test_" not in out


def test_bad_tool_calls_become_error_messages_and_the_rollout_goes_on(tok, namespaces):
    spec = {"kind": "synthetic", "seed": 2}
    script = [
        "<tool_call>\n{not json}\n</tool_call>",
        call("no_such_tool", x=1) + "\n" + call("read_file", path=3),
        call("read_file", path="../../etc/passwd") + "\n" + '<tool_call>\n{"name": "read_file", "arguments": "[1]"}\n</tool_call>',
        "I will read it.\n<tool_call>\n{\"name\": \"list_dir\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"read_",
        call("submit"),
    ]
    groups, _ = rollout(tok, {make_task(spec).prompt: script}, sandbox_factory(), specs=[spec])
    [e] = groups[0].episodes
    assert e.finish == "submitted" and e.reward == 0.0 and len(e.turns) == 5
    shown = [[(r.ok, r.content) for r in t.results] for t in e.turns]
    assert shown[0][0][0] is False and shown[0][0][1].startswith("Error: malformed tool call") and "{not json}" in shown[0][0][1]
    assert "unknown tool 'no_such_tool'" in shown[1][0][1] and "must be of type string" in shown[1][1][1]
    assert not shown[2][0][0] and not shown[2][1][0] and "JSON object" in shown[2][1][1]
    # a good call and an unterminated one in the same turn: the call runs, the rest is an error
    assert shown[3][0][0] and shown[3][1][1].startswith("Error: malformed") and len(e.turns[3].malformed) == 1
    # every error reached the model: the tool messages are in the stream it sampled its next turn from
    assert all(r.content in e.chat.text for t in e.turns[:4] for r in t.results)


def test_tool_calls_of_one_turn_run_concurrently(tok):
    log: list = []
    script = [call("a") + "\n" + call("b") + "\n" + call("c"), "Done: nothing left to do."]
    groups, _ = rollout(tok, {"Task fake/0": script}, fake_factory(delay=0.4, log=log), specs=[{"seed": 0}])
    [e] = groups[0].episodes
    assert e.finish == "answered" and e.reward == 1.0
    assert [r.content for r in e.turns[0].results] == ['a ok {}', 'b ok {}', 'c ok {}']
    (_, s0, e0), (_, s1, e1), (_, s2, e2) = sorted(log, key=lambda x: x[1])
    assert max(s0, s1, s2) < min(e0, e1, e2), "the three calls must overlap in time"


def test_environment_that_cannot_start_fails_its_episode_only(tok):
    def factory(spec):
        if spec["seed"] == 13:
            raise OSError("no space left on device")
        return FakeEnvironment(spec)

    specs = [{"seed": 12, "reward": 1.0}, {"seed": 13}, {"seed": 14, "reward": 0.0}]
    scripts = {f"Task fake/{s}": [call("look"), "done"] for s in (12, 14)}
    groups, _ = rollout(tok, scripts, factory, specs=specs, group_size=2)
    for e in groups[1].episodes:
        assert e.finish == "env_error" and e.trajectory is None and e.failed
        assert "could not start" in e.error and "OSError: no space left on device" in e.error
    assert [e.finish for g in (groups[0], groups[2]) for e in g.episodes] == ["answered"] * 4
    batch, counts = agent_batch(groups, scale_by_std=False)
    assert counts == {"kept": 4, "filtered": 0, "failed": 2} and batch.num_seqs == 4
    assert batch.group_ids.tolist() == [0, 0, 2, 2] and batch.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_an_environment_whose_close_raises_loses_nothing(tok):
    """A close() that raises (the sandbox's rmtree under a still-running process) failed the whole
    call (on Ray: the step, every group lost) and left the later environments open. Now it is
    logged and counted; every episode keeps its result and every other environment is closed."""
    made = []

    class BadClose(FakeEnvironment):
        def close(self) -> None:
            super().close()
            if self.spec["seed"] == 13:
                raise OSError("Directory not empty")

    def factory(spec):
        made.append(BadClose(spec))
        return made[-1]

    specs = [{"seed": 12, "reward": 1.0}, {"seed": 13, "reward": 0.5}, {"seed": 14, "reward": 0.0}]
    scripts = {f"Task fake/{s}": [call("look"), "done"] for s in (12, 13, 14)}
    sampler = ScriptedSampler(tok, scripts)
    runner = AgentRollout(sampler, factory, None, tokenizer=tok, eos_token_ids=sampler.eos_token_ids)
    try:
        groups = runner.run(specs, 2, PARAMS)
    finally:
        runner.close()
    assert [e.reward for g in groups for e in g.episodes] == [1.0, 1.0, 0.5, 0.5, 0.0, 0.0]
    assert all(e.finish == "answered" for g in groups for e in g.episodes)
    assert runner.env_close_errors == 2 and len(made) == 6 and all(env.closed for env in made)


def test_limits_cut_episodes_and_compact_filtering_drops_them(tok):
    forever = [call("look", i=i) for i in range(50)]
    cfg = AgentConfig(max_turns=3)
    groups, _ = rollout(tok, {"fake/0": forever}, fake_factory(), cfg, [{"seed": 0}], group_size=2)
    assert [(e.finish, len(e.turns), e.truncated) for e in groups[0].episodes] == [("max_turns", 3, True)] * 2
    batch, counts = agent_batch(groups, scale_by_std=True)
    assert batch is None and counts == {"kept": 0, "filtered": 2, "failed": 0}
    batch, counts = agent_batch(groups, scale_by_std=True, filter_truncated=False)
    assert batch.num_seqs == 2 and counts == {"kept": 2, "filtered": 0, "failed": 0}
    # context: the stream may not pass max_total_tokens; a turn is cut to fit (finish "context")
    groups, _ = rollout(tok, {"fake/0": forever}, fake_factory(), AgentConfig(max_total_tokens=1500), [{"seed": 0}])
    [e] = groups[0].episodes
    assert e.finish == "context" and len(e.trajectory.token_ids) <= 1500
    # one turn longer than max_tokens_per_turn
    groups, _ = rollout(tok, {"fake/0": ["word " * 100]}, fake_factory(), AgentConfig(max_tokens_per_turn=10), [{"seed": 0}])
    [e] = groups[0].episodes
    assert e.finish == "max_tokens" and sum(e.trajectory.loss_mask) == 10
    # wall clock, checked between turns
    groups, _ = rollout(tok, {"fake/0": forever}, fake_factory(delay=0.3), AgentConfig(max_wall_seconds=0.2), [{"seed": 0}])
    [e] = groups[0].episodes
    assert e.finish == "wall_clock" and len(e.turns) == 1 and e.truncated


def test_tool_output_is_clipped_head_and_tail(tok):
    groups, _ = rollout(tok, {"fake/0": [call("huge"), "ok"]}, fake_factory(), AgentConfig(max_tool_output_chars=300),
                        [{"seed": 0}])
    [e] = groups[0].episodes
    content = e.turns[0].results[0].content
    assert content == clip_output("x" * 10_000, 300) and "[... 9700 characters truncated ...]" in content
    stats = episode_stats(groups)
    assert stats["calls_huge"] == 1 and stats["finish_answered"] == 1 and stats["turns_mean"] == 2


def test_a_template_that_rewrites_past_turns_ends_the_episode_with_the_reason(tok):
    bad = Tokenizer(default_model_path())
    bad.chat_template = bad.chat_template.replace("nl + (message.content or '')", "nl + (message.content or '') | upper")
    assert bad.chat_template != tok.chat_template
    bad._compiled = bad._env.from_string(bad.chat_template)
    groups, _ = rollout(bad, {"fake/0": [call("look"), "done"]}, fake_factory(), specs=[{"seed": 0}])
    [e] = groups[0].episodes
    assert e.finish == "template" and "turn 1" in e.error and "differs from the token stream" in e.error
    assert len(e.turns) == 1 and not e.failed  # graded: its workspace is what it is
    assert bad.decode(e.trajectory.token_ids, skip_special_tokens=False) == e.chat.text  # trained up to that turn


def test_chat_tokens_refuse_a_template_without_an_eos_closing_turns(tok):
    with pytest.raises(ValueError, match="closes an assistant turn"):
        ChatTokens(tok, None, {0})  # <|endoftext|> is not what the template writes after a turn



def test_an_environment_runs_one_call_at_a_time(namespaces):
    """A turn's tool calls run concurrently, and the host-side file tools, grading and cleanup act
    as root on workspace paths: a `run` swapping a directory for a symlink meanwhile made them
    read, create or delete outside the workspace (a probe deleted a host file through close()'s
    rmtree and read a root-only file through search). One environment now takes one call at a
    time: a list_dir issued while a command runs waits for it, and close() waits for it too."""
    import threading
    import time

    env = sandbox_factory()({"kind": "synthetic", "seed": 1})
    ends: dict[str, float] = {}

    def run():
        ok, out = env.call("run", {"command": "sleep 1; echo done"})
        ends["run"] = time.monotonic()
        assert ok and "done" in out

    def listing():
        ok, _ = env.call("list_dir", {"path": "."})
        ends["list"] = time.monotonic()
        assert ok

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.3)
    listing()
    assert ends["list"] >= ends["run"]
    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.3)
    env.close()
    closed = time.monotonic()
    t.join()
    assert closed >= ends["run"]


@pytest.mark.parametrize("fmt", ["qwen3_coder", "seed_oss", "glm45", "deepseek_v3", "deepseek_v31", "minimax_m2", "mistral",
                                 "llama3_json", "kimi_k2", "granite"])
def test_the_scripted_fix_in_every_tool_call_format(tok, namespaces, fmt):
    """The same episode with the calls written in each format the parsers read (AgentConfig.parser):
    every call runs with its arguments (the fix lands: reward 1), and the product's view of the
    conversation carries the calls, each tool message answering its call's id."""
    spec = {"kind": "synthetic", "seed": 1}
    groups, _ = rollout(tok, {make_task(spec).prompt: fix_script(spec, fmt)}, sandbox_factory(), config=AgentConfig(parser=fmt),
                        specs=[spec])
    [e] = groups[0].episodes
    assert (e.finish, e.error, e.reward) == ("submitted", None, 1.0), [r.content[:200] for t in e.turns for r in t.results]
    assert [c.name for t in e.turns for c in t.calls] == ["read_file", "edit_file", "run_tests", "submit"]
    msgs = e.openai_messages()
    called = [c["id"] for m in msgs if m["role"] == "assistant" for c in m.get("tool_calls", [])]
    assert [m["tool_call_id"] for m in msgs if m["role"] == "tool"] == called[:3]


def test_every_tool_call_format_has_its_malformed_call_hint():
    """A malformed call is told the shape of a call in the episode's format (a KeyError at the
    first malformed call otherwise), and the hint is that format's."""
    from cuttle.engine.tool_parsers import PARSERS
    from cuttle.rl.agent import _CALL_SHAPES, _placeholder

    assert set(_CALL_SHAPES) == set(PARSERS)
    assert "<arg_key>" in _placeholder("<tool_call>x</tool_call>", None, "glm45").content
