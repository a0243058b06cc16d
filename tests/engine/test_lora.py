"""LoRA adapters (engine/lora.py) against the peer: transformers + peft scoring the engine's
outputs, per adapter, with several adapters and the base model mixed in one batch (fp32); the
prefix cache keyed by adapter; in-memory updates; eviction under a running request; documents,
speculative decoding and kernel graphs beside adapters; and every unsupported adapter refused."""
from __future__ import annotations

import copy
import json
import os
import random

import pytest
import torch
from safetensors.torch import save_file

from cuttle.attention.native import kernels
from cuttle.engine import LLM, BeamSearchParams, LoRARequest, SamplingParams
from cuttle.engine.lora import LoRABatch
from helpers import assert_scored_by_transformers, make_checkpoint

peft = pytest.importorskip("peft", reason="peft is the LoRA oracle (the test extra installs it)")

TOL = 1e-4
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _adapter(base, path: str, seed: int, targets: list[str], r: int, alpha: float, rslora: bool = False):
    """A random PEFT adapter on a copy of `base`, saved to `path`; returns the peft model."""
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, use_rslora=rslora)
    pm = peft.get_peft_model(copy.deepcopy(base), cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    pm.save_pretrained(path)
    return pm.eval()


def _score(model, prompt: list[int], out) -> None:
    """The engine's greedy tokens are the oracle's argmax, and their logprobs within TOL."""
    assert_scored_by_transformers(model, prompt, out, TOL, prompt_logprobs=False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base_dir = str(root / "base")
    base = make_checkpoint(base_dir, "qwen3", seed=3).eval()
    a = _adapter(base, str(root / "a"), 1, ALL, r=8, alpha=16)
    b = _adapter(base, str(root / "b"), 2, ["q_proj", "v_proj"], r=4, alpha=8, rslora=True)
    return {"root": root, "base_dir": base_dir, "base": base, "a": a, "b": b, "a_dir": str(root / "a"), "b_dir": str(root / "b")}


def _llm(path: str, **kw) -> LLM:
    kw = {"dtype": "float32", "attention_backend": "torch", "num_kv_blocks": 96, "enable_lora": True, **kw}
    return LLM(path, **kw)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def test_adapters_and_base_mixed_in_one_batch_match_peft(setup):
    """Prompts under adapter a, the base, adapter b and a again, chunked so prefill and decode
    rows of every kind share steps (a's rows are two runs: the gathered path)."""
    llm = _llm(setup["base_dir"], max_num_batched_tokens=32)
    ra, rb = LoRARequest("a", 1, setup["a_dir"]), LoRARequest("b", 2, setup["b_dir"])
    prompts = _prompts(8, seed=1)
    loras = [ra, None, rb, ra, None, rb, ra, ra]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, sp, lora_request=loras, use_tqdm=False)
    assert [o.lora_request for o in outs] == loras  # vLLM's RequestOutput field
    oracle = {"a": setup["a"], "b": setup["b"]}
    for p, lr, o in zip(prompts, loras, outs):
        if lr is None:
            with setup["a"].disable_adapter():
                _score(setup["a"], p, o)
        else:
            _score(oracle[lr.lora_name], p, o)
    # the adapters change the continuations (else the check above could not fail)
    assert outs[0].outputs[0].token_ids != llm.generate([prompts[0]], sp, use_tqdm=False)[0].outputs[0].token_ids


def test_lora_batch_groups_rows_by_adapter():
    x, y = object(), object()
    b = LoRABatch.build([(x, 3), (None, 1), (y, 2), (x, 1), (x, 2)])
    assert [(g[0], g[1]) for g in b.groups if isinstance(g[1], slice)] == [(y, slice(4, 6))]
    (ax, rows), = [g for g in b.groups if g[0] is x]
    assert rows.tolist() == [0, 1, 2, 6, 7, 8]
    assert LoRABatch.build([(None, 4)]) is None
    assert LoRABatch.build([(x, 2), (x, 3)]).groups == [(x, None)]  # every row: no indexing


def test_moe_base_with_an_attention_adapter_matches_peft(tmp_path):
    base = make_checkpoint(str(tmp_path / "m"), "qwen3_moe", seed=5).eval()
    pm = _adapter(base, str(tmp_path / "ad"), 7, ["q_proj", "k_proj", "v_proj", "o_proj"], r=4, alpha=4)
    llm = _llm(str(tmp_path / "m"))
    prompts = _prompts(3, seed=2)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0),
                        lora_request=LoRARequest("ad", 1, str(tmp_path / "ad")), use_tqdm=False)
    for p, o in zip(prompts, outs):
        _score(pm, p, o)


def test_prefix_cache_is_keyed_by_adapter(setup):
    llm = _llm(setup["base_dir"])
    prompt = _prompts(1, seed=3)[0] * 3  # several full blocks
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    base = llm.generate([prompt], sp, use_tqdm=False)[0]
    ra = LoRARequest("a", 1, setup["a_dir"])
    first = llm.generate([prompt], sp, lora_request=ra, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0  # the base's KV is not the adapter's
    again = llm.generate([prompt], sp, lora_request=ra, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    rb = LoRARequest("b", 2, setup["b_dir"])
    assert llm.generate([prompt], sp, lora_request=rb, use_tqdm=False)[0].num_cached_tokens == 0
    _score(setup["a"], prompt, again)
    assert base.outputs[0].token_ids != first.outputs[0].token_ids


def test_update_lora_in_memory_replaces_the_adapter_and_its_cache(setup):
    """LoRA training's weight sync: tensors by PEFT names and the config dict."""
    llm = _llm(setup["base_dir"])
    prompt = _prompts(1, seed=4)[0] * 3
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    ra = LoRARequest("a", 1, setup["a_dir"])
    llm.generate([prompt], sp, lora_request=ra, use_tqdm=False)
    with open(os.path.join(setup["b_dir"], "adapter_config.json")) as f:
        config = json.load(f)
    state = peft.get_peft_model_state_dict(setup["b"])
    llm.update_lora("a", state.items(), config)
    out = llm.generate([prompt], sp, lora_request=LoRARequest("a"), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # nothing computed under the old weights reused
    _score(setup["b"], prompt, out)


def test_evicted_adapter_keeps_serving_its_running_request(setup):
    """max_loras=1: loading b drops a from the registry while a request runs under a; that
    request finishes under a, and a later request under a reloads it."""
    llm = _llm(setup["base_dir"], max_loras=1)
    engine = llm.engine
    prompt = _prompts(1, seed=5)[0]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    engine.add_request("r-a", prompt, sp, lora_request=LoRARequest("a", 1, setup["a_dir"]))
    engine.step()
    engine.add_request("r-b", prompt, sp, lora_request=LoRARequest("b", 2, setup["b_dir"]))
    assert list(engine.loras.loaded) == ["b"]
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    _score(setup["a"], prompt, done["r-a"])
    _score(setup["b"], prompt, done["r-b"])
    again = llm.generate([prompt], sp, lora_request=LoRARequest("a"), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == done["r-a"].outputs[0].token_ids


def test_sessions_run_under_their_adapter(setup):
    """An engine session opened under an adapter: its turns and its forks' run under it (scored by
    peft), its pinned KV is reused from turn to turn, and when the name resolves to other weights
    (unloaded, then loaded from another directory) the next turn recomputes the stream."""
    llm = _llm(setup["base_dir"])
    engine = llm.engine
    llm.load_lora_adapter("a", setup["a_dir"])
    prompt = _prompts(1, seed=11)[0] * 2
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)

    def turn(sids: list[str], model) -> None:
        before = engine.session_token_ids(sids[0])
        for out in llm.generate_session(sids, sp):
            _score(model, before, out)

    sid = llm.open_session(prompt, LoRARequest("a"))
    turn([sid], setup["a"])
    llm.append_to_session(sid, [7, 8, 9])
    reused = engine.sessions.counters["session_tokens_reused"]
    turn([sid], setup["a"])
    assert engine.sessions.counters["session_tokens_reused"] > reused  # the first turn's KV was pinned and reused
    forks = llm.fork_session(sid, 2)
    turn(forks, setup["a"])  # siblings: one request with n = 2, under the parent's adapter
    llm.unload_lora_adapter("a")
    llm.load_lora_adapter("a", setup["b_dir"])
    reused = engine.sessions.counters["session_tokens_reused"]
    turn([sid], setup["b"])
    assert engine.sessions.counters["session_tokens_reused"] == reused  # pins under the old weights of "a": not reused
    for s in [sid, *forks]:
        llm.close_session(s)
    with pytest.raises(ValueError, match="no LoRA adapter named 'c'"):
        llm.open_session(prompt, LoRARequest("c"))
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(setup["base_dir"], dtype="float32", num_kv_blocks=32).open_session(prompt, LoRARequest("a"))


def test_beam_search_under_an_adapter_equals_peft_beam_search(setup):
    """vLLM's `LLM.beam_search(..., lora_request=)`: every beam (an engine session) runs under
    the adapter; the beams equal transformers' beam search on the peft model."""
    llm = _llm(setup["base_dir"], max_num_seqs=32)
    prompt = _prompts(1, seed=12)[0]
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    [out] = llm.beam_search([prompt], params, lora_request=LoRARequest("a", 1, setup["a_dir"]))
    with torch.no_grad():
        ref = setup["a"].get_base_model().generate(torch.tensor([prompt]), num_beams=2, num_return_sequences=2, do_sample=False,
                                                   max_new_tokens=4, eos_token_id=None, pad_token_id=0, length_penalty=1.0,
                                                   early_stopping=False)
    assert [b.tokens for b in out.sequences] == ref.tolist()
    [base] = llm.beam_search([prompt], params)
    assert [b.tokens for b in base.sequences] != ref.tolist()


def test_load_and_unload_by_name(setup):
    llm = _llm(setup["base_dir"])
    llm.load_lora_adapter("a", setup["a_dir"])
    assert llm.list_loras() == ["a"]
    prompt = _prompts(1, seed=6)[0]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)
    _score(setup["a"], prompt, llm.generate([prompt], sp, lora_request=LoRARequest("a"), use_tqdm=False)[0])
    llm.unload_lora_adapter("a")
    with pytest.raises(ValueError, match="no LoRA adapter named 'a'"):
        llm.generate([prompt], sp, lora_request=LoRARequest("a"), use_tqdm=False)
    with pytest.raises(ValueError, match="no LoRA adapter named 'a'"):
        llm.unload_lora_adapter("a")


def test_documents_and_spec_decode_under_an_adapter(setup):
    """A squid prompt's documents are computed under the request's adapter (and cached for it
    alone); n-gram drafts under an adapter keep the outputs of plain decoding."""
    ra = LoRARequest("a", 1, setup["a_dir"])
    rng = random.Random(9)
    docs = [[rng.randrange(3, 256) for _ in range(20)] for _ in range(2)]
    q = [rng.randrange(3, 256) for _ in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompt = {"documents": docs, "prompt": q}
    llm = _llm(setup["base_dir"])
    base = llm.generate([prompt], sp, use_tqdm=False)[0]
    warm = llm.generate([prompt], sp, lora_request=ra, use_tqdm=False)[0]
    assert warm.num_cached_tokens == 0  # the base's documents are not the adapter's
    hit = llm.generate([prompt], sp, lora_request=ra, use_tqdm=False)[0]
    assert hit.num_cached_tokens > 0
    fresh = _llm(setup["base_dir"]).generate([prompt], sp, lora_request=ra, use_tqdm=False)[0]
    assert warm.outputs[0].token_ids == hit.outputs[0].token_ids == fresh.outputs[0].token_ids != base.outputs[0].token_ids

    rep = [5, 6, 7, 8] * 6  # repetitive: prompt lookup finds drafts
    plain = _llm(setup["base_dir"]).generate([rep], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0),
                                             lora_request=ra, use_tqdm=False)[0]
    spec_llm = _llm(setup["base_dir"], speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                           "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    spec = spec_llm.generate([rep], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0),
                             lora_request=ra, use_tqdm=False)[0]
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
    assert spec_llm.stats()["spec_draft_tokens"] > 0
    for i, t in enumerate(plain.outputs[0].token_ids):
        assert abs(spec.outputs[0].logprobs[i][t].logprob - plain.outputs[0].logprobs[i][t].logprob) <= 1e-5


def test_adapter_decode_steps_replay_their_own_kernel_graphs(setup):
    """A decode step whose rows all run under one adapter replays a kernel graph of its own (the
    delta is a native kernel); its outputs equal the eager engine's bit for bit and are scored by
    peft. A step mixing adapters (and the base model), in runs or interleaved, replays graphs keyed
    by its layout of rows, equal to the eager engine's; base steps keep their graphs."""
    if kernels().lib is None:
        pytest.skip("no kernel graphs here: the native CPU kernel library is not built")
    llm = _llm(setup["base_dir"])
    prompts = _prompts(2, seed=7)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    base = llm.generate(prompts, sp, use_tqdm=False)
    replayed = llm.stats()["graph_steps"]
    assert replayed > 0
    ra, rb = LoRARequest("a", 1, setup["a_dir"]), LoRARequest("b", 2, setup["b_dir"])
    outs = llm.generate(prompts, sp, lora_request=ra, use_tqdm=False)
    assert llm.stats()["graph_steps"] > replayed  # the adapter's decode steps replayed its graphs
    for p, o in zip(prompts, outs):
        _score(setup["a"], p, o)
    eager = _llm(setup["base_dir"], enforce_eager=True).generate(prompts, sp, lora_request=ra, use_tqdm=False)
    for o, e in zip(outs, eager):
        assert o.outputs[0].token_ids == e.outputs[0].token_ids
        assert [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] == \
            [d[t].logprob for d, t in zip(e.outputs[0].logprobs, e.outputs[0].token_ids)]
    replayed = llm.stats()["graph_steps"]
    mixed = llm.generate(prompts, sp, lora_request=[ra, rb], use_tqdm=False)
    assert llm.stats()["graph_steps"] > replayed  # two adapters in a step: a graph of that layout
    _score(setup["a"], prompts[0], mixed[0])
    _score(setup["b"], prompts[1], mixed[1])
    assert [o.outputs[0].token_ids for o in outs] != [o.outputs[0].token_ids for o in base]
    # adapter a's rows interleaved with b's and the base model's (an index of rows, not a run)
    four = _prompts(4, seed=9)
    layout = [ra, rb, None, ra]
    replayed = llm.stats()["graph_steps"]
    got = llm.generate(four, sp, lora_request=layout, use_tqdm=False)
    assert llm.stats()["graph_steps"] > replayed
    want = _llm(setup["base_dir"], enforce_eager=True).generate(four, sp, lora_request=layout, use_tqdm=False)
    for o, e in zip(got, want):
        assert o.outputs[0].token_ids == e.outputs[0].token_ids
        assert [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] == \
            [d[t].logprob for d, t in zip(e.outputs[0].logprobs, e.outputs[0].token_ids)]
    _score(setup["a"], four[3], got[3])
    # one adapter beside the base model, then the same on the other row: another layout, another graph
    for layout in ([ra, None], [None, ra]):
        got = llm.generate(prompts, sp, lora_request=layout, use_tqdm=False)
        i = layout.index(ra)
        _score(setup["a"], prompts[i], got[i])
        assert got[1 - i].outputs[0].token_ids == base[1 - i].outputs[0].token_ids


def test_native_delta_kernel_equals_float64():
    """attention/native/lora_delta.py on every row, a run of rows and scattered rows, fp32 and
    bf16: y + (x A^T)(sB)^T against float64 (fp32 within accumulation error; bf16 rounded once
    from it), rows outside the selection untouched, an index out of range refused."""
    from cuttle.attention.native.lora_delta import add_rows

    if kernels().lib is None:
        pytest.skip("the native CPU kernel library is not built")
    g = torch.Generator().manual_seed(0)
    T, K, N = 9, 70, 45
    for R, dtype in ((12, torch.float32), (20, torch.float32), (12, torch.bfloat16), (20, torch.bfloat16)):
        a, b = torch.randn(R, K, generator=g), torch.randn(N, R, generator=g)
        x, y0 = torch.randn(T, K, generator=g).to(dtype), torch.randn(T, N, generator=g).to(dtype)
        for rows in (None, slice(2, 6), torch.tensor([7, 0, 4])):
            y = y0.clone()
            assert add_rows(y, x, a.t().contiguous(), b.t().contiguous(), rows)
            sel = torch.arange(T) if rows is None else torch.arange(T)[rows]
            want = y0.double()[sel] + (x.double()[sel] @ a.double().t()) @ b.double().t()
            if dtype == torch.float32:
                assert torch.allclose(y[sel].double(), want, rtol=0, atol=1e-4)
            else:  # one rounding of the fp32 sum: within a bf16 ulp of the exact value
                assert torch.allclose(y[sel].double(), want, rtol=2 ** -7, atol=1e-2)
            rest = torch.ones(T, dtype=torch.bool)
            rest[sel] = False
            assert torch.equal(y[rest], y0[rest])
        # rows are computed 4 at a time: a row alone gets the same bits as within a block
        y = y0.clone()
        add_rows(y, x, a.t().contiguous(), b.t().contiguous())
        for i in range(T):
            alone = y0[i:i + 1].clone()
            add_rows(alone, x[i:i + 1], a.t().contiguous(), b.t().contiguous())
            assert torch.equal(alone[0], y[i])
    with pytest.raises(IndexError):
        add_rows(y0.clone(), x, a.t().contiguous(), b.t().contiguous(), torch.tensor([T]))


# ---- refusals ------------------------------------------------------------------------------------
def _write(path, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "bias": "none", **config}, f)
    if tensors:
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return str(path)


def _qa(layer: int = 0, module: str = "self_attn.q_proj", r: int = 4, fan_in: int = 64, rows: int = 64):
    p = f"base_model.model.model.layers.{layer}.{module}"
    return {f"{p}.lora_A.weight": torch.randn(r, fan_in), f"{p}.lora_B.weight": torch.randn(rows, r)}


@pytest.mark.parametrize("config, tensors, match", [
    ({"use_dora": True}, _qa(), "use_dora"),
    ({"bias": "lora_only"}, _qa(), "bias='lora_only'"),
    ({"modules_to_save": ["lm_head"]}, _qa(), "modules_to_save"),
    ({"r": 32}, _qa(r=32), "max_lora_rank"),
    ({"peft_type": "IA3"}, _qa(), "peft_type 'IA3'"),
    ({}, {"base_model.model.model.embed_tokens.lora_embedding_A": torch.randn(4, 256)}, "not a LoRA weight of a supported module"),
    ({}, _qa(module="self_attn.g_proj"), "self_attn.g_proj is not supported"),
    ({}, _qa(layer=5), "names layer 5"),
    ({}, _qa(rows=32), "lora_B"),
    ({}, {k: v for k, v in _qa().items() if "lora_A" in k}, "has lora_A but not lora_B"),
    ({}, {k: v * float("nan") for k, v in _qa().items()}, "NaN"),
    ({}, {}, "no adapter_model.safetensors"),
])
def test_unsupported_adapters_are_refused(setup, tmp_path, config, tensors, match):
    llm = _llm(setup["base_dir"])
    path = _write(tmp_path / "bad", config, tensors)
    with pytest.raises(ValueError, match=match):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), lora_request=LoRARequest("bad", 1, path), use_tqdm=False)
    # the engine goes on serving
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_adapter_on_routed_experts_is_refused(tmp_path):
    make_checkpoint(str(tmp_path / "m"), "qwen3_moe", seed=5)
    llm = _llm(str(tmp_path / "m"))
    path = _write(tmp_path / "ad", {}, _qa(module="mlp.gate_proj", rows=128))
    with pytest.raises(ValueError, match="routed mixture of experts"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=1), lora_request=LoRARequest("ad", 1, path), use_tqdm=False)


def test_lora_request_needs_enable_lora(setup):
    llm = LLM(setup["base_dir"], dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=1), lora_request=LoRARequest("a", 1, setup["a_dir"]), use_tqdm=False)
    with pytest.raises(ValueError, match="max_loras must be an integer >= 1"):
        LLM(setup["base_dir"], enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, setup["a_dir"])
    with pytest.raises(ValueError, match="got 2 prompts but 1 lora_requests"):
        _llm(setup["base_dir"]).generate([[5], [6]], SamplingParams(max_tokens=1), lora_request=[None], use_tqdm=False)


# ---- the server ----------------------------------------------------------------------------------
def test_server_serves_adapters_by_model_name(setup, tmp_path):
    """`--lora-modules`: the model field picks the adapter (the official client), completions and
    chat equal the offline engine's under that adapter, /v1/models lists it, the base model still
    serves, and runtime loading / unloading works when allowed (and is absent when not)."""
    import httpx
    import openai

    from server_fixture import LiveServer

    prompt = _prompts(1, seed=8)[0]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    offline = _llm(setup["base_dir"])
    want_a = offline.generate([prompt], sp, lora_request=LoRARequest("a", 1, setup["a_dir"]), use_tqdm=False)[0].outputs[0]
    want_b = offline.generate([prompt], sp, lora_request=LoRARequest("b", 2, setup["b_dir"]), use_tqdm=False)[0].outputs[0]
    want_base = offline.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    [beams] = offline.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=3), lora_request=LoRARequest("a"))
    want_beams = [b.tokens[len(prompt):] for b in beams.sequences]
    kw = dict(dtype="float32", attention_backend="torch", num_kv_blocks=96, enable_lora=True)
    with LiveServer(setup["base_dir"], name="base", app_kw={"lora_modules": {"a": setup["a_dir"]},
                                                            "allow_runtime_lora_updating": True}, **kw) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"base", "a"} and models["a"].model_extra["parent"] == "base"

        def complete(model: str) -> list[int]:
            r = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            return r.choices[0].model_extra["token_ids"]

        assert complete("a") == want_a.token_ids
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'cuttle_lora_adapters_loaded{model_name="base"} 1.0' in metrics
        assert 'cuttle_lora_requests_running{model_name="base"} 0.0' in metrics
        assert complete("base") == want_base.token_ids != want_a.token_ids
        with pytest.raises(openai.NotFoundError, match="model 'b' does not exist"):
            complete("b")
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": setup["b_dir"]})
        assert r.status_code == 200, r.text
        assert complete("b") == want_b.token_ids
        chat = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                              temperature=0)
        assert chat.model == "b" and chat.choices[0].message.content is not None
        bad = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(tmp_path)})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        dup = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": setup["a_dir"]})
        assert dup.status_code == 400 and "already loaded" in dup.json()["error"]["message"]
        assert httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
        assert httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 404
        with pytest.raises(openai.NotFoundError):
            complete("b")
        # beam search under the adapter: each beam a session under it, as offline
        beam = httpx.post(srv.url + "/v1/completions", json={"model": "a", "prompt": prompt, "use_beam_search": True, "n": 2,
                                                               "max_tokens": 3, "return_token_ids": True}, timeout=60)
        assert beam.status_code == 200, beam.text
        assert beam.json()["model"] == "a"
        assert [c["token_ids"] for c in beam.json()["choices"]] == want_beams
    with LiveServer(setup["base_dir"], name="base", **kw) as srv:
        assert httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": setup["b_dir"]}).status_code == 404


def test_cli_lora_flags():
    from cuttle.engine.cli import _lora_module

    assert _lora_module("a=/x/y") == ("a", "/x/y")
    assert _lora_module('{"name": "a", "path": "/x", "base_model_name": "m"}') == ("a", "/x")
    import argparse
    for bad in ("noequals", "=/x", '{"name": "a"}', '{"name": "a", "path": "/x", "rank": 3}'):
        with pytest.raises(argparse.ArgumentTypeError):
            _lora_module(bad)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_with_adapters(setup, tmp_path, dtype):
    """batch_invariant=True: an adapter request's tokens and top logprobs are bit-identical alone
    and beside other requests (other adapters, the base, long prompts chunked)."""
    if kernels().lib is None:
        pytest.skip("native CPU kernel library not built")
    base = make_checkpoint(str(tmp_path / "m"), "qwen3", seed=11, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=64)
    _adapter(base, str(tmp_path / "a"), 3, ALL, r=8, alpha=16)
    _adapter(base, str(tmp_path / "b"), 4, ["q_proj", "v_proj", "down_proj"], r=4, alpha=8)
    ra, rb = LoRARequest("a", 1, str(tmp_path / "a")), LoRARequest("b", 2, str(tmp_path / "b"))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (30, 200, 9, 120)]
    sp = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)

    def run(llm, ps, loras):
        o = llm.generate(ps, sp, lora_request=loras, use_tqdm=False)[0].outputs[0]
        return list(o.token_ids), [sorted((t, lp.logprob) for t, lp in row.items()) for row in o.logprobs]

    kw = dict(dtype=dtype, num_kv_blocks=128, enable_lora=True, batch_invariant=True)
    alone = run(_llm(str(tmp_path / "m"), **kw), prompts[:1], [ra])
    mixed = run(_llm(str(tmp_path / "m"), max_num_batched_tokens=64, **kw), prompts, [ra, rb, None, ra])
    assert alone == mixed


def test_adapters_survive_a_level_2_sleep(setup):
    """sleep(level=2) discards the base weights, not the adapters: after reload_weights the
    adapter's outputs are peft's again (and equal those before the sleep), base rows beside them."""
    llm = _llm(setup["base_dir"], enable_sleep_mode=True, attention_backend="auto")
    prompts = _prompts(2, seed=6)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    ra = LoRARequest("a", 1, setup["a_dir"])

    def run():
        outs = llm.generate(prompts, sp, lora_request=[ra, None], use_tqdm=False)
        return outs, [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                      for o in outs]

    _, before = run()
    llm.sleep(2)
    llm.wake_up()
    llm.reload_weights()
    outs, after = run()
    assert after == before
    _score(setup["a"], prompts[0], outs[0])
    _score(setup["base"], prompts[1], outs[1])
