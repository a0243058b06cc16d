"""Speculative decoding with a draft model (engine/draft_model.py). With batch-invariant kernels
every output is bit-identical with and without a draft, greedy and seeded random, n > 1,
penalties and logprobs included, whatever the draft proposes: the embedded model as its own draft
(drafts almost always kept: steps saved) and a random model of the same vocabulary (drafts almost
never kept). Queries over squid documents are drafted over their flat prompt; requests with token
controls are not drafted; configs the engine cannot honour are refused naming the key."""
from __future__ import annotations

import os

import pytest
import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.default_model import DEFAULT_MODEL_DIR
from cuttle.engine.sampling_params import StructuredOutputsParams
from cuttle.engine.spec_decode import SpecConfig
from helpers import make_checkpoint

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, "config.json")),
                                reason="the embedded default model has not been trained yet")
CODE = ["def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n",
        "class Queue:\n    def __init__(self, maxsize=0):\n        self.maxsize = maxsize\n",
        "for key, value in sorted(items):\n"]
CASES = [SamplingParams(temperature=0, max_tokens=32, logprobs=2),
         SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=32, logprobs=1, n=2),
         SamplingParams(temperature=1.0, seed=5, max_tokens=24, repetition_penalty=1.3, frequency_penalty=0.4),
         SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.2, presence_penalty=0.5)]


def _outputs(llm: LLM, prompts, sp) -> list:
    return [(c.token_ids, c.finish_reason, c.cumulative_logprob,
             None if c.logprobs is None else [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
            for r in llm.generate(prompts, sp, use_tqdm=False) for c in r.outputs]


@pytest.fixture(scope="module")
def base():
    return LLM(DEFAULT_MODEL_DIR, dtype="float32", num_kv_blocks=256, batch_invariant=True)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("draft"))
    make_checkpoint(path, "qwen3", seed=4, vocab_size=8196)  # the embedded model's vocabulary size
    return path


def _drafted(draft: str, **kw) -> LLM:
    spec = {"model": draft, "num_speculative_tokens": 4, "disable_by_batch_size": None, **kw}
    return LLM(DEFAULT_MODEL_DIR, dtype="float32", num_kv_blocks=256, batch_invariant=True, speculative_config=spec)


def test_the_model_as_its_own_draft_keeps_drafts_and_changes_nothing(base):
    """Greedy, the draft's proposals are the target's own argmax: (almost) all kept, and the steps
    saved. Sampled, the draft samples its own distribution with the uniforms the target will draw:
    the same distribution, so (almost) all kept too (greedy drafts were kept only where the sample
    happened to be the argmax: 0.25 in docs/benchmarks.md). Penalties are the draft's too,
    counting the target's outputs (without them the penalized case kept 27 of 50 here)."""
    spec = _drafted(DEFAULT_MODEL_DIR)
    steps = (base.engine.counters["steps"], spec.engine.counters["steps"])
    assert _outputs(spec, CODE, CASES[0]) == _outputs(base, CODE, CASES[0])
    stats = spec.engine.stats()
    assert stats["spec_accepted_tokens"] >= 0.9 * stats["spec_draft_tokens"] > 0
    assert spec.engine.counters["steps"] - steps[1] < 0.5 * (base.engine.counters["steps"] - steps[0])
    for sp in CASES[1:]:
        drafted, kept = spec.engine.counters["spec_draft_tokens"], spec.engine.counters["spec_accepted_tokens"]
        assert _outputs(spec, CODE, sp) == _outputs(base, CODE, sp), sp
        drafted, kept = spec.engine.counters["spec_draft_tokens"] - drafted, spec.engine.counters["spec_accepted_tokens"] - kept
        assert kept >= 0.9 * drafted > 0, (sp, kept, drafted)
    bm = spec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # nothing held for a draft


def test_a_random_draft_is_rejected_and_changes_nothing(base, random_draft):
    spec = _drafted(random_draft)
    for sp in CASES:
        assert _outputs(spec, CODE, sp) == _outputs(base, CODE, sp), sp
    stats = spec.engine.stats()
    assert 0 < stats["spec_draft_tokens"] and stats["spec_accepted_tokens"] < 0.3 * stats["spec_draft_tokens"]


def test_draft_weights_are_updated_on_their_own(base):
    """`update_draft_weights`: the draft's weights perturbed, its drafts are mostly rejected; put
    back, mostly kept again (its KV under the old weights never reused); the outputs equal the
    plain engine's throughout. Without a draft model the call is refused."""
    spec = _drafted(DEFAULT_MODEL_DIR)
    draft = spec.engine.proposer.engine
    own = {n: p.detach().clone() for n, p in draft.runner.model.named_parameters()}

    def kept_fraction() -> float:
        drafted, kept = spec.engine.counters["spec_draft_tokens"], spec.engine.counters["spec_accepted_tokens"]
        assert _outputs(spec, CODE, CASES[0]) == _outputs(base, CODE, CASES[0])
        return (spec.engine.counters["spec_accepted_tokens"] - kept) / (spec.engine.counters["spec_draft_tokens"] - drafted)

    assert kept_fraction() >= 0.9
    g = torch.Generator().manual_seed(0)
    v = spec.update_draft_weights([(n, t + torch.randn(t.shape, generator=g) * (t.std() + 0.1) * 3) for n, t in own.items()])
    assert v == 1 and spec.engine.weight_version == 0  # the target's weights are untouched
    assert kept_fraction() < 0.5
    assert spec.update_draft_weights(own.items()) == 2
    assert kept_fraction() >= 0.9
    with pytest.raises(ValueError, match="update_draft_weights needs speculative_config with a draft model"):
        base.update_draft_weights(own.items())


def test_documents_are_drafted_over_the_flat_prompt_and_controls_are_not_drafted(base):
    """A query over squid documents: the draft reads prefix, documents and query laid out flat; a
    structured-output request is not drafted. Both equal the engine without a draft."""
    spec = _drafted(DEFAULT_MODEL_DIR)
    docs = {"documents": ["def helper(x):\n    return x * 2\n"], "prompt": "def use(y):\n    return helper("}
    sp = SamplingParams(temperature=0, max_tokens=12)
    assert _outputs(spec, [docs], sp) == _outputs(base, [docs], sp)
    drafted = spec.engine.stats()["spec_draft_tokens"]
    assert drafted > 0
    choice = SamplingParams(temperature=0, max_tokens=6, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert _outputs(spec, ["Answer: "], choice) == _outputs(base, ["Answer: "], choice)
    assert spec.engine.stats()["spec_draft_tokens"] == drafted


@pytest.mark.parametrize("spec, match", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model .* is required"),
    ({"model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "prompt_lookup_max is a prompt-lookup"),
    ({"method": "ngram", "model": "d", "num_speculative_tokens": 2}, "speculative_config.model is a draft model's"),
    ({"model": "d"}, "num_speculative_tokens is required"),
])
def test_bad_draft_configs_are_refused_naming_the_key(spec, match):
    with pytest.raises(ValueError, match=match):
        SpecConfig.parse(spec)
    assert SpecConfig.parse({"model": "d", "num_speculative_tokens": 3}) == SpecConfig("draft_model", 3, 4, 2, 4, "d")


def test_drafts_the_engine_cannot_use_are_refused(tmp_path):
    big = str(tmp_path / "big")
    make_checkpoint(big, "qwen3", seed=1, vocab_size=9000)
    with pytest.raises(ValueError, match="vocabulary \\(9000 tokens\\) is larger than the target's \\(8196\\)"):
        _drafted(big)
    with pytest.raises(ValueError, match="is not a checkpoint directory"):
        _drafted(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="cannot be combined with enable_sleep_mode"):
        LLM(DEFAULT_MODEL_DIR, dtype="float32", num_kv_blocks=64, enable_sleep_mode=True,
            speculative_config={"model": DEFAULT_MODEL_DIR, "num_speculative_tokens": 2})


def test_served_with_a_draft_model_from_the_cli_json(base):
    """`--speculative-config` JSON with a draft `model`, as vLLM's: the served tokens are the
    offline engine's without drafts, and the draft counters move."""
    import argparse
    import json

    import httpx

    from cuttle.engine.cli import _engine_args
    from server_fixture import LiveServer

    p = argparse.ArgumentParser()
    _engine_args(p)
    flag = json.dumps({"model": DEFAULT_MODEL_DIR, "num_speculative_tokens": 3, "disable_by_batch_size": None})
    spec = p.parse_args(["--speculative-config", flag]).speculative_config
    with LiveServer(DEFAULT_MODEL_DIR, dtype="float32", num_kv_blocks=256, batch_invariant=True, speculative_config=spec) as srv:
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"model": "test-model", "prompt": CODE[0], "max_tokens": 24, "temperature": 0, "return_token_ids": True})
        stats = srv.llm.engine.stats()
    assert r.status_code == 200, r.text
    want = base.generate([CODE[0]], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].token_ids
    assert r.json()["choices"][0]["token_ids"] == want
    assert stats["spec_accepted_tokens"] > 0
