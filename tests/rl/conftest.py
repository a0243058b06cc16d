"""A tiny random Qwen3-MoE checkpoint for the RL tests (no transformers oracle run needed)."""
from __future__ import annotations

import random

import pytest

from helpers import make_checkpoint


@pytest.fixture(scope="session")
def moe_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("rl_qwen3_moe"))
    make_checkpoint(path, "qwen3_moe", seed=3)
    return path


def _random_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(length)] for _ in range(count)]


@pytest.fixture(scope="session")
def random_prompts():
    """random_prompts(count, length, seed=0): token-id prompts for the tiny checkpoints."""
    return _random_prompts
