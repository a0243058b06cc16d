"""The agent GRPO example runs end to end on the embedded model in the sandbox (1 step after a
1-step warm start on 2 scripted narrow-task trajectories, tiny turns) and writes its three outputs
with the per-step stats; its task set and its first-vs-last comparison are what they claim."""
from __future__ import annotations

import json
import math
import os

import pytest

from cuttle.rl.examples.agent_grpo import compare, linear_fit, main
from cuttle.rl.examples.agent_tasks import NARROW_EDITS, NARROW_PACKAGE, fix_turns, guided_fix, guided_seeds, guided_task


def test_agent_grpo_runs_a_step_and_writes_log_plot_and_summary(tmp_path, namespaces):
    out = str(tmp_path / "run")
    summary = main(["--steps", "1", "--warm-start-steps", "1", "--warm-start-tasks", "2", "--tasks", "2", "--groups", "1",
                    "--group-size", "2", "--max-turns", "1", "--max-tokens-per-turn", "8", "--budget-minutes", "0",
                    "--out", out])
    [rec] = [json.loads(x) for x in open(os.path.join(out, "log.jsonl"))]
    assert rec["step"] == 1 and rec["episodes"] == 2.0 and rec["turns_mean"] == 1.0
    assert rec["hidden_tests_reward_mean"] in (0.0, 0.5, 1.0) and 0.0 <= rec["format_rate"] <= 1.0
    assert rec["edit_right_rate"] + rec["edit_wrong_rate"] + rec["edit_none_rate"] == 1.0
    assert sum(rec["task_bugs"].values()) == 1 and set(rec["task_bugs"]) <= {old for _, old, _ in NARROW_EDITS}
    assert sum(rec["edit_choices"].values()) == 2
    assert rec["sampled_tokens"] > 0 and rec["straggler_wait_seconds"] >= 0.0
    # 8 tokens cannot hold an edit call: no edit, reward 0, nothing to train on
    assert rec["edit_right_rate"] == 0.0 and rec["hidden_tests_reward_mean"] == 0.0
    # the warm start moved the weights into the engine (version 1); a GRPO step with signal pushes again
    assert rec["weight_version"] == (2 if "loss" in rec else 1)
    with open(os.path.join(out, "reward.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    saved = json.load(open(os.path.join(out, "summary.json")))
    assert saved["steps"] == summary["steps"] == 1 and saved["warm_start_steps"] == 1
    assert saved["tools"] == ["edit_file", "submit"] and saved["improved_beyond_noise"] is False


def test_bad_arguments_are_refused_naming_the_flag(tmp_path):
    with pytest.raises(SystemExit):
        main(["--group-size", "0", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="unknown tool"):
        main(["--tools", "edit_file,grep", "--out", str(tmp_path)])


def test_narrow_tasks_name_one_of_four_edits_and_the_scripted_fix_is_that_call():
    seeds = guided_seeds(0, 12, only_narrow=True)
    for s in seeds:
        task, path, old, new = guided_fix(s)
        package, module = path.split("/")
        assert package == NARROW_PACKAGE and (module, old, new) in NARROW_EDITS
        assert task.files[path].count(old) == 1
        assert json.dumps({"path": path, "old_str": old, "new_str": new}) in guided_task(s).prompt
        assert json.dumps({"path": path, "old_str": old, "new_str": new}) in fix_turns(s)[0]
        assert not any(name in guided_task(s).prompt for name in task.hidden_files)


def test_compare_first_and_last_steps():
    per_step = [[0.0] * 8, [0.0] * 7 + [1.0], [0.0] * 8, [1.0] * 4 + [0.0] * 4, [1.0] * 6 + [0.0] * 2, [1.0] * 8]
    rewards = [sum(s) / 8 for s in per_step]
    c = compare(rewards, per_step, 3)
    assert c["first_mean"] == pytest.approx(1 / 24) and c["last_mean"] == pytest.approx(18 / 24)
    assert c["first_spread"] == pytest.approx(math.sqrt(2) / 24)
    # 1 of 24 vs 18 of 24 episodes: pooled 19/48
    p = 19 / 48
    assert c["z_last_vs_first"] == pytest.approx((17 / 24) / math.sqrt(p * (1 - p) * (2 / 24)))


def test_linear_fit_recovers_a_line_and_its_error():
    fit = linear_fit([0.1 + 0.02 * i for i in range(10)])
    assert fit["slope_per_step"] == pytest.approx(0.02) and fit["slope_se"] == pytest.approx(0.0, abs=1e-12)
    assert fit["fit_first"] == pytest.approx(0.1) and fit["fit_last"] == pytest.approx(0.28)
    zigzag = linear_fit([0.0, 1.0] * 5)  # slope 1/33 per step, t well under 2
    assert zigzag["slope_per_step"] == pytest.approx(1 / 33) and abs(zigzag["slope_t"]) < 1
