"""Speculative decoding with the checkpoint's multi-token-prediction layer (`speculative_config=
{"method": "mtp"}`, engine/mtp_proposer.py) on tiny GLM-4.5 and DeepSeek-V3 (MLA) checkpoints.

- The MTP layer's logits, computed step by step from its paged entries, equal a dense recompute
  of the layer over the whole sequence from the target's hidden states (the oracle: the model's
  training-path forward, then enorm / hnorm / eh_proj / the layer / the shared head as vLLM's
  deepseek_mtp computes them).
- Outputs are bit-identical to decoding without drafts (batch-invariant kernels): greedy and
  seeded random, n > 1, penalties, logprobs, prefix-cache hits, a pool small enough to preempt,
  graphs on and off.
- A model whose MTP layer computes exactly its next-token function (a one-layer model whose
  attention adds nothing, so its next token depends on the last one only, and an MTP layer that
  copies that layer) keeps (nearly) every draft, greedy and sampled at temperature 1: the drafts
  are taken where the target samples, from the same uniforms.
- Configs that cannot work are refused naming the key or the checkpoint's lack.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.mtp_proposer import MTPState
from helpers import parity_prompts, write_tokenizer
from moe_families import _COMMON, family_model, randomize_

PROMPTS = [parity_prompts()[i] for i in (0, 2, 3, 5, 7)]  # 3, 16, 17, 40 and 70 tokens
CASES = [SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True),
         SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=24, logprobs=1, n=2, ignore_eos=True),
         SamplingParams(temperature=1.0, seed=5, max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.4, ignore_eos=True)]
MTP = {"method": "mtp", "num_speculative_tokens": 1, "disable_by_batch_size": None}


def _save(model, path: str, mtp: dict[str, torch.Tensor] | None) -> str:
    """`model` (transformers) saved with `mtp`'s tensors added and num_nextn_predict_layers set."""
    model.save_pretrained(path)
    write_tokenizer(path, 256)
    if mtp is not None:
        file = os.path.join(path, "model.safetensors")
        save_file({**load_file(file), **mtp}, file)
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        cfg["num_nextn_predict_layers"] = 1
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
    return path


def _mtp_tensors(model, *, layer_from: int, seed: int) -> dict[str, torch.Tensor]:
    """An MTP layer at index num_hidden_layers: a copy of decoder layer `layer_from` perturbed, a
    random projection and head, norms near 1."""
    L = model.config.num_hidden_layers
    g = torch.Generator().manual_seed(seed)
    sd = model.state_dict()
    H, V = model.config.hidden_size, model.config.vocab_size
    out = {}
    for k, v in sd.items():
        if k.startswith(f"model.layers.{layer_from}."):
            t = v.clone()
            if t.dim() >= 2:
                t += 0.05 * torch.randn(t.shape, generator=g)
            out[k.replace(f"model.layers.{layer_from}.", f"model.layers.{L}.")] = t.contiguous()
    for name, shape in (("enorm.weight", (H,)), ("hnorm.weight", (H,)), ("shared_head.norm.weight", (H,))):
        out[f"model.layers.{L}.{name}"] = 1 + 0.1 * torch.randn(shape, generator=g)
    out[f"model.layers.{L}.eh_proj.weight"] = 0.15 * torch.randn(H, 2 * H, generator=g)
    out[f"model.layers.{L}.shared_head.head.weight"] = 0.15 * torch.randn(V, H, generator=g)
    out[f"model.layers.{L}.embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    out = {}
    for family in ("glm4_moe", "deepseek_v3"):
        model = family_model(family)
        out[family] = _save(model, str(tmp_path_factory.mktemp(family)), _mtp_tensors(model, layer_from=2, seed=3))
    out["plain"] = _save(family_model("glm4_moe"), str(tmp_path_factory.mktemp("plain")), None)
    out["bigram"] = _bigram_checkpoint(str(tmp_path_factory.mktemp("bigram")))
    return out


def _bigram_checkpoint(path: str) -> str:
    """One GLM-4.5 MoE layer whose attention output is zero, so the next token is a function of the
    last one; embedding rows at RMS 1 so the MTP's enorm leaves them as the layer's input norm
    does; the MTP layer a copy of the decoder layer reading only the embedding (eh_proj = [I | 0]),
    with the model's final norm and lm_head: it predicts t_{n+2} from t_{n+1} as the target will."""
    import transformers

    cfg = transformers.Glm4MoeConfig(
        num_key_value_heads=2, head_dim=24, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=0, routed_scaling_factor=2.5,
        attention_bias=True, use_qk_norm=True, **{**_COMMON, "num_hidden_layers": 1})
    model = randomize_(transformers.Glm4MoeForCausalLM(cfg).float().eval(), 0.3, seed=7)
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        e = model.model.embed_tokens.weight
        e.div_(e.pow(2).mean(-1, keepdim=True).sqrt())
    sd = model.state_dict()
    H = cfg.hidden_size
    mtp = {k.replace("model.layers.0.", "model.layers.1."): v.clone() for k, v in sd.items() if k.startswith("model.layers.0.")}
    mtp.update({"model.layers.1.enorm.weight": torch.ones(H), "model.layers.1.hnorm.weight": torch.ones(H),
                "model.layers.1.eh_proj.weight": torch.cat((torch.eye(H), torch.zeros(H, H)), dim=1),
                "model.layers.1.shared_head.norm.weight": sd["model.norm.weight"].clone(),
                "model.layers.1.shared_head.head.weight": sd["lm_head.weight"].clone(),
                "model.layers.1.embed_tokens.weight": sd["model.embed_tokens.weight"].clone()})
    return _save(model, path, mtp)


def _llm(path: str, spec: dict | None = None, **kw) -> LLM:
    kw = {"dtype": "float32", "num_kv_blocks": 128, "block_size": 8, "batch_invariant": True, **kw}
    return LLM(path, speculative_config=spec, **kw)


def _outputs(llm: LLM, sp: SamplingParams, prompts=PROMPTS) -> list:
    return [(c.token_ids, c.cumulative_logprob,
             None if c.logprobs is None else [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
            for r in llm.generate(prompts, sp, use_tqdm=False) for c in r.outputs]


def _oracle_logprobs(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """The MTP layer's log-probabilities at every position i of `tokens` (predicting token i + 2),
    by a dense recompute: the target's final hidden states from its training-path forward, then
    the MTP layer over the whole sequence with a causal mask."""
    model = llm.engine.runner.model
    mtp, layer = model.mtp, model.layers[model.cfg.num_layers]
    S = len(tokens)
    ids = torch.tensor([tokens])
    pos = torch.arange(S)[None]
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    with torch.no_grad():
        h = model.forward_masked(ids, pos, causal[None])[0, :-1]  # h_0 .. h_{S-2}
        e = torch.nn.functional.embedding(ids[0, 1:], mtp.embed)
        e[0] = 0  # position 0's embedding is masked (vLLM's deepseek_mtp)
        x = torch.nn.functional.linear(torch.cat((mtp.enorm(e), mtp.hnorm(h)), dim=-1), mtp.eh_proj)
        cos, sin = model.rope.tables(torch.arange(S - 1), x.dtype)
        x = layer.forward_dense(x[None], cos, sin, causal[None, None, : S - 1, : S - 1])[0]
        return torch.nn.functional.linear(mtp.head_norm(x), mtp.head).log_softmax(-1)


def _capture_mtp_logits(llm: LLM):
    """Records every draft row the proposer scores; the returned function hands them over as
    (sequence, its length then, log-probabilities)."""
    proposer = llm.engine.proposer
    seen: list[tuple[object, int, torch.Tensor]] = []
    asked: list[tuple[object, int]] = []
    sample_request, compute = proposer.sample_request, llm.engine.runner.model.mtp.compute_logits

    def recording_request(seq):
        asked.append((seq, len(seq.token_ids)))
        return sample_request(seq)

    def recording_logits(normed):
        out = compute(normed)
        pending.extend(out.log_softmax(-1))
        return out

    pending: list[torch.Tensor] = []
    proposer.sample_request = recording_request
    llm.engine.runner.model.mtp.compute_logits = recording_logits

    def flush():
        assert len(asked) == len(pending)
        seen.extend((s, n, lp) for (s, n), lp in zip(asked, pending))
        asked.clear()
        pending.clear()
        return seen
    return flush


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_mtp_logits_equal_the_dense_recompute(checkpoints, family):
    llm = _llm(checkpoints[family], MTP)
    flush = _capture_mtp_logits(llm)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    seen = flush()
    by_prompt = {tuple(p): p + list(r.outputs[0].token_ids) for p, r in zip(PROMPTS, outs)}
    checked = 0
    for seq, n, lp in seen:
        stream = by_prompt[tuple(seq.token_ids[: seq.num_prompt_tokens])]
        ref = _oracle_logprobs(llm, stream)
        assert torch.allclose(lp, ref[n - 2], atol=2e-5, rtol=0), (family, n, (lp - ref[n - 2]).abs().max())
        checked += 1
    assert checked >= 5 * 10  # every prompt drafts most of its steps
    stats = llm.engine.stats()
    assert stats["spec_draft_tokens"] >= checked


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_mtp_drafts_change_no_output(checkpoints, family):
    base, spec = _llm(checkpoints[family]), _llm(checkpoints[family], MTP)
    for sp in CASES:
        assert _outputs(spec, sp) == _outputs(base, sp), sp
    # a second pass hits the prefix cache (the MTP entries of the cached blocks are reused)
    assert _outputs(spec, CASES[0]) == _outputs(base, CASES[0])
    assert spec.engine.stats()["spec_draft_tokens"] > 0
    bm = spec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_mtp_under_preemption_and_without_graphs(checkpoints):
    """A pool too small for every sequence at once (preempted ones recompute, their MTP entries
    redone from the recomputed rows), and eager steps, change nothing."""
    path = checkpoints["glm4_moe"]
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=40, n=3, ignore_eos=True)
    small = dict(num_kv_blocks=24, max_num_seqs=8)
    base, spec = _llm(path, **small), _llm(path, MTP, **small)
    assert _outputs(spec, sp) == _outputs(base, sp)
    assert spec.engine.stats()["preemptions"] > 0
    eager = _llm(path, MTP, enforce_eager=True)
    assert _outputs(eager, CASES[0]) == _outputs(base, CASES[0])


def test_an_mtp_layer_that_is_the_next_token_function_keeps_its_drafts(checkpoints):
    path = checkpoints["bigram"]
    base, spec = _llm(path), _llm(path, MTP)
    for sp in (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
               SamplingParams(temperature=1.0, seed=9, max_tokens=40, n=2, ignore_eos=True)):
        before = dict(spec.engine.counters), base.engine.counters["steps"]
        assert _outputs(spec, sp) == _outputs(base, sp), sp
        drafted = spec.engine.counters["spec_draft_tokens"] - before[0]["spec_draft_tokens"]
        kept = spec.engine.counters["spec_accepted_tokens"] - before[0]["spec_accepted_tokens"]
        assert kept >= 0.9 * drafted > 0, (sp, kept, drafted)
        steps = spec.engine.counters["steps"] - before[0]["steps"]
        assert steps < 0.65 * (base.engine.counters["steps"] - before[1])


def test_mtp_state_keeps_the_rows_entries_still_need():
    st = MTPState()
    st.put(4, torch.arange(6.0)[:, None])  # positions 4..9 (a prefix hit below 4)
    assert st.done == 4
    first, rows = st.take(7)
    assert first == 4 and rows[:, 0].tolist() == [0, 1, 2, 3]
    st.finish(8)
    st.put(8, torch.tensor([[10.0], [11.0], [12.0]]))  # 8 recomputed; 9, 10 a draft's rows
    first, rows = st.take(9)
    assert first == 8 and rows[:, 0].tolist() == [10, 11]
    st.finish(10)
    st.put(2, torch.tensor([[20.0], [21.0]]))  # recomputed from 2 (preempted): entries from 2 redone
    assert st.done == 2 and st.take(3)[0] == 2 and st.take(5) is None  # 4's row went with the recompute
    child = st.copy()
    child.finish(4)
    assert st.take(3)[1][:, 0].tolist() == [20, 21]


@pytest.mark.parametrize("spec, match", [
    ({"method": "mtp", "num_speculative_tokens": 2}, "num_speculative_tokens must be 1 with method 'mtp'"),
    ({"method": "deepseek_mtp", "model": "x", "num_speculative_tokens": 1}, "speculative_config.model is not a key of method 'mtp'"),
    ({"method": "mtp", "prompt_lookup_max": 3}, "prompt_lookup_max is not a key of method 'mtp'"),
])
def test_bad_mtp_configs_are_refused_naming_the_key(checkpoints, spec, match):
    with pytest.raises(ValueError, match=match):
        _llm(checkpoints["glm4_moe"], spec)


def test_a_checkpoint_without_an_mtp_layer_is_refused(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="does not provide"):  # GLM's config implies one layer; its tensors are absent
        _llm(checkpoints["plain"], MTP)
    path = _save(family_model("qwen2_moe"), str(tmp_path / "qwen"), None)
    with pytest.raises(ValueError, match="has no multi-token-prediction layers"):
        _llm(path, MTP)


def test_mtp_entries_keep_up_on_steps_without_drafts(checkpoints):
    """With more running sequences than disable_by_batch_size no step drafts, yet every step
    writes the entries of its decoding sequences (a sequence holds only its newest rows, not its
    whole output's); once few remain, their drafts read entries equal to the dense recompute."""
    path = checkpoints["glm4_moe"]
    llm = _llm(path, {**MTP, "disable_by_batch_size": 2})
    flush = _capture_mtp_logits(llm)
    engine = llm.engine
    lengths = [6, 6, 6, 30, 30]
    for i, (p, n) in enumerate(zip(PROMPTS, lengths)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    done, most_held = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = list(out.outputs[0].token_ids)
        for seq in engine.scheduler.running:
            if seq.mtp is not None and seq.num_output_tokens > 1:
                most_held = max(most_held, sum(r.shape[0] for _, r in seq.mtp.runs))
    assert most_held <= 3, most_held
    seen = flush()
    assert len(seen) >= 10  # the two long ones drafted once the short ones were done
    for seq, n, lp in seen:
        i = next(k for k, p in enumerate(PROMPTS) if seq.token_ids[: seq.num_prompt_tokens] == p)
        assert torch.allclose(lp, _oracle_logprobs(llm, PROMPTS[i] + done[i])[n - 2], atol=2e-5, rtol=0)


def test_served_with_mtp_from_the_cli_json(checkpoints):
    """`--speculative-config '{"method": "deepseek_mtp"}'` (vLLM's name) serves the tokens of the
    offline engine without drafts, and drafts are kept (the next-token MTP layer)."""
    import argparse

    import httpx

    from cuttle.engine.cli import _engine_args
    from server_fixture import LiveServer

    p = argparse.ArgumentParser()
    _engine_args(p)
    spec = p.parse_args(["--speculative-config", json.dumps({"method": "deepseek_mtp", "disable_by_batch_size": None})]).speculative_config
    path = checkpoints["bigram"]
    with LiveServer(path, dtype="float32", num_kv_blocks=128, block_size=8, batch_invariant=True, speculative_config=spec) as srv:
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"model": "test-model", "prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0,
                             "ignore_eos": True, "return_token_ids": True})
        stats = srv.llm.engine.stats()
    assert r.status_code == 200, r.text
    want = _llm(path).generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].token_ids
    assert r.json()["choices"][0]["token_ids"] == want
    assert stats["spec_accepted_tokens"] >= 0.9 * stats["spec_draft_tokens"] > 0


def test_mtp_over_a_host_tier_and_session_turns(checkpoints):
    """Prefixes served from the host KV tier (read in place, or copied in) and agent session turns
    (a turn continues from the session's pinned KV, whose MTP entries came with it) change nothing."""
    path = checkpoints["glm4_moe"]
    sp = SamplingParams(temperature=0.9, seed=3, max_tokens=24, ignore_eos=True)
    for read in ("auto", "never"):
        common = dict(num_kv_blocks=40, num_host_kv_blocks=128, kv_read_in_place=read)
        base, spec = _llm(path, **common), _llm(path, MTP, **common)
        for llm in (base, spec):
            _outputs(llm, sp)  # the prompts' blocks cached, then pushed to the host tier by the fillers
            _outputs(llm, sp, [[200 + i] * 40 for i in range(3)])
        assert _outputs(spec, sp) == _outputs(base, sp), read
        st = spec.engine.stats()
        assert st["kv_read_in_place_runs" if read == "auto" else "kv_copy_in_runs"] >= 1 and st["spec_draft_tokens"] > 0

    def turns(llm: LLM) -> list:
        eng = llm.engine
        sid = eng.open_session(PROMPTS[3])
        got = []
        for turn in range(3):
            eng.add_session_turn(f"turn-{turn}", [sid], SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True))
            outs = []
            while eng.has_unfinished_requests():
                outs += eng.step()
            c = [o for o in outs if o.finished][-1].outputs[0]
            got.append((list(c.token_ids), [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]))
            eng.append_to_session(sid, [7, 8, 9])
        return got

    assert turns(_llm(path, MTP)) == turns(_llm(path))


def test_mtp_entries_are_written_into_device_blocks_only(checkpoints):
    """A sequence whose table names a host-tier block (read in place) at positions its entries
    still need: the entries of those positions are left as stored, the rest written; nothing is
    written through the host block's id."""
    from cuttle.attention.metadata import HOST_BLOCK

    llm = _llm(checkpoints["glm4_moe"], MTP, num_host_kv_blocks=16)
    engine = llm.engine
    engine.add_request("r", PROMPTS[3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()  # the prompt (40 tokens, 10 blocks of 4) computed, its rows held for the MTP entries
    [seq] = engine.scheduler.running
    assert seq.mtp.done == 0 and seq.num_computed_tokens == 40
    kv = engine.runner.kv.layers[engine.runner.model.cfg.num_layers][0]  # the MTP layer's keys
    first, second = seq.block_table[0], seq.block_table[1]
    before = kv[first].clone(), kv[second].clone()
    seq.block_table[1] = HOST_BLOCK  # positions 4..7 now on the host tier
    engine.proposer.prepare([seq])
    seq.block_table[1] = second
    assert seq.mtp.done == 40 and not seq.mtp.runs
    assert torch.equal(kv[first], before[0]) and torch.equal(kv[second], before[1])  # 0..7: not written
    assert engine.proposer.draft(seq, 1)  # the row at 39 drafted
