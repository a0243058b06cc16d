"""Squid documents in the RL layer: a batch of GRPO groups computes each document once, groups keep
their layout as token ids, and the trainer scores the sampled tokens under the exact attention the
sampler used (`SquidLayout.dense_mask_and_positions`), in both position conventions.

The dense function is checked against the independent oracle (`tests/squid_oracle.py`) and the
recipe's rows where they define the same layout; `concat` with a prefix (which the oracle does not
model: a document is encoded after the prefix at distance 0, then placed further on) is checked
against the engine itself through the trainer's logprobs."""
from __future__ import annotations

import random

import pytest
import torch

from cuttle.attention.topk import parse_sparse_attention
from cuttle.engine import LLM, SamplingParams
from cuttle.engine import train_default_model as recipe
from cuttle.engine.squid import SquidLayout
from cuttle.rl import Group, Sample, TrainBatch, Trajectory, extend_trajectories, mismatch, sample_groups
from cuttle.rl.client import RolloutClient
from cuttle.rl.trainer import Trainer, TrainerConfig
from squid_oracle import layout_rows, squid_mask

PREFIX = [7, 8, 9]
SP = SamplingParams(temperature=1.0, seed=3, max_tokens=12)
# the tiny checkpoints use 16-token blocks: whole blocks and mid-block ends
DOCS = [[random.Random(i).randrange(3, 250) for _ in range(n)] for i, n in enumerate([16, 37, 5, 21, 9])]
# 4 groups over overlapping subsets of the 5 documents, in different orders
SUBSETS = [[0, 1, 2], [3, 1], [2, 4, 0], [1, 3, 4, 0]]


def _prompts(prefix: list[int], subsets=SUBSETS) -> list[dict]:
    return [{"prefix": prefix, "documents": [DOCS[j] for j in sub], "prompt": [40 + i, 41, 42]} for i, sub in enumerate(subsets)]


@pytest.fixture(scope="module")
def trainer(moe_path) -> Trainer:
    return Trainer(moe_path, TrainerConfig(max_tokens_per_row=512))


def _gap(trainer: Trainer, batch: TrainBatch):
    p = batch.packed()
    return mismatch(trainer.score(batch), p.rollout_logprobs[p.loss_mask > 0])


# ---- the dense layout ------------------------------------------------------------------------
@pytest.mark.parametrize("convention,prefix", [("shared", PREFIX), ("shared", []), ("concat", [])])
def test_dense_layout_equals_the_oracle(convention, prefix):
    docs = [DOCS[2], DOCS[0], DOCS[4]]
    tail = [50, 51, 52, 53]
    layout = SquidLayout(prefix, docs, convention)
    mask, pos = layout.dense_mask_and_positions(len(tail))
    tokens, opos, group = layout_rows(prefix, docs, tail, convention)
    assert layout.dense_context() + tail == tokens
    assert pos.tolist() == opos
    assert torch.equal(mask, squid_mask(group))
    if convention == "shared":  # the recipe trains the embedded model on these rows
        n = len(tokens)
        ids, rpos, grp = recipe.squid_row(prefix, docs, tail, n + 5)
        assert ids[:n] == tokens and rpos[:n] == pos.tolist()
        assert torch.equal(recipe.layout_mask(torch.tensor(grp))[:n, :n], mask)


def test_concat_with_a_prefix_gives_each_later_document_its_own_prefix_copy():
    """A document is encoded right after the prefix and placed `offset` further for the query: the
    dense row gives it a prefix copy `offset` further on, so every distance it sees is the one it
    was encoded with, and the query sees the real prefix and every document, never a copy."""
    prefix, docs = [1, 2], [[3, 4, 5], [6], [7, 8]]
    layout = SquidLayout(prefix, docs, "concat")
    mask, pos = layout.dense_mask_and_positions(2)
    assert layout.dense_context() == [1, 2, 3, 4, 5, 1, 2, 6, 1, 2, 7, 8]
    assert pos.tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 4, 5, 6, 7, 8, 9]
    P, D0, C1, D1, C2, D2, Q = [0, 1], [2, 3, 4], [5, 6], [7], [8, 9], [10, 11], [12, 13]
    sees = {0: P, 1: P, 2: P + D0, 3: P + D0, 4: P + D0, 5: C1, 6: C1, 7: C1 + D1, 8: C2, 9: C2, 10: C2 + D2, 11: C2 + D2,
            12: P + D0 + D1 + D2 + Q, 13: P + D0 + D1 + D2 + Q}
    expected = torch.zeros(14, 14, dtype=torch.bool)
    for r, cols in sees.items():
        expected[r, [c for c in cols if c <= r]] = True
    assert torch.equal(mask, expected)
    # each document token at distance (P + j) - i from prefix token i, as when it was encoded
    for doc, copy in ((D0, P), (D1, C1), (D2, C2)):
        for j, r in enumerate(doc):
            assert [int(pos[r] - pos[c]) for c in copy] == [len(prefix) + j - i for i in range(len(prefix))]


def test_train_batch_lays_out_documents_and_masks_them():
    layout = SquidLayout([1, 2], [[3, 4, 5], [6]], "shared")
    g = Group([10, 11], [Sample([20, 21], [-0.5, -0.25], "stop", 0), Sample([22], [-1.0], "length", 0)], layout=layout)
    plain = Group([12], [Sample([23], [-0.1], "stop", 0)])
    b = TrainBatch.from_groups([g, plain], [[1.0, -1.0], [0.0]])
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 10, 11, 20, 21], [1, 2, 3, 4, 5, 6, 10, 11, 22, 0], [12, 23] + [0] * 8]
    # shared: both documents at 2, the query after the longest (2 + 3)
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 5, 6, 7, 8], [0, 1, 2, 3, 4, 2, 5, 6, 7, 0], [0, 1] + [0] * 8]
    assert b.loss_mask.tolist() == [[0] * 8 + [1, 1], [0] * 8 + [1, 0], [0, 1] + [0] * 8]
    assert b.rollout_logprobs[b.loss_mask > 0].tolist() == [-0.5, -0.25, -1.0, pytest.approx(-0.1)]
    assert b.layouts == [layout, layout, None]
    masks = b.dense_masks()
    assert torch.equal(masks[0], layout.dense_mask_and_positions(4)[0])
    assert torch.equal(masks[1, :9, :9], layout.dense_mask_and_positions(3)[0]) and masks[1, 9].tolist() == [False] * 9 + [True]
    assert torch.equal(masks[2, :2, :2], torch.ones(2, 2, dtype=torch.bool).tril())
    p = b.packed()
    assert p.layouts == b.layouts
    assert torch.equal(p.row_mask(0, 3), torch.block_diag(masks[0], masks[1, :9, :9], masks[2, :2, :2]))


# ---- rollouts --------------------------------------------------------------------------------
def test_a_batch_of_groups_computes_each_document_once(moe_path):
    """4 groups x 4 samples over overlapping subsets of 5 documents in different orders: every
    document, and the prefix, is computed once for the whole batch; the groups keep their layout."""
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=256, squid_positions="concat")
    prompts = _prompts(PREFIX)
    groups = sample_groups(llm, prompts, 4, SP, metadata=[{"i": i} for i in range(4)])
    s = llm.stats()
    assert s["documents_computed"] == 5 + 1
    assert s["document_tokens_computed"] == sum(map(len, DOCS)) + len(PREFIX)
    assert s["documents_hit"] == 0  # none was computed before this batch
    for g, p, i in zip(groups, prompts, range(4)):
        assert g.layout == SquidLayout(PREFIX, p["documents"], "concat") and g.prompt_token_ids == p["prompt"]
        assert g.metadata == {"i": i} and len(g.samples) == 4
        assert len({tuple(x.token_ids) for x in g.samples}) == 4, "a group's samples must differ"
        assert all(len(x.logprobs) == len(x.token_ids) > 0 for x in g.samples)
    # a second batch over the same documents computes none of them
    sample_groups(llm, prompts[::-1], 2, SP)
    assert llm.stats()["document_tokens_computed"] == s["document_tokens_computed"]
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_text_fields_are_encoded_once_with_the_engine_tokenizer(moe_path):
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=64, squid_positions="shared")
    tok = llm.get_tokenizer()
    (g,) = sample_groups(llm, [{"prefix": "# m", "documents": ["def f(x):", "y = 1"], "prompt": "f("}], 2, SP)
    assert g.layout == SquidLayout(tok.encode("# m"), [tok.encode("def f(x):"), tok.encode("y = 1")], "shared")
    assert g.prompt_token_ids == tok.encode("f(")


# ---- the trainer under the sampler's attention -----------------------------------------------
@pytest.mark.parametrize("convention,prefix", [("shared", PREFIX), ("concat", PREFIX), ("concat", [])])
def test_trainer_logprobs_equal_the_engines_with_documents(moe_path, trainer, convention, prefix):
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=256, squid_positions=convention)
    groups = sample_groups(llm, _prompts(prefix), 4, SP)
    # a plain group in the same batch: rows mixing causal and squid sequences stay exact
    groups += sample_groups(llm, [[60, 61, 62, 63]], 4, SP)
    batch = TrainBatch.from_groups(groups, [[0.0] * 4] * 5)
    m = _gap(trainer, batch)
    print(f"\n{convention} prefix={bool(prefix)}: {m}")
    assert m.num_tokens == batch.packed().num_trained_tokens >= 5 * 4
    assert m.max_abs <= 1e-5 and m.mean_abs <= 2e-6, m
    # the padded form's dense masks give the same numbers (what another trainer would use)
    with torch.no_grad():
        hidden = trainer.model.forward_masked(batch.input_ids, batch.position_ids, batch.dense_masks())
        lp = trainer.model.compute_logits(hidden[:, :-1]).log_softmax(-1).gather(2, batch.input_ids[:, 1:, None])[..., 0]
    trained = batch.loss_mask[:, 1:] > 0
    assert (lp[trained] - batch.rollout_logprobs[:, 1:][trained]).abs().max() <= 1e-5

    # controls: the same tokens under other attention are far off, so the bound above can fail
    flat = [Trajectory.start(g.layout.flat_tokens(g.prompt_token_ids)) for g in groups[:4] for _ in g.samples]
    for t, s in zip(flat, [s for g in groups[:4] for s in g.samples]):
        t.append_sample(s)
    assert _gap(trainer, TrainBatch.from_trajectories(flat, [0.0] * 16, [0] * 16)).max_abs > 1e-3  # full causal
    if convention == "concat" and prefix:
        # documents placed after the prefix without the prefix copies (the oracle's concat layout)
        g, s = groups[0], groups[0].samples[0]
        tokens, pos, group = layout_rows(g.layout.prefix, g.layout.documents, g.prompt_token_ids + s.token_ids, "concat")
        with torch.no_grad():
            h = trainer.model.forward_masked(torch.tensor([tokens]), torch.tensor([pos]), squid_mask(group)[None])[0]
            naive = trainer.model.compute_logits(h[-len(s.token_ids) - 1:-1]).log_softmax(-1)
        naive = naive.gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
        assert (naive - torch.tensor(s.logprobs)).abs().max() > 1e-3


def test_grpo_step_over_groups_with_documents(moe_path):
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=256, squid_positions="shared")
    groups = sample_groups(llm, _prompts(PREFIX, SUBSETS[:2]), 4, SP)
    batch = TrainBatch.from_groups(groups, [[1.0, 0.0, 0.0, -1.0]] * 2)
    trainer = Trainer(moe_path, TrainerConfig(lr=1e-3, grad_clip=None, max_tokens_per_row=256))
    weights = {n: w.clone() for n, w in trainer.named_weights()}
    before = trainer.score(batch)
    stats = trainer.step(batch)
    after = trainer.score(batch)
    assert stats["mismatch_max_abs"] <= 1e-5 and stats["num_trained_tokens"] == before.numel()
    assert any(not torch.equal(w, weights[n]) for n, w in trainer.named_weights())
    # stream order: group 0's samples then group 1's; advantage +1 on each first sample, -1 on each last
    lens = [len(s.token_ids) for g in groups for s in g.samples]
    ends = torch.tensor(lens).cumsum(0).tolist()
    delta = [(after - before)[e - n:e].sum().item() for n, e in zip(lens, ends)]
    assert delta[0] > 0 and delta[4] > 0, "positive advantage must raise the sample's logprob"
    assert delta[3] < 0 and delta[7] < 0, "negative advantage must lower it"
    # the new weights reach the engine; its cached documents are not reused under them
    computed = llm.stats()["documents_computed"]
    assert trainer.push_weights(llm) == 1
    again = sample_groups(llm, _prompts(PREFIX, SUBSETS[:2]), 4, SP)
    assert llm.stats()["documents_computed"] == computed + 4 + 1  # documents 0, 1, 2, 3 and the prefix
    assert again[0].samples[0].weight_version == 1
    assert _gap(trainer, TrainBatch.from_groups(again, [[0.0] * 4] * 2)).max_abs <= 1e-5


def test_multi_turn_trajectories_keep_their_documents(moe_path, trainer):
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=256, squid_positions="concat")
    layout = SquidLayout(PREFIX, [DOCS[1], DOCS[2]], "concat")
    trajs = [Trajectory.start([40, 41], layout), Trajectory.start([42], layout)]
    sp = SamplingParams(temperature=1.0, seed=2, max_tokens=6, ignore_eos=True)
    extend_trajectories(llm, trajs, sp)
    for t in trajs:
        t.append_context([30, 31, 32])
    extend_trajectories(llm, trajs, sp)
    assert llm.stats()["documents_computed"] == 3  # the prefix and both documents, once for both turns
    batch = TrainBatch.from_trajectories(trajs, [1.0, -1.0], [0, 0])
    m = _gap(trainer, batch)
    assert m.num_tokens == 24 and m.max_abs <= 1e-5, m
    shared = LLM(moe_path, dtype="float32", num_kv_blocks=64, squid_positions="shared")
    with pytest.raises(ValueError, match=r"trajectories\[0\].layout was sampled with 'concat'"):
        extend_trajectories(shared, trajs, sp)


# ---- bad input -------------------------------------------------------------------------------
def test_bad_prompts_are_refused_naming_the_field(moe_path):
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=64, max_documents=2)
    good = {"documents": [DOCS[0]], "prompt": [40]}
    cases = [
        ({"documents": [DOCS[0], []], "prompt": [40]}, r"documents\[1\] is empty"),
        ({"documents": [5], "prompt": [40]}, r"documents\[0\] must be a string or a list"),
        ({"documents": "abc", "prompt": [40]}, "documents must be a list"),
        ({"documents": [DOCS[0]], "prompt": []}, "prompt .* must not be empty"),
        ({"documents": [DOCS[0]]}, "'prompt' .* is required"),
        ({"documents": [DOCS[0]], "prompt": [40], "query": [1]}, r"unknown field\(s\) \['query'\]"),
        ({"documents": [[5, -1]], "prompt": [40]}, r"documents\[0\] token ids"),
        ({"prefix": [1.5], "documents": [DOCS[0]], "prompt": [40]}, "prefix token ids"),
        ({"documents": [[5, 999]], "prompt": [40]}, r"documents\[0\] token ids must be integers in \[0, 255\]"),
        ({"documents": [DOCS[0], DOCS[1], DOCS[2]], "prompt": [40]}, "max_documents"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            sample_groups(llm, [good, bad], 2, SP)
    assert llm.stats()["documents_computed"] == 0  # a bad prompt stops the whole batch before any work
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
    with pytest.raises(ValueError, match="squid convention"):
        SquidLayout([], [[1]], "rotated").dense_mask_and_positions(1)


def test_remote_client_refuses_text():
    """The client never tokenizes: text anywhere in a prompt is refused before anything is sent."""
    with RolloutClient("http://127.0.0.1:9") as client:
        with pytest.raises(ValueError, match="no tokenizer"):
            client.sample_groups(["text"], 2, SP)


@pytest.fixture(scope="module")
def nsa_path(tmp_path_factory) -> str:
    from sparse_helpers import make_nsa_checkpoint

    path = str(tmp_path_factory.mktemp("nsa-squid"))
    nsa = {"compress_block": 8, "compress_stride": 4, "select_block": 8, "top_n": 3, "init_blocks": 1,
           "local_blocks": 1, "window": 8, "compress_fn": "linear"}
    make_nsa_checkpoint(path, nsa, seed=4, max_position_embeddings=512)
    return path


@pytest.mark.parametrize("convention", ["shared", "concat"])
def test_trainer_logprobs_equal_the_engines_with_documents_on_an_nsa_model(nsa_path, convention):
    """An NSA model samples squid groups (each document attended by NSA's rules on its own keys,
    docs/nsa.md) and the trainer scores them under the same rule: rows of several sequences carry
    each token's segment and shift (`PackedBatch.row_segments`), and under `concat` a moved
    document is attended in the frame it was encoded in, as the engine's cached copy is."""
    llm = LLM(nsa_path, dtype="float32", num_kv_blocks=256, max_model_len=512, squid_positions=convention)
    groups = sample_groups(llm, _prompts(PREFIX), 4, SP)
    groups += sample_groups(llm, [[60, 61, 62, 63]], 4, SP)  # a plain group beside them
    batch = TrainBatch.from_groups(groups, [[0.0] * 4] * 5)
    trainer = Trainer(nsa_path, TrainerConfig(max_tokens_per_row=512))
    m = _gap(trainer, batch)
    assert m.num_tokens == batch.packed().num_trained_tokens >= 5 * 4
    assert m.max_abs <= 2e-5, m
    # the padded form: dense masks with each row's segments
    ids, shifts = batch.dense_segments()
    with torch.no_grad():
        hidden = trainer.model.forward_masked(batch.input_ids, batch.position_ids, batch.dense_masks(), segments=ids,
                                              segment_shifts=shifts)
        lp = trainer.model.compute_logits(hidden[:, :-1]).log_softmax(-1).gather(2, batch.input_ids[:, 1:, None])[..., 0]
    trained = batch.loss_mask[:, 1:] > 0
    assert (lp[trained] - batch.rollout_logprobs[:, 1:][trained]).abs().max() <= 2e-5
    if convention == "concat":  # control: the moved documents attended where they are placed
        with torch.no_grad():
            hidden = trainer.model.forward_masked(batch.input_ids, batch.position_ids, batch.dense_masks(), segments=ids)
            lp = trainer.model.compute_logits(hidden[:, :-1]).log_softmax(-1).gather(2, batch.input_ids[:, 1:, None])[..., 0]
        assert (lp[trained] - batch.rollout_logprobs[:, 1:][trained]).abs().max() > 1e-3


# 3 blocks: the 2 forced ones and one chosen by score, so the choice (and its summaries) is exercised
SPARSE = "topk:budget=24,block=8,dense_layers=1,summary=quest,init_blocks=1,local_blocks=1"


@pytest.mark.parametrize("convention", ["shared", "concat"])
def test_trainer_scores_a_sparse_attention_engine_with_its_rule(moe_path, convention):
    """An engine under sparse_attention (training-free top-k) samples plain and squid groups; a
    trainer given the same `sparse_attention` scores them under the same rule (each segment on its
    own keys), and one without it (dense attention) does not."""
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=256, squid_positions=convention, sparse_attention=SPARSE)
    groups = sample_groups(llm, _prompts(PREFIX), 4, SP)
    groups += sample_groups(llm, [[60 + i % 7 for i in range(40)]], 4, SP)  # a plain group, longer than the budget
    batch = TrainBatch.from_groups(groups, [[0.0] * 4] * 5)
    config = TrainerConfig.for_sampler(llm, max_tokens_per_row=512)  # the engine's spec, read from it
    assert config.sparse_attention == llm.engine.forward_options()["sparse_attention"] is not None
    m = _gap(Trainer(moe_path, config), batch)
    assert m.num_tokens == batch.packed().num_trained_tokens >= 5 * 4
    assert m.max_abs <= 2e-5, m
    assert _gap(Trainer(moe_path, TrainerConfig(max_tokens_per_row=512)), batch).max_abs > 1e-3  # dense: not the rule
    if convention == "concat":  # control: moved documents not attended in their encoded frame
        trainer = Trainer(moe_path, config)
        ids, shifts = batch.dense_segments()
        with torch.no_grad():
            hidden = trainer.model.forward_masked(batch.input_ids, batch.position_ids, batch.dense_masks(), sparse=trainer.sparse,
                                                  segments=ids)
            lp = trainer.model.compute_logits(hidden[:, :-1]).log_softmax(-1).gather(2, batch.input_ids[:, 1:, None])[..., 0]
        trained = batch.loss_mask[:, 1:] > 0
        assert (lp[trained] - batch.rollout_logprobs[:, 1:][trained]).abs().max() > 1e-3


def test_trainer_sparse_attention_is_validated():
    with pytest.raises(ValueError, match="budget"):
        TrainerConfig(sparse_attention="topk:budget=-3")


def test_trainer_config_for_a_served_sampler(moe_path):
    """`TrainerConfig.for_sampler` reads what the trainer must mirror from the servers' /v1/rl/info
    (sparse_attention, the MXFP8 weights -- experts, every linear, the lm_head -- and the dtype
    they are quantized from); a server that does not report them is refused."""
    from server_fixture import LiveServer

    with LiveServer(moe_path, dtype="float32", num_kv_blocks=128, sparse_attention=SPARSE, moe_quant="mxfp8") as srv, \
            RolloutClient(srv.url) as client:
        config = TrainerConfig.for_sampler(client, lr=1e-4)
        # with the rollout's params: their sampling fields, and the servers' EOS ids min_tokens masks
        controlled = TrainerConfig.for_sampler(client, SamplingParams(temperature=0.8, min_tokens=3, logit_bias={4: 1.0}))
        assert (controlled.temperature, controlled.min_tokens, controlled.logit_bias, controlled.eos_token_ids) == \
            (0.8, 3, {4: 1.0}, sorted(client.eos_token_ids)) and config.eos_token_ids == sorted(client.eos_token_ids)
    assert (config.sparse_attention, config.moe_quant, config.quantization, config.quant_dtype, config.lr) == \
        (parse_sparse_attention(SPARSE).spec(), "mxfp8", None, "float32", 1e-4)
    with LiveServer(moe_path, dtype="bfloat16", num_kv_blocks=128, quantization="mxfp8", quantize_lm_head=True) as srv, \
            RolloutClient(srv.url) as client:
        config = TrainerConfig.for_sampler(client)
    assert (config.moe_quant, config.quantization, config.quantize_lm_head, config.quant_dtype, config.dtype) == \
        (None, "mxfp8", True, "bfloat16", "float32")
    plain = TrainerConfig.for_sampler(LLM(moe_path, dtype="float32", num_kv_blocks=64))
    assert (plain.sparse_attention, plain.moe_quant, plain.quantization, plain.quantize_lm_head, plain.quant_dtype) == \
        (None, None, None, False, None)
    # a server older than these fields is refused, not read as dense
    client = RolloutClient("http://old-server")
    client._get = lambda url: {"weight_version": 0, "squid_positions": "concat", "eos_token_ids": [1]}
    with pytest.raises(ValueError, match="http://old-server does not report sparse_attention, moe_quant, quantization, "
                                         "quantize_lm_head, dtype"):
        TrainerConfig.for_sampler(client)
    assert client.squid_positions == "concat" and client.eos_token_ids == {1}
    # a Trainer refuses a spec the engine would refuse on this model
    with pytest.raises(ValueError, match="dense_layers = 7"):
        Trainer(moe_path, TrainerConfig(sparse_attention="topk:budget=32,block=8,dense_layers=7"))
