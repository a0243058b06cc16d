"""The rollout API over HTTP against a live cuttle server: same samples as in process, weight
updates, a pool of servers, squid prompts (token ids) with their documents computed once."""
from __future__ import annotations

import httpx
import pytest

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.sampling_params import StructuredOutputsParams
from cuttle.rl import sample_groups
from cuttle.rl.client import RolloutClient
from cuttle.rl.trainer import Trainer
from server_fixture import LiveServer

SP = SamplingParams(temperature=1.0, seed=4, max_tokens=10, ignore_eos=True)


def test_remote_groups_equal_local_and_weights_update(moe_path, random_prompts):
    prompts = random_prompts(3, 20, seed=8)
    local = sample_groups(LLM(moe_path, dtype="float32", num_kv_blocks=128), prompts, 4, SP)
    with LiveServer(moe_path, dtype="float32", num_kv_blocks=128) as srv, RolloutClient(srv.url) as client:
        remote = sample_groups(client, prompts, 4, SP)
        assert [[s.token_ids for s in g.samples] for g in remote] == [[s.token_ids for s in g.samples] for g in local]
        for rg, lg in zip(remote, local):
            for rs, ls in zip(rg.samples, lg.samples):
                assert rs.logprobs == pytest.approx(ls.logprobs, abs=1e-6)
                assert rs.weight_version == 0 and rs.finish_reason == "length"
        # one prefill per group on the server too
        assert srv.stats()["prefill_tokens_computed"] == 3 * 20

        trainer = Trainer(moe_path)
        for p in trainer.params:  # a visible change: the engine must follow it
            p.data.mul_(1.1)
        assert trainer.push_weights(client) == 1 and client.weight_version == 1
        updated = client.sample_groups(prompts, 4, SP)
        assert all(s.weight_version == 1 for g in updated for s in g.samples)
        assert [s.token_ids for s in updated[0].samples] != [s.token_ids for s in remote[0].samples]

        # every sampling field the route takes travels (allowed_token_ids, logit_bias, bad_words and
        # truncate_prompt_tokens used to be dropped: another sampler than the in-process one)
        masked = SamplingParams(temperature=1.0, seed=3, max_tokens=6, allowed_token_ids=[5, 6, 9], logit_bias={9: -100},
                                truncate_prompt_tokens=4, ignore_eos=True)
        assert all(set(s.token_ids) <= {5, 6} for g in client.sample_groups(prompts, 2, masked) for s in g.samples)
        with pytest.raises(ValueError, match="structured_outputs is not supported by RolloutClient"):
            client.sample_groups(prompts, 2, SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["a"])))
        bad = httpx.post(srv.url + "/v1/rl/generate", json={"prompts": [[]]})
        assert bad.status_code == 400
        too_big = httpx.post(srv.url + "/v1/rl/generate", json={"prompts": [[999999]]})
        assert too_big.status_code == 400 and "prompts[0]" in too_big.json()["error"]["message"]


def test_pool_spreads_prompts_and_keeps_order(moe_path, random_prompts):
    prompts = random_prompts(3, 12, seed=9)
    local = sample_groups(LLM(moe_path, dtype="float32", num_kv_blocks=128), prompts, 2, SP)
    with LiveServer(moe_path, dtype="float32", num_kv_blocks=128) as a, LiveServer(moe_path, dtype="float32", num_kv_blocks=128) as b:
        with RolloutClient([a.url, b.url]) as client:
            pooled = client.sample_groups(prompts, 2, SP)
            assert [[s.token_ids for s in g.samples] for g in pooled] == [[s.token_ids for s in g.samples] for g in local]
            assert a.stats()["prefill_tokens_computed"] == 2 * 12  # prompts 0 and 2
            assert b.stats()["prefill_tokens_computed"] == 12  # prompt 1


def test_remote_groups_with_documents_equal_local(moe_path):
    docs = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([16, 37, 5])]
    prompts = [{"prefix": [7, 8, 9], "documents": [docs[0], docs[1]], "prompt": [40, 41]},
               {"prefix": [7, 8, 9], "documents": [docs[2], docs[1], docs[0]], "prompt": [42, 43]}]
    local = sample_groups(LLM(moe_path, dtype="float32", num_kv_blocks=128), prompts, 3, SP)
    with LiveServer(moe_path, dtype="float32", num_kv_blocks=128) as srv, RolloutClient(srv.url) as client:
        info = httpx.get(srv.url + "/v1/rl/info").json()
        assert client.squid_positions == info["squid_positions"] == "concat"  # the tiny checkpoint says nothing
        remote = sample_groups(client, prompts, 3, SP)
        assert [[s.token_ids for s in g.samples] for g in remote] == [[s.token_ids for s in g.samples] for g in local]
        for rg, lg in zip(remote, local):
            assert rg.layout == lg.layout and rg.prompt_token_ids == lg.prompt_token_ids
            for rs, ls in zip(rg.samples, lg.samples):
                assert rs.logprobs == pytest.approx(ls.logprobs, abs=1e-6)
        stats = srv.stats()
        assert stats["documents_computed"] == 3 + 1  # each document once, and the prefix, for both groups
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]

        cases = [
            ({"documents": [[5]], "prompt": [6], "query": [1]}, "prompts[0].query"),
            ({"documents": [], "prompt": [6]}, "prompts[0].documents"),
            ({"documents": [[5], []], "prompt": [6]}, "prompts[0].documents[1]"),
            ({"documents": [[5, "a"]], "prompt": [6]}, "prompts[0].documents[0]"),
            ({"prefix": "text", "documents": [[5]], "prompt": [6]}, "prompts[0].prefix"),
            ({"documents": [[5]], "prompt": []}, "prompts[0].prompt"),
            ({"documents": [[5, 999999]], "prompt": [6]}, "documents[0]"),  # the engine's check, field named
            ("text", "prompts[0]"),
        ]
        for bad, field in cases:
            r = httpx.post(srv.url + "/v1/rl/generate", json={"prompts": [bad], "sampling_params": {"max_tokens": 2}})
            assert r.status_code == 400, (bad, r.text)
            err = r.json()["error"]
            assert field in (err.get("param") or "") + err["message"], (bad, err)
        assert srv.stats()["kv_blocks_free"] == srv.stats()["kv_blocks_total"]


def test_client_takes_one_sampling_params_per_prompt(moe_path, random_prompts):
    """Per-episode seeds reach RolloutClient as a list: each prompt is sampled under its own
    parameters (the same tokens as the in-process engine with that list), the distinct ones sent
    as concurrent requests."""
    from cuttle.rl.rollout import generate_tokens

    prompts = random_prompts(4, 12, seed=4)
    each = [SamplingParams(temperature=1.0, seed=s, max_tokens=6, ignore_eos=True, logprobs=0) for s in (1, 2, 1, 3)]
    local = generate_tokens(LLM(moe_path, dtype="float32", num_kv_blocks=128), prompts, each)
    with LiveServer(moe_path, dtype="float32", num_kv_blocks=128) as srv, RolloutClient(srv.url) as client:
        remote = generate_tokens(client, prompts, each)
    assert [[s.token_ids for s in ss] for ss in remote] == [[s.token_ids for s in ss] for ss in local]
