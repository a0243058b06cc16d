"""Sleep mode (engine/sleep_mode.py; vLLM's LLM.sleep / wake_up / is_sleeping) and
reset_prefix_cache: the KV pool's memory goes back to the OS while asleep (measured as the
process's resident memory), requests are refused meanwhile, and after waking the engine gives
the same tokens as before it slept, from a cold cache; the server's routes in vLLM's shapes."""
from __future__ import annotations

import httpx
import pytest
import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.models.loader import iter_tensors
from cuttle.engine.sleep_mode import EngineAsleepError, offload_weights, restore_weights

POOL_GB = 0.25
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [5 + (i * 7) % 200 for i in range(40)]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.fixture(scope="module")
def llm(qwen3_path):
    return LLM(qwen3_path, dtype="float32", kv_cache_memory_gb=POOL_GB, enable_sleep_mode=True)


def _tokens(llm: LLM, prompt=PROMPT) -> list[int]:
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_sleep_gives_the_pool_back_and_waking_gives_the_same_tokens_cold(llm):
    engine = llm.engine
    want = _tokens(llm)
    pool_mb = sum(t.untyped_storage().nbytes() for t in engine.runner.kv.tensors) / 2**20
    assert pool_mb >= 100  # (the pool is capped at max_num_seqs full-length sequences)
    before = _rss_mb()
    llm.sleep()
    assert llm.is_sleeping() and all(t.untyped_storage().nbytes() == 0 for t in engine.runner.kv.tensors)
    assert before - _rss_mb() >= 0.8 * pool_mb, (before, _rss_mb(), pool_mb)  # back to the OS, not kept in the heap
    with pytest.raises(EngineAsleepError, match="wake_up"):
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
    with pytest.raises(EngineAsleepError):
        llm.open_session(PROMPT)
    with pytest.raises(ValueError, match="already asleep"):
        llm.sleep()
    # vLLM's RL order: wake the weights, update them, then the KV cache (on CPU the weights
    # never left, so the first wake has nothing to do and the engine still sleeps)
    llm.wake_up(["weights"])
    assert llm.is_sleeping()
    version = llm.update_weights([(n, p.detach().clone()) for n, p in engine.runner.model.named_parameters()])
    llm.wake_up(["kv_cache"])
    assert not llm.is_sleeping() and llm.weight_version == version
    computed = engine.stats()["prefill_tokens_computed"]
    assert _tokens(llm) == want
    assert engine.stats()["prefill_tokens_computed"] - computed == len(PROMPT)  # nothing was served from before the sleep
    llm.wake_up()  # awake already: nothing to do


def test_reset_prefix_cache_starts_the_next_request_cold(llm):
    engine = llm.engine
    prompt = [9 + (i * 5) % 180 for i in range(48)]
    want = _tokens(llm, prompt)
    hit = engine.stats()["cached_tokens"]
    assert _tokens(llm, prompt) == want and engine.stats()["cached_tokens"] > hit
    assert llm.reset_prefix_cache() is True
    hit, computed = engine.stats()["cached_tokens"], engine.stats()["prefill_tokens_computed"]
    assert _tokens(llm, prompt) == want
    assert engine.stats()["cached_tokens"] == hit and engine.stats()["prefill_tokens_computed"] - computed == len(prompt)


def test_sleep_refusals(llm, qwen3_path):
    for bad in (3, 0, True):
        with pytest.raises(ValueError, match="level must be 1 .* or 2"):
            llm.sleep(bad)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(["optimizer"])
    with pytest.raises(ValueError, match="string"):
        llm.wake_up("weights")
    engine = llm.engine
    engine.add_request("busy", PROMPT, GREEDY)
    with pytest.raises(ValueError, match="1 request"):
        llm.sleep()
    engine.abort_request("busy")
    sid = llm.open_session(PROMPT)
    with pytest.raises(ValueError, match="session"):
        llm.sleep()
    llm.close_session(sid)
    assert not llm.is_sleeping()
    off = LLM(qwen3_path, dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        off.sleep()


def test_weights_offload_round_trip_is_bit_exact():
    """The accelerator path (weights copied to host memory, their own memory freed, copied back)
    on CPU tensors: every parameter and buffer back bit for bit, a tied weight still tied."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 16)
    head = torch.nn.Linear(16, 50, bias=False)
    head.weight = emb.weight  # tied: one tensor under two names
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "norm": torch.nn.LayerNorm(16)})
    model.register_buffer("table", torch.randn(7, 3))
    want = {n: t.clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    saved = offload_weights(model)
    assert len(saved) == len(want)  # the tied weight once
    assert all(st.nbytes() == 0 for st, _ in saved)
    restore_weights(saved)
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.equal(t, want[n]), n
    assert model["head"].weight is model["emb"].weight
    # two views of one storage (slices of a fused buffer the module does not hold whole): each
    # gets its own bytes back
    fused, qkv = torch.nn.Module(), torch.randn(6, 4)
    fused.register_buffer("q", qkv[:2])
    fused.register_buffer("kv", qkv[2:])
    q, kv = fused.q.clone(), fused.kv.clone()
    restore_weights(offload_weights(fused))
    assert torch.equal(fused.q, q) and torch.equal(fused.kv, kv)


@pytest.fixture(scope="module")
def live(qwen3_path):
    from server_fixture import LiveServer

    with LiveServer(qwen3_path, api_key="k", dtype="float32", num_kv_blocks=64, max_model_len=128, enable_sleep_mode=True) as srv:
        yield srv


AUTH = {"Authorization": "Bearer k"}


def _completer(live):
    """A greedy completion of PROMPT on the live server (token ids returned)."""
    body = {"model": "test-model", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    return lambda: httpx.post(live.url + "/v1/completions", json=body, headers=AUTH, timeout=60)


def test_server_sleep_routes(live):
    auth = AUTH
    complete = _completer(live)
    want = complete().json()["choices"][0]["token_ids"]
    assert httpx.post(live.url + "/sleep", timeout=30).status_code == 401  # behind the API key
    assert httpx.get(live.url + "/is_sleeping", headers=auth, timeout=30).json() == {"is_sleeping": False}
    for bad, param in [("/sleep?level=3", "level"), ("/sleep?level=x", "level"), ("/wake_up?tags=optimizer", "tags")]:
        r = httpx.post(live.url + bad, headers=auth, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    assert httpx.post(live.url + "/sleep?level=1", headers=auth, timeout=30).status_code == 200
    assert httpx.get(live.url + "/is_sleeping", headers=auth, timeout=30).json() == {"is_sleeping": True}
    asleep = complete()
    assert asleep.status_code == 503 and asleep.json()["error"]["type"] == "server_asleep", asleep.text
    assert httpx.get(live.url + "/health", timeout=30).status_code == 200  # up, just asleep
    assert httpx.post(live.url + "/wake_up?tags=weights&tags=kv_cache", headers=auth, timeout=30).status_code == 200
    assert httpx.get(live.url + "/is_sleeping", headers=auth, timeout=30).json() == {"is_sleeping": False}
    assert complete().json()["choices"][0]["token_ids"] == want
    hit = live.stats()["cached_tokens"]
    assert httpx.post(live.url + "/reset_prefix_cache", headers=auth, timeout=30).status_code == 200
    assert complete().json()["choices"][0]["token_ids"] == want and live.stats()["cached_tokens"] == hit
    # the RL client's side of it
    from cuttle.rl.client import RolloutClient

    with RolloutClient(live.url, api_key="k") as client:
        client.sleep()
        assert client.is_sleeping() and live.llm.is_sleeping()
        client.wake_up(["kv_cache"])
        assert not client.is_sleeping()
        with pytest.raises(RuntimeError, match="400"):
            client.wake_up(["optimizer"])
    assert complete().json()["choices"][0]["token_ids"] == want


def test_server_level_2_through_the_rl_client(live, qwen3_path):
    """A colocated trainer's cycle against a server, level 2: sleep, wake the weights, send them
    (one safetensors blob per call, here in two), wake the KV cache; a 503 while any is missing."""
    from cuttle.rl.client import RolloutClient

    complete = _completer(live)
    want = complete().json()["choices"][0]["token_ids"]
    sent = list(iter_tensors(qwen3_path))
    with RolloutClient(live.url, api_key="k") as client:
        client.sleep(level=2)
        assert client.is_sleeping()
        client.wake_up(["weights"])
        client.update_weights(sent[:3])
        client.wake_up(["kv_cache"])
        partial = complete()
        assert partial.status_code == 503 and "not all loaded again" in partial.json()["error"]["message"], partial.text
        client.update_weights(sent[3:])
    assert complete().json()["choices"][0]["token_ids"] == want


def test_server_without_sleep_mode_refuses_to_sleep(qwen3_path):
    from server_fixture import LiveServer

    with LiveServer(qwen3_path, dtype="float32", num_kv_blocks=16, max_model_len=64) as srv:
        r = httpx.post(srv.url + "/sleep", timeout=30)
        assert r.status_code == 400 and "--enable-sleep-mode" in r.json()["error"]["message"]
        assert httpx.get(srv.url + "/is_sleeping", timeout=30).json() == {"is_sleeping": False}


def test_sleep_with_a_host_tier(qwen3_path):
    """With the KV host tier under the pool: its copies are waited for before the pool goes, and
    after waking the engine serves the same tokens, nothing hit from before the sleep."""
    llm = LLM(qwen3_path, dtype="float32", num_kv_blocks=24, num_host_kv_blocks=64, enable_sleep_mode=True)
    prompts = [[3 + (i * k) % 190 for i in range(60)] for k in (3, 5, 7)]  # more than the pool keeps cached
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.sleep()
    llm.wake_up()
    computed = llm.engine.stats()["prefill_tokens_computed"]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert llm.engine.stats()["prefill_tokens_computed"] - computed == sum(map(len, prompts))


def _held_bytes(engine) -> int:
    """Bytes of memory under the model's parameters and buffers (and packed experts)."""
    model = engine.runner.model
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total + sum(layer.expert_weight_bytes() for layer in model.modules() if getattr(layer, "packed", None) is not None)


def _scored(llm: LLM, prompt=PROMPT) -> tuple[list[int], list[float]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    c = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]


LEVEL_2 = [("qwen3", None, "float32"), ("llama", None, "float32"), ("qwen3_moe", None, "bfloat16"),
           ("qwen3_moe", "mxfp8", "bfloat16"), ("qwen3", "mxfp8", "bfloat16")]


@pytest.mark.parametrize("arch,quantization,dtype", LEVEL_2, ids=[f"{a}-{q}-{d}" for a, q, d in LEVEL_2])
def test_level_2_discards_the_weights_and_serves_again_only_once_all_are_sent(tmp_path, arch, quantization, dtype):
    """vLLM's level 2 (verl's colocated default): the weights are given back too; after waking,
    update_weights in buckets (HF names, as a trainer sends them) must cover every weight before
    the engine serves, a bucket sent twice counting once; then the engine gives the tokens and
    logprobs it gave before, bit for bit (packed experts, MXFP8 linears and a tied MXFP8 lm_head
    rebuilt from what was sent)."""
    from helpers import make_checkpoint

    make_checkpoint(str(tmp_path), arch, tie_word_embeddings=(quantization == "mxfp8" and arch == "qwen3"))
    llm = LLM(str(tmp_path), dtype=dtype, quantization=quantization, num_kv_blocks=32, enable_sleep_mode=True)
    engine = llm.engine
    want = _scored(llm)
    held = _held_bytes(engine)
    llm.sleep(2)
    assert llm.is_sleeping() and _held_bytes(engine) < held / 100  # one element a tensor is left
    with pytest.raises(EngineAsleepError, match="wake_up"):
        llm.update_weights([])
    llm.wake_up(["weights"])
    sent = dict(iter_tensors(str(tmp_path)))  # the trainer's tensors, by HF name
    q0, kv0 = "model.layers.0.self_attn.q_proj.weight", ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight")
    rest = [(n, t) for n, t in sent.items() if n not in kv0]
    half = len(rest) // 2
    llm.update_weights(rest[:half])
    llm.update_weights(rest[:half])  # sent twice: still half
    # q sent twice is as many elements as q|k|v (4 query heads, 2 KV heads): still not k or v
    llm.update_weights([*rest[half:], (q0, sent[q0])])
    llm.wake_up(["kv_cache"])
    assert not llm.is_sleeping()  # (as vLLM's: awake, but not serving until every weight is back)
    with pytest.raises(EngineAsleepError, match=r"not all loaded again.*not written 1 of \d+ tensors.*layers\.0\.attn\."):
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
    with pytest.raises(EngineAsleepError, match="not all loaded"):
        llm.open_session(PROMPT)
    llm.update_weights([(n, sent[n]) for n in kv0])
    assert _scored(llm) == want


def test_level_2_takes_the_engine_names_and_gives_the_memory_back(tmp_path):
    """A trainer on cuttle's own model code sends the engine's parameter names; a tied embedding
    sent under either of its names covers both. The weights' memory leaves the process while
    asleep (resident memory measured) and is held again after waking."""
    from helpers import make_checkpoint

    make_checkpoint(str(tmp_path), "qwen3", vocab_size=32768, hidden_size=256, tie_word_embeddings=True)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=16, enable_sleep_mode=True)
    engine = llm.engine
    want = _scored(llm)
    own = [(n, p.detach().clone()) for n, p in engine.runner.model.named_parameters(remove_duplicate=False)]
    assert {"embed", "lm_head"} <= {n for n, _ in own}
    held_mb = _held_bytes(engine) / 2**20
    assert held_mb >= 30
    before = _rss_mb()
    llm.sleep(2)
    assert before - _rss_mb() >= 0.8 * held_mb, (before, _rss_mb(), held_mb)
    llm.wake_up()
    without_embed = [(n, t) for n, t in own if n not in ("embed", "lm_head")]
    llm.update_weights(without_embed)
    with pytest.raises(EngineAsleepError, match="embed"):
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
    llm.update_weights([(n, t) for n, t in own if n == "lm_head"])  # the tied name: the embedding
    assert _scored(llm) == want
    assert _held_bytes(engine) / 2**20 >= 0.99 * held_mb


def test_reload_weights_from_a_checkpoint(tmp_path):
    """vLLM's collective_rpc("reload_weights"): after level 2 the engine reads its own checkpoint
    again and gives what it gave before; another checkpoint of the same model makes it equal an
    engine loaded from that one; a checkpoint that lacks a weight is refused, naming it, before
    anything is written."""
    import shutil

    from safetensors.torch import save_file

    from helpers import make_checkpoint

    own, other, short = (str(tmp_path / d) for d in ("own", "other", "short"))
    make_checkpoint(own, "qwen3_moe")
    make_checkpoint(other, "qwen3_moe", seed=1)
    llm = LLM(own, dtype="bfloat16", num_kv_blocks=32, enable_sleep_mode=True)
    want = _scored(llm)
    llm.sleep(2)
    llm.wake_up()
    with pytest.raises(EngineAsleepError, match="not all loaded"):
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
    version = llm.reload_weights()
    assert version == llm.weight_version and _scored(llm) == want
    llm.reload_weights(other)
    theirs = _scored(LLM(other, dtype="bfloat16", num_kv_blocks=32))
    assert _scored(llm) == theirs != want
    shutil.copytree(own, short)
    tensors = dict(iter_tensors(own))
    del tensors["model.layers.1.mlp.gate.weight"]
    save_file({n: t.contiguous() for n, t in tensors.items()}, f"{short}/model.safetensors")
    with pytest.raises(ValueError, match=r"does not provide.*layers\.1\.mlp\.gate_weight"):
        llm.reload_weights(short)
    assert _scored(llm) == theirs  # nothing was written
    llm.sleep(2)
    with pytest.raises(EngineAsleepError, match="wake_up"):
        llm.reload_weights()


def test_vllm_sleep_mode_recipe_runs_verbatim(tmp_path):
    """vLLM's documented RL recipe for level 2, as written for vLLM: sleep(level=2),
    wake_up(tags=["weights"]), collective_rpc("reload_weights"), wake_up(tags=["kv_cache"]); then
    the same outputs. Methods cuttle has no worker for, and a timeout it could not keep, are refused."""
    from helpers import make_checkpoint

    make_checkpoint(str(tmp_path), "qwen3")
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=32, enable_sleep_mode=True)
    want = _scored(llm)
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    assert llm.collective_rpc("reload_weights") == [None]
    llm.wake_up(tags=["kv_cache"])
    assert _scored(llm) == want and llm.weight_version == 1
    with pytest.raises(ValueError, match="'init_device' is not supported.*reload_weights"):
        llm.collective_rpc("init_device")
    with pytest.raises(ValueError, match="timeout"):
        llm.collective_rpc("reload_weights", timeout=5)
