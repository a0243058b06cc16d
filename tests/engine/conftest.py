"""Session fixtures: tiny random checkpoints per architecture and their transformers greedy outputs."""
from __future__ import annotations

import pytest

from helpers import ARCHS, NEW_TOKENS, hf_greedy, make_checkpoint, parity_prompts


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, dict]:
    out = {}
    prompts = parity_prompts()
    for arch in ARCHS:
        path = str(tmp_path_factory.mktemp(arch))
        model = make_checkpoint(path, arch)
        toks, lps, plps = hf_greedy(model, prompts, NEW_TOKENS)
        out[arch] = {"path": path, "prompts": prompts, "tokens": toks, "logprobs": lps, "prompt_logprobs": plps}
    return out


@pytest.fixture(scope="session")
def qwen3_path(checkpoints) -> str:
    return checkpoints["qwen3"]["path"]
