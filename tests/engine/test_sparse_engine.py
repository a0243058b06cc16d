"""Training-free top-k attention in the paged engine (issue 16, acceptance 3 for `sparse_attention`):
prefill, chunked prefill, preemption, prefix-cache hits and forked samples give, at every position,
the log-probabilities of one full forward of the torch reference under the same selection rule
(`CausalLM.forward_masked(sparse=...)`), fp32 within 1e-5, with every KV block free afterwards; a
budget covering the whole context gives dense attention's; the option's refusals. Checkpoints are
tiny random dense Qwen3 ones built here (no download)."""
from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from cuttle.attention.topk import parse_sparse_attention
from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import EngineConfig, ModelConfig
from cuttle.engine.models.loader import load_model
from cuttle.engine.models.transformer import CausalLM

from sparse_helpers import TOL, check_against_reference, peaked_init_, save_checkpoint

NEW = 40
LENGTHS = [5, 23, 40, 77, 130]  # shorter than the budget .. many blocks past it
HF = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "eos_token_id": 1,
    "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "float32",
}
# engine block_size 16 below: P = 8 puts two summaries in a raw block, P = 32 spans two raw blocks
QUEST = "topk:budget=32,block=8,dense_layers=1,summary=quest,init_blocks=1,local_blocks=1"
MEAN = "topk:budget=64,block=32,dense_layers=1,summary=mean,init_blocks=0,local_blocks=1"


def make_dense_checkpoint(path: str, seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig.from_hf(HF), torch.float32, torch.device("cpu"))
    peaked_init_(model)
    save_checkpoint(path, HF, model)
    return model


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sparse"))
    make_dense_checkpoint(path, seed=3)
    reference = load_model(path, ModelConfig.from_pretrained(path), torch.float32, torch.device("cpu")).eval()
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in LENGTHS]
    return path, reference, prompts


MODES = {
    "batched-quest": (QUEST, dict(num_kv_blocks=128, max_num_batched_tokens=4096)),
    "chunked-quest": (QUEST, dict(num_kv_blocks=128, max_num_batched_tokens=24)),
    "preempt-quest": (QUEST, dict(num_kv_blocks=14, max_num_batched_tokens=64)),
    "chunked-mean": (MEAN, dict(num_kv_blocks=128, max_num_batched_tokens=24)),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_topk_decode_equals_one_full_forward(dense_model, mode):
    path, reference, prompts = dense_model
    spec, opts = MODES[mode]
    llm = LLM(path, dtype="float32", attention_backend="torch", sparse_attention=spec, **opts)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == NEW for o in outs)
    assert check_against_reference(reference, outs, with_prompt=True, sparse=parse_sparse_attention(spec)) > 1000
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    if mode.startswith("preempt"):
        assert stats["preemptions"] > 0
    if mode.startswith("chunked"):
        assert stats["steps"] > NEW + 10


def test_topk_prefix_cache_hits_and_forked_samples(dense_model):
    path, reference, prompts = dense_model
    sparse = parse_sparse_attention(QUEST)
    llm = LLM(path, dtype="float32", attention_backend="torch", sparse_attention=QUEST, num_kv_blocks=160,
              max_num_batched_tokens=64)
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2)
    first = llm.generate(prompts, greedy, use_tqdm=False)
    second = llm.generate(prompts, greedy, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in second) > 0
    for a, b in zip(first, second):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    check_against_reference(reference, second, with_prompt=False, sparse=sparse)
    # n samples fork from one prefilled prompt (copy-on-write of the last partial block and its summaries)
    sampled = SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=24, ignore_eos=True, logprobs=1)
    outs = llm.generate([prompts[3], prompts[4]], sampled, use_tqdm=False)
    assert len({tuple(c.token_ids) for c in outs[1].outputs}) > 1
    check_against_reference(reference, outs, with_prompt=False, sparse=sparse)
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_budget_covering_the_context_is_dense_attention(dense_model):
    path, reference, prompts = dense_model
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    opts = dict(dtype="float32", attention_backend="torch", num_kv_blocks=128, max_num_batched_tokens=64)
    wide = LLM(path, sparse_attention="topk:budget=256,block=16,dense_layers=0", **opts).generate(prompts, params, use_tqdm=False)
    check_against_reference(reference, wide, with_prompt=True)  # the dense reference
    narrow = LLM(path, sparse_attention=QUEST, **opts).generate(prompts, params, use_tqdm=False)
    with pytest.raises(AssertionError):  # the check can fail: a small budget is not dense attention
        check_against_reference(reference, narrow, with_prompt=True)


def test_refusals(dense_model, tmp_path):
    path, _, _ = dense_model
    with pytest.raises(ValueError, match=r"sparse_attention\.budget"):
        EngineConfig(model=path, sparse_attention="topk:budget=100")
    with pytest.raises(ValueError, match=r"sparse_attention\.dense_layers = 2: the model has 2 layers"):
        LLM(path, dtype="float32", num_kv_blocks=16, sparse_attention="topk:dense_layers=2")
    nsa_hf = {**HF, "nsa": {"compress_block": 8, "compress_stride": 4, "select_block": 16, "top_n": 3, "window": 16}}
    model = CausalLM(ModelConfig.from_hf(nsa_hf), torch.float32, torch.device("cpu"))
    peaked_init_(model)
    save_checkpoint(str(tmp_path / "nsa"), nsa_hf, model)
    with pytest.raises(ValueError, match="natively sparse"):
        LLM(str(tmp_path / "nsa"), dtype="float32", num_kv_blocks=16, sparse_attention="topk")


NARROW = "topk:budget=12,block=4,dense_layers=0,summary=quest,init_blocks=1,local_blocks=1"  # sparse on SQUID_DOCS
SQUID_DOCS = [[3 + (7 * i + 3) % 250 for i in range(29)], [3 + (11 * i + 5) % 250 for i in range(22)],
              [3 + (13 * i + 1) % 250 for i in range(37)]]
# a request computing two documents, then one finding them in the cache in another order beside a new one
SQUID_REQUESTS = [{"prefix": [5, 6, 7], "documents": [SQUID_DOCS[0], SQUID_DOCS[1]], "prompt": [40, 41, 42, 43]},
                  {"prefix": [5, 6, 7], "documents": [SQUID_DOCS[2], SQUID_DOCS[1], SQUID_DOCS[0]], "prompt": [50, 51]}]


def _squid_run(path: str, sparse: str | None, positions: str, requests: list[dict], native: bool = True):
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=160, max_model_len=256, squid_positions=positions,
              **({"sparse_attention": sparse} if sparse else {}))
    if not native:
        llm.engine.runner.backend.native = False
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = []
    for r in requests:  # one at a time: later requests find the earlier ones' documents cached
        c = llm.generate([r], greedy, use_tqdm=False)[0].outputs[0]
        outs.append((list(c.token_ids), [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]))
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]
    return outs, st


@pytest.mark.parametrize("positions", ["concat", "shared"])
def test_topk_over_squid_documents(dense_model, positions):
    """Documents under top-k: each segment (prefix, document, the query's own tokens) under the
    rule on its own keys, merged by the log-sum-exp (tests/attention/test_topk_segments.py checks
    that rule per step). Here, end to end: a budget covering every segment gives dense squid's
    outputs; a small one gives the same on the native kernel and the torch path; documents found
    in the cache in another order (no recompute of theirs, their summaries with their blocks)
    give what an engine computing that request fresh gives."""
    path, _, _ = dense_model
    first, second = SQUID_REQUESTS
    wide = "topk:budget=64,block=4,dense_layers=0,summary=quest,init_blocks=1,local_blocks=1"
    narrow = NARROW
    dense, _ = _squid_run(path, None, positions, [first, second])
    got, _ = _squid_run(path, wide, positions, [first, second])
    for (ta, la), (tb, lb) in zip(got, dense):
        assert ta == tb and max(abs(x - y) for x, y in zip(la, lb)) <= 1e-5
    native, st = _squid_run(path, narrow, positions, [first, second])
    assert st["documents_hit"] >= 2  # a and b came from the cache for the second request
    torch_path, _ = _squid_run(path, narrow, positions, [first, second], native=False)
    fresh, _ = _squid_run(path, narrow, positions, [second])
    assert native != dense  # the small budget is sparse here
    for (ta, la), (tb, lb) in zip(native, torch_path):
        assert ta == tb and max(abs(x - y) for x, y in zip(la, lb)) <= 1e-5
    assert native[1][0] == fresh[0][0] and max(abs(x - y) for x, y in zip(native[1][1], fresh[0][1])) <= 1e-5


@pytest.mark.parametrize("positions", ["concat", "shared"])
def test_topk_squid_equals_the_training_path(dense_model, positions):
    """The engine's top-k over squid documents equals the training path's (`forward_masked(sparse=,
    segments=, segment_shifts=)`: each segment under the rule on its own keys, in its encoded frame)
    over the layout's dense row, fp32, for documents computed and found in the cache; what the RL
    trainer scores a sparse_attention engine's samples with."""
    from cuttle.attention.topk import parse_sparse_attention
    from cuttle.engine.squid import SquidLayout

    path, model, _ = dense_model
    requests = SQUID_REQUESTS
    outs, st = _squid_run(path, NARROW, positions, requests)
    assert st["documents_hit"] >= 2
    sparse = parse_sparse_attention(NARROW)
    for r, (tokens, lps) in zip(requests, outs):
        layout = SquidLayout(r["prefix"], r["documents"], positions)
        ctx, tail = layout.dense_context(), r["prompt"] + tokens[:-1]
        mask, pos = layout.dense_mask_and_positions(len(tail))
        seg, shifts = layout.dense_segments(len(tail))
        with torch.no_grad():
            hidden = model.forward_masked(torch.tensor([ctx + tail]), pos[None], mask[None], sparse=sparse,
                                          segments=seg[None], segment_shifts=shifts[None])[0]
            ref = model.compute_logits(hidden).log_softmax(-1)[len(ctx) + len(r["prompt"]) - 1 :]
        got = torch.tensor(lps)
        want = ref[torch.arange(len(tokens)), torch.tensor(tokens)]
        assert (got - want).abs().max().item() <= TOL, (got - want).abs().max().item()
        # control: the dense squid forward (no sparsity) is far off with this budget
        with torch.no_grad():
            dense = model.compute_logits(model.forward_masked(torch.tensor([ctx + tail]), pos[None], mask[None])[0])
        dense = dense.log_softmax(-1)[len(ctx) + len(r["prompt"]) - 1 :][torch.arange(len(tokens)), torch.tensor(tokens)]
        assert (got - dense).abs().max().item() > 1e-3


def test_cli_flag_reaches_the_engine(monkeypatch):
    from cuttle.engine import cli

    seen: dict[str, Any] = {}
    monkeypatch.setattr("cuttle.engine.LLM", lambda model=None, **kw: seen.update(kw) or None)
    ap_args = ["generate", "hi", "--sparse-attention", QUEST]
    monkeypatch.setattr(cli, "_stream", lambda *a, **k: "")
    monkeypatch.setattr(cli, "cmd_generate", lambda args: cli._build_llm(args))
    cli.main(ap_args)
    assert seen["sparse_attention"] == QUEST


def test_pool_sizing_counts_the_block_summaries(dense_model):
    """A block under top-k costs its raw K/V plus every sparse layer's summaries of it: the pool
    sized from a memory budget holds both (the summaries were not counted before)."""
    path = dense_model[0]
    mc = ModelConfig.from_pretrained(path)
    from cuttle.engine.model_runner import ModelRunner

    raw = ModelRunner.kv_bytes_per_block(mc, 16, torch.float32)
    assert raw == 2 * 2 * 16 * 2 * 16 * 4  # layers, K and V, tokens, kv heads, head_dim, fp32
    # QUEST: block 8 -> 2 summaries a raw block of 16, min and max rows, 1 sparse layer of 2
    assert ModelRunner.kv_bytes_per_block(mc, 16, torch.float32, QUEST) == raw + 1 * 2 * 2 * 2 * 16 * 4
    # MEAN: block 32 spans two raw blocks -> one slot, one row
    assert ModelRunner.kv_bytes_per_block(mc, 16, torch.float32, MEAN) == raw + 1 * 1 * 1 * 2 * 16 * 4
    budget_gb = 200 * raw / 2**30  # room for exactly 200 dense blocks
    llm = LLM(path, dtype="float32", attention_backend="torch", block_size=16, kv_cache_memory_gb=budget_gb,
              sparse_attention=QUEST, max_num_seqs=64)
    runner = llm.engine.runner
    blocks = runner.kv.tensor.shape[2]
    assert runner.topk_cache.shape[1] == blocks == int(budget_gb * 2**30) // (raw + 2 * 2 * 2 * 16 * 4) < 200
    used = sum(t.numel() * t.element_size() for t in (runner.kv.tensor, runner.topk_cache))
    assert used <= budget_gb * 2**30
