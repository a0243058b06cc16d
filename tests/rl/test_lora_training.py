"""LoRA training in the reference trainer (rl/lora.py): the adapter alone trains, the trainer's
logprobs equal the engine's under the pushed adapter (fp32, 1e-5), the pushed adapter is PEFT's
(transformers + peft score the engine's outputs), and what cannot be trained is refused."""
from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from cuttle.engine import LLM, LoRARequest, SamplingParams
from cuttle.rl import TrainBatch, compute_advantages, mismatch, sample_groups
from cuttle.rl.engine_sampler import EngineSampler
from cuttle.rl.trainer import Trainer, TrainerConfig
from helpers import assert_scored_by_transformers

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
SP = SamplingParams(temperature=1.0, seed=5, max_tokens=16)


def _rewarded(groups):
    for g in groups:
        for i, s in enumerate(g.samples):
            s.reward = float(i % 2 == 0)
    return groups


def test_lora_step_push_and_exact_logprobs(moe_path, random_prompts):
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=256, enable_lora=True)
    sampler = EngineSampler(llm)
    try:
        prompts = random_prompts(4, 24, seed=21)
        groups = _rewarded(sample_groups(sampler, prompts, 4, SP))
        trainer = Trainer(moe_path, TrainerConfig(lr=5e-2, grad_clip=None, lora=LORA, lora_name="pi"))
        base = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        batch = TrainBatch.from_groups(groups, compute_advantages(groups, True))
        # untrained (B = 0): the base model's logprobs
        packed = batch.packed()
        assert mismatch(trainer.score(batch), packed.rollout_logprobs[packed.loss_mask > 0]).max_abs <= 1e-5
        stats = trainer.step(batch)
        assert stats["mismatch_max_abs"] <= 1e-5
        assert all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters())  # the base is frozen
        assert any(float(b.detach().abs().max()) > 0 for b in trainer.lora.b.values())
        assert trainer.push_weights(sampler) == 1 and sampler.lora_name == "pi"
        again = sample_groups(sampler, prompts, 4, SP)
        assert again[0].samples[0].weight_version == 1
        b2 = TrainBatch.from_groups(again, [[0.0] * 4 for _ in again])
        p2 = b2.packed()
        rollout = p2.rollout_logprobs[p2.loss_mask > 0]
        assert mismatch(trainer.score(b2), rollout).max_abs <= 1e-5
        # and the engine really sampled under the adapter: the base model scores them otherwise
        plain = Trainer(moe_path, TrainerConfig())
        assert mismatch(plain.score(b2), rollout).max_abs > 1e-3
    finally:
        sampler.close()


def test_pushed_adapter_is_peft_s(moe_path, tmp_path):
    """The trainer's export loads into peft; transformers + peft score the engine's greedy
    outputs under the pushed adapter."""
    peft = pytest.importorskip("peft", reason="peft is the LoRA oracle (the test extra installs it)")
    import transformers

    trainer = Trainer(moe_path, TrainerConfig(lora={**LORA, "use_rslora": True}, lora_name="pi"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for b in trainer.lora.b.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=128, enable_lora=True)
    with pytest.raises(ValueError, match="not to a LLM"):  # its rollouts would go on sampling the base
        trainer.push_weights(llm)
    assert llm.update_lora("pi", trainer.lora.peft_state().items(), trainer.lora.config) == 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=4, lora_alpha=8, use_rslora=True, lora_dropout=0.0,
                                                                 target_modules=LORA["target_modules"]))
    state = trainer.lora.peft_state()
    result = peft.set_peft_model_state_dict(pm, state)
    assert not [k for k in result.unexpected_keys if "lora" in k]
    pm.eval()
    prompt = [5, 9, 33, 71, 100, 8, 14]
    res = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0),
                       lora_request=LoRARequest("pi"), use_tqdm=False)[0]
    out = res.outputs[0]
    assert_scored_by_transformers(pm, prompt, res, 1e-4, prompt_logprobs=False)
    # and saved by peft, the adapter loads into the engine from its directory alike
    pm.save_pretrained(str(tmp_path / "ad"))
    assert sorted(load_file(str(tmp_path / "ad" / "adapter_model.safetensors"))) == sorted(state)
    again = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                         lora_request=LoRARequest("saved", 1, str(tmp_path / "ad")), use_tqdm=False)[0].outputs[0]
    assert again.token_ids == out.token_ids


def test_lora_config_is_checked(moe_path):
    with pytest.raises(ValueError, match="routed mixture of experts"):
        Trainer(moe_path, TrainerConfig(lora={"r": 4, "target_modules": ["q_proj", "gate_proj"]}))
    with pytest.raises(ValueError, match="unknown fields"):
        Trainer(moe_path, TrainerConfig(lora={"r": 4, "dropout": 0.1}))
    with pytest.raises(ValueError, match="r must be an integer"):
        Trainer(moe_path, TrainerConfig(lora={"r": 0}))
    with pytest.raises(ValueError, match="target_modules"):
        Trainer(moe_path, TrainerConfig(lora={"r": 4, "target_modules": ["lm_head"]}))
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=32)
    trainer = Trainer(moe_path, TrainerConfig(lora=LORA))
    sampler = EngineSampler(llm)
    try:
        with pytest.raises(ValueError, match="enable_lora"):
            trainer.push_weights(sampler)
        assert sampler.lora_name is None  # nothing changed
    finally:
        sampler.close()


def test_lora_weight_sync_over_http_equals_in_process(moe_path, random_prompts):
    """`RolloutClient.update_lora` (POST /v1/rl/update_lora) against a live server: the rollouts
    drawn after it are the in-process engine's under the same adapter, and the trainer scores them
    within 1e-5; bad requests are 400s naming what is wrong."""
    import httpx

    from cuttle.rl.client import RolloutClient
    from server_fixture import LiveServer

    trainer = Trainer(moe_path, TrainerConfig(lora=LORA, lora_name="pi"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for b in trainer.lora.b.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    prompts = random_prompts(2, 16, seed=23)
    local = LLM(moe_path, dtype="float32", num_kv_blocks=128, enable_lora=True)
    local_sampler = EngineSampler(local)
    try:
        trainer.push_weights(local_sampler)
        want = sample_groups(local_sampler, prompts, 3, SP)
    finally:
        local_sampler.close()
    with LiveServer(moe_path, dtype="float32", num_kv_blocks=128, enable_lora=True) as srv, RolloutClient(srv.url) as client:
        assert trainer.push_weights(client) == 1 and client.lora_name == "pi"
        got = sample_groups(client, prompts, 3, SP)
        assert [[s.token_ids for s in g.samples] for g in got] == [[s.token_ids for s in g.samples] for g in want]
        batch = TrainBatch.from_groups(got, [[0.0] * 3 for _ in got])
        p = batch.packed()
        assert mismatch(trainer.score(batch), p.rollout_logprobs[p.loss_mask > 0]).max_abs <= 1e-5
        bad = httpx.post(srv.url + "/v1/rl/update_lora", params={"lora_name": "x"}, content=b"not safetensors")
        assert bad.status_code == 400 and "safetensors" in bad.json()["error"]["message"]
        unknown = httpx.post(srv.url + "/v1/rl/generate", json={"prompts": [[5, 6]], "lora_name": "nope"})
        assert unknown.status_code == 400 and "no LoRA adapter named 'nope'" in unknown.json()["error"]["message"]
