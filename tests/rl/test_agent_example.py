"""The agent GRPO example runs end to end on the embedded model in the sandbox (1 step, a 2-step
warm start on 4 scripted guided-task trajectories, tiny turns) and writes its three outputs with
the per-step stats."""
from __future__ import annotations

import json
import os

from cuttle.rl.examples.agent_grpo import main


def test_agent_grpo_runs_a_step_and_writes_log_plot_and_summary(tmp_path, namespaces):
    out = str(tmp_path / "run")
    summary = main(["--steps", "1", "--warm-start-steps", "2", "--warm-start-tasks", "4", "--groups", "1",
                    "--group-size", "2", "--max-turns", "1",
                    "--max-tokens-per-turn", "8", "--out", out])
    [rec] = [json.loads(x) for x in open(os.path.join(out, "log.jsonl"))]
    assert rec["step"] == 1 and rec["episodes"] == 2.0 and rec["turns_mean"] == 1.0
    assert 0.0 <= rec["reward_mean"] <= 1.2 and 0.0 <= rec["format_rate"] <= 1.0
    assert rec["sampled_tokens"] > 0 and rec["straggler_wait_seconds"] >= 0.0
    # the warm start moved the weights into the engine (version 1); a GRPO step with signal pushes again
    assert rec["weight_version"] == (2 if "loss" in rec else 1)
    if "loss" in rec:
        assert rec["mismatch_fresh_max_abs"] <= 1e-4 and rec["stale_token_frac"] == 0.0
    with open(os.path.join(out, "reward.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    saved = json.load(open(os.path.join(out, "summary.json")))
    assert saved["steps"] == summary["steps"] == 1 and saved["warm_start_steps"] == 2
    assert saved["warm_start_loss_last"] < saved["warm_start_loss_first"]
