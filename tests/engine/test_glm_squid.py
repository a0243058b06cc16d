"""Squid documents on GLM-4.5 (partial rotary: only the first half of each q/k head is rotated).

A document moved by a rope delta (`concat`) is attended with the query rotated by -delta over the
first rotary dims only (`AttentionMetadata`'s rotation, `rotate_partial`); rotating the whole head,
or none of it, would change every logprob after the first document. Oracle: one dense forward of
the layout's row (`CausalLM.forward_masked`, checked against transformers in
test_moe_models.py), with no paging, cache or rotation of the query. The engine's logprobs of
every sampled token (and the runner-up) equal it in fp32, for documents computed by the request
and found in the cache by a later request in another order, in both conventions.
"""
from __future__ import annotations

import pytest
import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import ModelConfig
from cuttle.engine.models.loader import load_model
from cuttle.engine.squid import SquidLayout
from helpers import write_tokenizer
from moe_families import family_model

DOCS = [[3 + (7 * i + 3) % 250 for i in range(29)], [3 + (11 * i + 5) % 250 for i in range(22)],
        [3 + (13 * i + 1) % 250 for i in range(37)]]
FIRST = {"prefix": [5, 6, 7], "documents": [DOCS[0], DOCS[1]], "prompt": [40, 41, 42, 43]}
SECOND = {"prefix": [5, 6, 7], "documents": [DOCS[2], DOCS[1], DOCS[0]], "prompt": [50, 51]}
NEW = 8


@pytest.fixture(scope="module", params=["glm4_moe", "glm4_moe_air"])
def glm(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    family_model(request.param).save_pretrained(path)
    write_tokenizer(path, 256)
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.rotary_dim < cfg.head_dim
    return path, load_model(path, cfg, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("positions", ["shared", "concat"])
def test_glm_documents_equal_one_dense_forward(glm, positions):
    path, model = glm
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=160, max_model_len=256, squid_positions=positions)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=1)
    outs = [llm.generate([r], params, use_tqdm=False)[0].outputs[0] for r in (FIRST, SECOND)]
    st = llm.stats()
    assert st["documents_hit"] >= 2  # the second request read the first one's documents from the cache
    assert st["kv_blocks_free"] == st["kv_blocks_total"]
    for request, c in zip((FIRST, SECOND), outs):
        layout = SquidLayout(request["prefix"], request["documents"], positions)
        ctx, tail = layout.dense_context(), request["prompt"] + list(c.token_ids)[:-1]
        mask, pos = layout.dense_mask_and_positions(len(tail))
        with torch.no_grad():
            hidden = model.forward_masked(torch.tensor([ctx + tail]), pos[None], mask[None])[0]
            ref = model.compute_logits(hidden).log_softmax(-1)[len(ctx) + len(request["prompt"]) - 1 :]
        for step, d in enumerate(c.logprobs):
            for t, lp in d.items():
                assert abs(lp.logprob - ref[step, t].item()) <= 2e-5, (positions, step, t, lp.logprob, ref[step, t].item())
