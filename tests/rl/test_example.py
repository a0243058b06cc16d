"""The GRPO example runs end to end (on a tiny random checkpoint) and writes its three outputs."""
from __future__ import annotations

import json
import os

from cuttle.rl.examples.grpo_tiny import main, noise


def test_grpo_tiny_writes_log_plot_and_summary(moe_path, tmp_path):
    out = str(tmp_path / "run")
    summary = main(["--model", moe_path, "--steps", "2", "--prompts", "2", "--group-size", "4", "--max-tokens", "6", "--out", out])
    lines = [json.loads(x) for x in open(os.path.join(out, "log.jsonl"))]
    assert [r["step"] for r in lines] == [1, 2]
    assert all(0.0 <= r["reward_mean"] <= 1.0 and r["mismatch_max_abs"] <= 1e-5 for r in lines)
    assert [r["weight_version"] for r in lines] == [0, 1]  # each step's weights were pushed back
    with open(os.path.join(out, "reward.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert json.load(open(os.path.join(out, "summary.json")))["steps"] == summary["steps"] == 2


def test_noise_ignores_a_steady_trend():
    assert noise([0.1, 0.2, 0.3, 0.4, 0.5]) < 1e-12
    assert noise([0.0, 1.0, 0.0, 1.0]) > 0.5
