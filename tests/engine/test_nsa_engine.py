"""NSA models (issue 16): the model option (config.json's "nsa" object, our names and fla-org's),
the NSA layer's weights under their HF names, its training path (autograd through the torch
reference), and the paged engine (acceptance 3): prefill, chunked prefill, preemption,
prefix-cache hits and forked samples give, at every position, the log-probabilities of one full
forward of the reference (`CausalLM.forward_masked` over the whole sequence), fp32 within 1e-5,
with every KV block free afterwards. Checkpoints are tiny random ones built here (no download)."""
from __future__ import annotations

import random

import pytest
import torch

from cuttle.attention.nsa import NSAConfig
from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import ModelConfig
from cuttle.engine.models.loader import hf_state_dict, load_model, load_weights
from cuttle.engine.models.nsa_config import nsa_config
from cuttle.engine.models.transformer import CausalLM, NSAAttention

from sparse_helpers import NSA_SMALL, check_against_reference, make_nsa_checkpoint, nsa_hf_config, random_nsa_model

def test_config_fields_and_fla_names():
    cfg = nsa_config(nsa_hf_config({"block_size": 32, "block_counts": 4, "window_size": 64, "compress_block": 16,
                                    "compress_stride": 8}))
    assert cfg == NSAConfig(compress_block=16, compress_stride=8, select_block=32, top_n=4, window=64)
    assert nsa_config({"architectures": ["Qwen3ForCausalLM"]}) is None
    assert nsa_config(nsa_hf_config({})) == NSAConfig()


@pytest.mark.parametrize(
    "nsa,over,match",
    [
        ({"select_block": 40}, {}, r"nsa\.select_block"),
        ({"window": -4}, {}, r"nsa\.window"),
        ({"top_n": 20, "select_block": 64}, {"max_position_embeddings": 512}, r"nsa\.top_n"),
        ({"block_size": 64, "select_block": 64}, {}, r"select_block given twice"),
        ({"blocks": 3}, {}, r"nsa\.blocks is not an NSA field"),
    ],
)
def test_bad_nsa_config_is_refused_naming_the_field(nsa, over, match):
    with pytest.raises(ValueError, match=match):
        CausalLM(ModelConfig.from_hf(nsa_hf_config(nsa, **over)), torch.float32, torch.device("cpu"))


def test_weights_round_trip_under_hf_names(tmp_path):
    model = make_nsa_checkpoint(str(tmp_path))
    names = set(hf_state_dict(model))
    for i in range(2):
        for n in ("g_proj", "compress_k", "compress_v"):
            assert f"model.layers.{i}.self_attn.{n}.weight" in names
    loaded = load_model(str(tmp_path), model.cfg, torch.float32, torch.device("cpu"))
    assert isinstance(loaded.layers[0].attn, NSAAttention)
    for (n, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), n
    # a dense model has no place for NSA tensors: refused, not dropped
    dense = CausalLM(ModelConfig.from_hf({k: v for k, v in nsa_hf_config().items() if k != "nsa"}), torch.float32,
                     torch.device("cpu"))
    with pytest.raises(ValueError, match="g_proj"):
        load_weights(dense, [("model.layers.0.self_attn.g_proj.weight", torch.zeros(12, 64))])


def test_training_path_learns_through_every_nsa_weight():
    model = random_nsa_model(nsa_hf_config({**NSA_SMALL, "window": 8}), seed=1)
    params = [p for p in model.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=3e-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (2, 48), generator=g)
    pos = torch.arange(48).expand(2, -1)
    mask = torch.ones(48, 48, dtype=torch.bool).tril().expand(2, -1, -1)
    losses = []
    for _ in range(4):
        hidden = model.forward_masked(ids[:, :-1], pos[:, :-1], mask[:, :-1, :-1])
        logits = hidden @ model.lm_head.T
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        attn = model.layers[0].attn
        for w in (attn.g_weight, attn.ck_weight, attn.cv_weight, attn.qkv_weight):
            assert w.grad is not None and w.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    packed = mask.clone()
    packed[:, 30:, :30] = False  # two documents in a row: NSA layers need to know the segments
    with pytest.raises(NotImplementedError, match="segments"):
        model.forward_masked(ids, pos, packed)


def test_packed_documents_train_each_as_if_alone():
    """`forward_packed` on an NSA model: each document of a row is a segment of its own (positions
    restarting), computed exactly as that document alone (fp32 <= 1e-5, gradients too); a mask
    showing part of a segment is refused naming the segment."""
    model = random_nsa_model(nsa_hf_config({**NSA_SMALL, "window": 8}), seed=2)
    g = torch.Generator().manual_seed(1)
    lens = [37, 5, 22]
    ids = torch.randint(3, 256, (1, sum(lens)), generator=g)
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    weights = [model.layers[0].attn.ck_weight, model.layers[1].attn.g_weight, model.layers[0].attn.qkv_weight]
    for w in weights:
        w.requires_grad_(True)
    packed = model.forward_packed(ids, pos, doc)
    direction = torch.randn(packed.shape, generator=g)  # (a sum of squares of normed states has ~0 gradient)
    want = torch.autograd.grad((packed * direction).sum(), weights)
    at, alone_loss = 0, 0.0
    for n in lens:
        alone = model.forward_masked(ids[:, at : at + n], torch.arange(n)[None], torch.ones(n, n, dtype=torch.bool).tril()[None])
        assert (packed[:, at : at + n] - alone).abs().max().item() <= 1e-5
        alone_loss = alone_loss + (alone * direction[:, at : at + n]).sum()
        at += n
    for a, b in zip(want, torch.autograd.grad(alone_loss, weights)):
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()
    mask = (doc[:, :, None] == doc[:, None, :]) & torch.ones(sum(lens), sum(lens), dtype=torch.bool).tril()
    bad = mask.clone()
    bad[0, 40, 2] = True  # a token of the second document sees one key of the first
    with pytest.raises(ValueError, match="segment 0"):
        model.forward_masked(ids, pos, bad, segments=doc)
    # shapes that do not match the tokens are refused naming the argument; a [1, S, S] mask broadcasts
    two_ids, two_pos, two_doc = ids.expand(2, -1), pos.expand(2, -1), doc.expand(2, -1)
    with torch.no_grad():
        assert torch.equal(model.forward_masked(two_ids, two_pos, mask, segments=two_doc)[1], packed[0].detach())
    for kw, match in [(dict(segments=doc[:, :-4]), "segments has shape"), (dict(segments=doc, segment_shifts=doc[:, :-4]),
                      "segment_shifts has shape"), (dict(segments=doc[0]), "segments has shape")]:
        with pytest.raises(ValueError, match=match):
            model.forward_masked(ids, pos, mask, **kw)
    with pytest.raises(ValueError, match="mask has shape"):
        model.forward_masked(ids, pos, mask[:, :-1, :-1], segments=doc)


# ---- the paged engine ------------------------------------------------------------------------

NEW = 40
LENGTHS = [5, 23, 40, 77, 130]  # shorter than one compression block .. several selection blocks

MODES = {
    "batched": dict(num_kv_blocks=128, max_num_batched_tokens=4096),
    "chunked": dict(num_kv_blocks=128, max_num_batched_tokens=24),
    "preempt": dict(num_kv_blocks=14, max_num_batched_tokens=64),
}


@pytest.fixture(scope="module")
def nsa_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("nsa"))
    make_nsa_checkpoint(path, seed=3)
    reference = load_model(path, ModelConfig.from_pretrained(path), torch.float32, torch.device("cpu")).eval()
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in LENGTHS]
    return path, reference, prompts


@pytest.mark.parametrize("mode", list(MODES))
def test_nsa_decode_equals_one_full_forward(nsa_model, mode):
    path, reference, prompts = nsa_model
    llm = LLM(path, dtype="float32", attention_backend="torch", **MODES[mode])
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o in outs:  # greedy: every token is the reference's argmax (checked through its logprob)
        assert len(o.outputs[0].token_ids) == NEW
    assert check_against_reference(reference, outs, with_prompt=True) > 1000
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    if mode == "preempt":
        assert stats["preemptions"] > 0
    if mode == "chunked":
        assert stats["steps"] > NEW + 10


def test_nsa_prefix_cache_hits_and_forked_samples(nsa_model):
    path, reference, prompts = nsa_model
    llm = LLM(path, dtype="float32", attention_backend="torch", num_kv_blocks=160, max_num_batched_tokens=64)
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2)
    first = llm.generate(prompts, greedy, use_tqdm=False)
    second = llm.generate(prompts, greedy, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in second) > 0
    for a, b in zip(first, second):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    check_against_reference(reference, second, with_prompt=False)
    # n samples fork from one prefilled prompt (copy-on-write of the last partial block and its
    # compressed entries); each sample's logprobs are the reference's on its own sequence
    sampled = SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=24, ignore_eos=True, logprobs=1)
    outs = llm.generate([prompts[3], prompts[4]], sampled, use_tqdm=False)
    assert len({tuple(c.token_ids) for c in outs[1].outputs}) > 1
    check_against_reference(reference, outs, with_prompt=False)
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
