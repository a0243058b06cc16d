"""Squid documents on an MLA model (DeepSeek-V3): its cache holds decompressed per-head K and V,
so documents are attended part by part like any model's; the query is rotated by -delta over the
first rotary dims for a document moved by a rope delta (`concat`), which is why MLA's q and k hold
their rotary dims first (engine/models/mla.py).

Oracle: one dense forward of the layout's row (`CausalLM.forward_masked` with
`SquidLayout.dense_mask_and_positions`): no paging, no cache, no rotation of the query. The
engine's logprobs of every sampled token (and the runner-up) equal it in fp32, for documents
computed by the request and found in the cache by a later request in another order, in both
conventions, with DeepSeek's interleaved rope under YaRN (mscale in the logits) and with a
full-rank q and plain rope.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import ModelConfig
from cuttle.engine.models.loader import load_model
from cuttle.engine.squid import SquidLayout
from helpers import write_tokenizer

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
              eos_token_id=1, bos_token_id=None, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
              n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8,
              qk_nope_head_dim=16)
VARIANTS = {
    # q through the LoRA bottleneck, interleaved rope, YaRN with mscale (the logits scaled too)
    "lora_q_yarn": dict(q_lora_rank=24, v_head_dim=16, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "mscale": 1.0,
        "mscale_all_dim": 1.0}),
    # full-rank q, plain rope, V wider than K
    "full_q": dict(q_lora_rank=None, v_head_dim=32, rope_interleave=False),
}
DOCS = [[3 + (7 * i + 3) % 250 for i in range(29)], [3 + (11 * i + 5) % 250 for i in range(22)],
        [3 + (13 * i + 1) % 250 for i in range(37)]]
PREFIX = [5, 6, 7]
FIRST = {"prefix": PREFIX, "documents": [DOCS[0], DOCS[1]], "prompt": [40, 41, 42, 43]}
SECOND = {"prefix": PREFIX, "documents": [DOCS[2], DOCS[1], DOCS[0]], "prompt": [50, 51]}
NEW = 8


@pytest.fixture(scope="module", params=list(VARIANTS))
def mla(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"mla-{request.param}"))
    torch.manual_seed(11)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**COMMON, **VARIANTS[request.param]))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    write_tokenizer(path, 256)
    ours = load_model(path, ModelConfig.from_pretrained(path), torch.float32, torch.device("cpu"))
    return path, ours


def _run(path: str, positions: str, requests: list[dict]):
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=160, max_model_len=256, squid_positions=positions)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=1)
    outs = [llm.generate([r], params, use_tqdm=False)[0].outputs[0] for r in requests]
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]
    return [(list(c.token_ids), [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]) for c in outs], st


@pytest.mark.parametrize("positions", ["shared", "concat"])
def test_mla_documents_equal_one_dense_forward(mla, positions):
    path, model = mla
    outs, st = _run(path, positions, [FIRST, SECOND])
    assert st["documents_hit"] >= 2  # the second request read the first one's documents from the cache
    for request, (tokens, lps) in zip([FIRST, SECOND], outs):
        layout = SquidLayout(request["prefix"], request["documents"], positions)
        ctx, tail = layout.dense_context(), request["prompt"] + tokens[:-1]
        mask, pos = layout.dense_mask_and_positions(len(tail))
        with torch.no_grad():
            hidden = model.forward_masked(torch.tensor([ctx + tail]), pos[None], mask[None])[0]
            ref = model.compute_logits(hidden).log_softmax(-1)[len(ctx) + len(request["prompt"]) - 1 :]
        for step, d in enumerate(lps):
            for t, lp in d.items():
                assert abs(lp - ref[step, t].item()) <= 2e-5, (positions, step, t, lp, ref[step, t].item())
