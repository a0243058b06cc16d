"""update_weights in place (acceptance 2): new outputs equal a fresh engine's, nothing cached under
old weights is reused, in-flight requests are aborted or finished per the flag."""
from __future__ import annotations

import asyncio
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.async_engine import AsyncEngine
from cuttle.engine.models.loader import iter_tensors


def perturbed_checkpoint(src: str, dst: str, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """A copy of `src` with every weight nudged; returns the new HF-named tensors."""
    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(0)
    new = {n: (t + scale * torch.randn(t.shape, generator=gen)).contiguous() for n, t in iter_tensors(src)}
    for f in os.listdir(dst):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(dst, f))
    save_file(new, os.path.join(dst, "model.safetensors"))
    return new


@pytest.fixture(scope="module")
def perturbed(moe_path, tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    dst = str(tmp_path_factory.mktemp("perturbed") / "ckpt")
    return dst, perturbed_checkpoint(moe_path, dst)


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)


def run(llm: LLM, prompts: list[list[int]]):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs], outs


def test_update_matches_fresh_engine_and_never_hits_stale_cache(moe_path, perturbed, random_prompts):
    path2, tensors = perturbed
    prompts = random_prompts(3, 70, seed=4)  # 4 full blocks each: cacheable
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=256)
    old_tokens, _, _ = run(llm, prompts)
    run(llm, prompts)  # warm: prompts are now in the prefix cache under version 0
    assert llm.weight_version == 0
    assert llm.update_weights(tensors.items()) == 1
    assert llm.weight_version == 1 and llm.stats()["weight_version"] == 1
    new_tokens, new_lps, outs = run(llm, prompts)
    assert all(o.num_cached_tokens == 0 for o in outs), "a block cached under the old weights was reused"
    assert all(o.metrics["weight_version"] == 1 for o in outs)
    fresh_tokens, fresh_lps, _ = run(LLM(path2, dtype="float32", num_kv_blocks=256), prompts)
    assert new_tokens != old_tokens
    assert new_tokens == fresh_tokens
    assert max(abs(a - b) for x, y in zip(new_lps, fresh_lps) for a, b in zip(x, y)) < 1e-5
    # within the new version the cache works again
    _, again_lps, again = run(llm, prompts)
    assert all(o.num_cached_tokens == 64 for o in again)
    assert max(abs(a - b) for x, y in zip(again_lps, fresh_lps) for a, b in zip(x, y)) < 1e-5


def test_bf16_update_repacks_native_gemm_weights(moe_path, perturbed, random_prompts, monkeypatch):
    """bf16 at 6 rows per step takes the packed CPU GEMM, whose packed weight copies must not
    outlive an update: afterwards outputs equal a fresh engine's bit for bit."""
    from cuttle.attention import native
    from cuttle.attention.native import gemm

    if not native.kernels().packed_gemm:
        pytest.skip("no packed CPU GEMM here (needs the native library and AVX512-BF16)")
    packs: list[int] = []
    real = gemm._packed
    monkeypatch.setattr(gemm, "_packed", lambda w: packs.append(1) or real(w))
    path2, tensors = perturbed
    prompts = random_prompts(6, 20, seed=5)
    llm = LLM(moe_path, dtype="bfloat16", num_kv_blocks=256, enable_prefix_caching=False)
    old_tokens, _, _ = run(llm, prompts)
    assert packs, "the bf16 engine at 6 rows did not use the packed GEMM"
    llm.update_weights(tensors.items())
    new_tokens, new_lps, _ = run(llm, prompts)
    fresh_tokens, fresh_lps, _ = run(LLM(path2, dtype="bfloat16", num_kv_blocks=256, enable_prefix_caching=False), prompts)
    assert new_tokens != old_tokens
    assert new_tokens == fresh_tokens and new_lps == fresh_lps


def test_stale_cache_key_would_be_caught(moe_path, perturbed, random_prompts):
    """Guard for the test above: serving the old blocks after an update changes the logprobs, so
    a regression in cache keying cannot pass silently."""
    path2, tensors = perturbed
    prompts = random_prompts(3, 70, seed=4)
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=256)
    run(llm, prompts)
    llm.engine.runner.model.load_state_dict(LLM(path2, dtype="float32", num_kv_blocks=8).engine.runner.model.state_dict())
    _, stale_lps, outs = run(llm, prompts)  # weights swapped behind the engine's back: version still 0
    assert all(o.num_cached_tokens == 64 for o in outs)
    _, fresh_lps, _ = run(LLM(path2, dtype="float32", num_kv_blocks=256), prompts)
    assert max(abs(a - b) for x, y in zip(stale_lps, fresh_lps) for a, b in zip(x, y)) > 1e-3


def test_engine_parameter_names_and_bad_updates(moe_path):
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=64)
    qkv = llm.engine.runner.model.layers[0].attn.qkv_weight
    llm.update_weights([("layers.0.attn.qkv_weight", torch.zeros_like(qkv))])
    assert llm.weight_version == 1 and qkv.abs().sum().item() == 0.0
    with pytest.raises(ValueError, match="shape mismatch"):
        llm.update_weights([("layers.0.attn.qkv_weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="no place"):
        llm.update_weights([("model.not_a_weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="in_flight"):
        llm.update_weights([], in_flight="later")


@pytest.mark.parametrize("bad", ["foreign-name", "hf-shape", "nan"])
def test_a_refused_update_writes_nothing(moe_path, perturbed, random_prompts, bad):
    """Every name and shape is checked before any tensor is written: a whole new checkpoint plus
    one foreign name (or one HF-named tensor of the wrong shape, last) is refused and leaves the
    old weights, version and cache as they were (it used to write every tensor before the bad one:
    outputs of neither model, under the old version's cache)."""
    _, tensors = perturbed
    prompts = random_prompts(2, 40, seed=6)
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=128)
    before, before_lps, _ = run(llm, prompts)
    update = list(tensors.items())
    if bad == "foreign-name":
        update.append(("model.layers.0.self_attn.bogus.weight", torch.zeros(3)))
    elif bad == "hf-shape":
        name, t = next((n, t) for n, t in update if n.endswith("o_proj.weight"))
        update.append((name, torch.zeros(t.shape[0] + 1, t.shape[1])))
    else:  # a trainer whose loss went NaN: every later output would be NaN
        name, t = update[-1]
        update[-1] = (name, torch.full_like(t, float("nan")))
    with pytest.raises(ValueError, match="no place in this model|shape mismatch|NaN or infinite"):
        llm.update_weights(update)
    assert llm.weight_version == 0
    after, after_lps, outs = run(llm, prompts)
    assert after == before  # logprobs in the last bits only: the rerun starts from the cached prefix
    assert max(abs(a - b) for x, y in zip(after_lps, before_lps) for a, b in zip(x, y)) < 1e-5
    assert all(o.num_cached_tokens > 0 for o in outs)  # the old version's cache still serves
    assert llm.update_weights(tensors.items()) == 1  # the good update still applies


def test_tied_lm_head_update_writes_the_embedding(tmp_path):
    """On a tied checkpoint `lm_head.weight` is the embedding: an update naming it alone writes
    the embedding (it used to be dropped silently), with the embedding too they must be equal."""
    from helpers import make_checkpoint

    path = str(tmp_path / "tied")
    make_checkpoint(path, "qwen3", tie_word_embeddings=True)
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    embed = llm.engine.runner.model.embed
    w = torch.randn(embed.shape, generator=torch.Generator().manual_seed(3))
    llm.update_weights([("lm_head.weight", w)])
    assert torch.equal(embed, w)
    llm.update_weights([("model.embed_tokens.weight", w * 2), ("lm_head.weight", w * 2)])
    assert torch.equal(embed, w * 2)
    with pytest.raises(ValueError, match="ties them"):
        llm.update_weights([("model.embed_tokens.weight", w), ("lm_head.weight", w * 3)])
    assert torch.equal(embed, w * 2)  # refused before anything was written


async def _in_flight(moe_path: str, tensors: dict[str, torch.Tensor], mode: str) -> tuple[list, int]:
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=128)
    engine = AsyncEngine(llm.engine)
    engine.start()
    try:
        sp = SamplingParams(temperature=1.0, seed=1, max_tokens=64, ignore_eos=True, logprobs=0)
        stream = engine.generate("long", [5, 6, 7, 8], sp)
        first = await stream.__anext__()
        engine.pause()  # stop stepping: the request is now certainly in flight when the update runs
        assert not first.finished
        update = asyncio.ensure_future(engine.update_weights(tensors.items(), in_flight=mode))
        last = first
        async for out in stream:
            last = out
        version = await update
        engine.resume()
        after = None
        async for out in engine.generate("after", [5, 6, 7, 8], SamplingParams(max_tokens=2)):
            after = out
        return [last, after], version
    finally:
        engine.shutdown()


def test_update_aborts_in_flight_requests(moe_path, perturbed):
    (last, after), version = asyncio.run(_in_flight(moe_path, perturbed[1], "abort"))
    assert version == 1
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert len(last.outputs[0].token_ids) < 64 and last.metrics["weight_version"] == 0
    assert after.metrics["weight_version"] == 1


def test_update_lets_in_flight_requests_finish_under_old_weights(moe_path, perturbed):
    (last, after), version = asyncio.run(_in_flight(moe_path, perturbed[1], "finish"))
    assert version == 1
    assert last.outputs[0].finish_reason == "length" and len(last.outputs[0].token_ids) == 64
    assert last.metrics["weight_version"] == 0
    # it finished under the old weights: identical to an engine that never updated
    ref = LLM(moe_path, dtype="float32", num_kv_blocks=128).generate(
        [[5, 6, 7, 8]], SamplingParams(temperature=1.0, seed=1, max_tokens=64, ignore_eos=True), use_tqdm=False)[0]
    assert last.outputs[0].token_ids == ref.outputs[0].token_ids
    assert after.metrics["weight_version"] == 1


def test_engine_update_returns_what_ended(moe_path, perturbed):
    """The synchronous engine: "finish" steps in-flight requests to the end, "abort" stops them."""
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=64)
    engine = llm.engine
    sp = SamplingParams(temperature=1.0, seed=2, max_tokens=10, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], sp)
    engine.step()
    ended = engine.update_weights(perturbed[1].items(), in_flight="finish")
    assert [o.request_id for o in ended] == ["a"] and len(ended[0].outputs[0].token_ids) == 10
    assert ended[0].metrics["weight_version"] == 0 and engine.weight_version == 1
    engine.add_request("b", [5, 6, 7], sp)
    engine.step()
    ended = engine.update_weights(perturbed[1].items(), in_flight="abort")
    assert ended[0].outputs[0].finish_reason == "abort" and ended[0].metrics["weight_version"] == 1
    assert not engine.has_unfinished_requests() and engine.weight_version == 2
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
