"""A tiny random Qwen3-MoE checkpoint for the RL tests (no transformers oracle run needed)."""
from __future__ import annotations

import os
import random
import sys

import pytest

from helpers import make_checkpoint

sys.path.insert(0, os.path.dirname(__file__))  # agent_scripts: the scripted policies shared by the agent tests


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


@pytest.fixture
def namespaces() -> None:
    """Sandboxed agent tests need namespace isolation: skip only where the host refuses it (the
    sandbox suite's own rule: any other setup failure is a bug and fails)."""
    from cuttle.sandbox import isolation

    if isolation.namespace_error() is None:
        return
    host_error = isolation.host_namespace_error()
    if host_error is not None:
        pytest.skip(f"no user namespaces on this host: {host_error}")
    pytest.fail(f"sandbox setup failed, and not because this host refuses namespaces: {isolation.namespace_error()}",
                pytrace=False)
