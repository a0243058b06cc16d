"""vLLM's offline shapes on `LLM`: prompt dicts, skip_tokenizer_init / tokenizer=, gpu_memory_utilization,
enforce_eager, truncate_prompt_tokens and sampling defaults from generation_config.json, each checked
against the plain cuttle call it must equal (greedy, float32, on a tiny random Qwen3 checkpoint); and
the server's truncate_prompt_tokens and generation_config.json defaults through the `openai` client."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.engine import memory_budget
from cuttle.engine.config import EngineConfig
from cuttle.engine.model_runner import ModelRunner
from helpers import make_checkpoint

KW = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=256)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
IDS = [[5, 9, 33, 4, 71, 18], [40, 41, 42], list(range(3, 33))]


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    p = str(tmp_path_factory.mktemp("vllm_shapes"))
    make_checkpoint(p, "qwen3", seed=21)
    return p


@pytest.fixture(scope="module")
def llm(path) -> LLM:
    return LLM(path, **KW)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_prompt_dicts_mixed_with_plain_prompts(llm):
    text = "a b c = d"
    plain = llm.generate([IDS[0], text, IDS[1]], GREEDY, use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": IDS[0]}, {"prompt": text}, IDS[1]], GREEDY, use_tqdm=False)
    assert tokens(outs) == tokens(plain)
    assert outs[0].prompt_token_ids == IDS[0] and outs[1].prompt == text
    assert outs[1].prompt_token_ids == llm.get_tokenizer().encode(text)
    single = llm.generate({"prompt_token_ids": IDS[1]}, GREEDY, use_tqdm=False)  # one dict is one prompt
    assert tokens(single) == tokens(plain)[2:]


@pytest.mark.parametrize("prompt,match", [
    ({"prompt": "x", "prompt_token_ids": [5]}, r"prompts\[0\] must have exactly one of 'prompt'"),
    ({"prompt_token_ids": [5], "multi_modal_data": {}}, r"prompts\[0\] has fields cuttle does not support: \['multi_modal_data'\]"),
    ({"prompt_token_ids": [5, "6"]}, r"prompts\[0\].prompt_token_ids must be a list of token ids"),
    ({"prompt": [5, 6]}, r"prompts\[0\].prompt must be text"),
    ({}, r"exactly one of 'prompt'"),
])
def test_bad_prompt_dicts_are_refused(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], GREEDY, use_tqdm=False)


def test_skip_tokenizer_init_runs_token_ids_without_tokenizer_files(llm, path, tmp_path):
    bare = str(tmp_path / "bare")
    os.makedirs(bare)
    for f in os.listdir(path):
        if not f.startswith("tokenizer"):
            shutil.copy(os.path.join(path, f), bare)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        LLM(bare, **KW)
    raw = LLM(bare, skip_tokenizer_init=True, **KW)
    assert raw.get_tokenizer() is None
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = raw.generate([{"prompt_token_ids": p} for p in IDS], params, use_tqdm=False)
    assert tokens(outs) == tokens(llm.generate(IDS, params, use_tqdm=False))
    for o in outs:
        assert o.outputs[0].text is None and o.prompt is None
        assert all(lp.decoded_token is None for step in o.outputs[0].logprobs for lp in step.values())
    # streamed (delta) outputs carry the tokens, no text
    engine = raw.engine
    engine.add_request("s", IDS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), stream=True)
    got = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.outputs[0].text is None
            got = out.outputs[0].token_ids
    assert got == tokens(outs)[0]
    with pytest.raises(ValueError, match="text prompt needs a tokenizer.*skip_tokenizer_init"):
        raw.generate(["a b c"], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        raw.generate([IDS[0]], SamplingParams(stop=["x"]), use_tqdm=False)
    with pytest.raises(ValueError, match="chat needs the tokenizer"):
        raw.chat([{"role": "user", "content": "hi"}])


def test_tokenizer_from_another_directory(llm, path, tmp_path):
    weights, tok = str(tmp_path / "weights"), str(tmp_path / "tok")
    os.makedirs(weights)
    os.makedirs(tok)
    for f in os.listdir(path):
        shutil.copy(os.path.join(path, f), tok if f.startswith("tokenizer") else weights)
    other = LLM(weights, tokenizer=tok, **KW)
    text = "a b c = d"
    assert other.generate([text], GREEDY, use_tqdm=False)[0].outputs[0].text == llm.generate([text], GREEDY, use_tqdm=False)[0].outputs[0].text


def test_gpu_memory_utilization_sizes_the_pool(path, monkeypatch):
    """On CPU the fraction is of MemAvailable (a stand-in value here), less the weights' bytes."""
    free = 48 * 2**20
    monkeypatch.setattr(memory_budget, "free_memory_bytes", lambda device: free)
    llm = LLM(path, dtype="float32", gpu_memory_utilization=0.5, max_num_seqs=64)
    eng = llm.engine
    per_block = ModelRunner.kv_bytes_per_block(eng.model_config, 16, torch.float32)
    weights = memory_budget.checkpoint_weight_bytes(path, torch.float32)
    assert weights == sum(p.numel() for p in eng.runner.model.parameters()) * 4  # the headers read right
    wanted = 64 * (eng.model_config.max_position_embeddings // 16)
    assert eng.block_manager.num_blocks == min(wanted, (free // 2 - weights) // per_block)
    assert eng.block_manager.num_blocks < wanted  # the fraction, not the cap, decided
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.001 of the 0.05 GiB free on cpu leaves no room"):
        LLM(path, dtype="float32", gpu_memory_utilization=0.001)


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, "0.9"])
def test_gpu_memory_utilization_is_validated(bad):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a fraction in \(0, 1\]"):
        EngineConfig(model="m", gpu_memory_utilization=bad)


def test_enforce_eager_is_accepted_and_changes_nothing(llm, path):
    for eager in (True, False):
        assert tokens(LLM(path, enforce_eager=eager, **KW).generate(IDS, GREEDY, use_tqdm=False)) == tokens(llm.generate(IDS, GREEDY, use_tqdm=False))


def test_truncate_prompt_tokens_keeps_the_last_k(llm, path):
    long = IDS[2]
    out = llm.generate([long], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=10), use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-10:]
    assert out.outputs[0].token_ids == tokens(llm.generate([long[-10:]], GREEDY, use_tqdm=False))[0]
    short = LLM(path, max_model_len=20, **KW)  # -1: as many as max_model_len allows (one position left to generate)
    out = short.generate([long], SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-19:]
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1"):
            SamplingParams(truncate_prompt_tokens=bad)
    with pytest.raises(ValueError, match="truncate_prompt_tokens is not supported for prompts with documents"):
        llm.generate([{"documents": [[5, 6, 7]], "prompt": [8, 9]}], SamplingParams(truncate_prompt_tokens=2), use_tqdm=False)


GEN = {"temperature": 0.0, "top_k": 3, "top_p": 0.9, "repetition_penalty": 1.3, "max_new_tokens": 5, "do_sample": True,
       "eos_token_id": 1}


@pytest.fixture(scope="module")
def gen_path(path, tmp_path_factory) -> str:
    p = str(tmp_path_factory.mktemp("gen"))
    for f in os.listdir(path):
        shutil.copy(os.path.join(path, f), p)
    with open(os.path.join(p, "generation_config.json"), "w") as f:
        json.dump(GEN, f)
    return p


def test_generation_config_defaults_offline(gen_path, tmp_path):
    llm = LLM(gen_path, **KW)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.top_p, d.repetition_penalty, d.max_tokens) == (0.0, 3, 0.9, 1.3, 5)
    explicit = SamplingParams(temperature=0.0, top_k=3, top_p=0.9, repetition_penalty=1.3, max_tokens=5)
    outs = llm.generate(IDS, use_tqdm=False)
    assert tokens(outs) == tokens(llm.generate(IDS, explicit, use_tqdm=False))
    assert all(len(t) <= 5 for t in tokens(outs))
    penalty_free = SamplingParams(temperature=0.0, max_tokens=5)  # does the penalty matter on this model?
    assert tokens(llm.generate(IDS, penalty_free, use_tqdm=False)) != tokens(outs)
    # a request's own params win whole (vLLM's offline rule); "vllm" ignores the file
    own = llm.generate(IDS[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(own[0].outputs[0].token_ids) == 8
    assert LLM(gen_path, generation_config="vllm", **KW).get_default_sampling_params() == SamplingParams()
    # another directory's file
    other = str(tmp_path / "other")
    os.makedirs(other)
    with open(os.path.join(other, "generation_config.json"), "w") as f:
        json.dump({"temperature": 0.25}, f)
    assert LLM(gen_path, generation_config=other, **KW).get_default_sampling_params().temperature == 0.25
    with open(os.path.join(other, "generation_config.json"), "w") as f:
        json.dump({"top_p": 7}, f)
    with pytest.raises(ValueError, match=r"generation_config.json: top_p"):
        LLM(gen_path, generation_config=other, **KW)
    with pytest.raises(ValueError, match=r"generation_config must be 'auto', 'vllm' or a directory"):
        EngineConfig(model=gen_path, generation_config="hf")


def test_server_truncation_and_generation_defaults_through_openai_client(gen_path):
    import openai
    from server_fixture import LiveServer

    # the expected outputs come from an engine of their own: the server's engine is stepped by its
    # AsyncEngine thread, and a second thread generating on it races that loop (a CI run saw a
    # step built from both: a negative query length)
    llm = LLM(gen_path, **KW)
    with LiveServer(gen_path, **KW) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        long = IDS[2]
        r = client.completions.create(model="test-model", prompt=long, max_tokens=4, temperature=0,
                                      extra_body={"truncate_prompt_tokens": 10, "ignore_eos": True, "repetition_penalty": 1.0})
        want = llm.generate([long[-10:]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, top_k=3, top_p=0.9), use_tqdm=False)
        assert r.usage.prompt_tokens == 10 and r.choices[0].text == want[0].outputs[0].text
        # no sampling fields: the model's generation_config.json decides (greedy, top_k 3, penalty 1.3, 5 tokens)
        r = client.completions.create(model="test-model", prompt=IDS[0], extra_body={"ignore_eos": True})
        want = llm.generate([IDS[0]], SamplingParams(temperature=0, top_k=3, top_p=0.9, repetition_penalty=1.3, max_tokens=5, ignore_eos=True), use_tqdm=False)
        assert r.usage.completion_tokens == 5 and r.choices[0].text == want[0].outputs[0].text
        c = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "a b"}], extra_body={"ignore_eos": True})
        assert c.usage.completion_tokens == 5  # chat's default max_tokens too
        c = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "a b"}], max_completion_tokens=2)
        assert c.usage.completion_tokens <= 2  # the request's field wins
        with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
            client.completions.create(model="test-model", prompt=long, extra_body={"truncate_prompt_tokens": 0})
