"""Squid documents under sliding windows (Mistral's on every layer; gpt-oss's on alternate layers,
with attention sinks), on the torch backend (native kernel and plain torch).

A window is measured in positions, the layout's: a document placed at P + offset sits there for
the query, so a query token at p sees the keys of every segment within W - 1 positions of it
(a document wholly before its window is neutral in its merge), and a document's own tokens, as
it is encoded, see the prefix within their window.

Oracle: one dense forward of the layout's row (`CausalLM.forward_masked` with
`SquidLayout.dense_mask_and_positions`), which masks windowed layers by position. The engine's
logprobs of every sampled token (and the runner-up) equal it in fp32, for documents computed by
the request (chunked, so document rows of one chunk see different parts of the prefix) and found
in the cache by a later request in another order, in both conventions. The documents run well
past the window and the oracle without its window differs, so the window is what is checked.
Where the backend does not window documents (Triton today) they are refused past W, naming it.
"""
from __future__ import annotations

import pytest
import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import ModelConfig
from cuttle.engine.models.loader import load_model
from cuttle.engine.squid import SquidLayout
from helpers import save_checkpoint
from moe_families import randomize_

DOCS = [[3 + (7 * i + 3) % 250 for i in range(29)], [3 + (11 * i + 5) % 250 for i in range(22)],
        [3 + (13 * i + 1) % 250 for i in range(37)]]
PREFIX = [5, 6, 7, 8, 9]
FIRST = {"prefix": PREFIX, "documents": [DOCS[0], DOCS[1]], "prompt": [40, 41, 42, 43]}
SECOND = {"prefix": PREFIX, "documents": [DOCS[2], DOCS[1], DOCS[0]], "prompt": [50, 51]}
NEW = 8


def _mistral():
    import transformers

    cfg = transformers.MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                                     rms_norm_eps=1e-6, sliding_window=12, tie_word_embeddings=False, eos_token_id=1,
                                     bos_token_id=None)
    return randomize_(transformers.MistralForCausalLM(cfg).float().eval(), 0.15, seed=7)


def _gpt_oss():
    import transformers

    cfg = transformers.GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=16, max_position_embeddings=512,
                                    tie_word_embeddings=False, eos_token_id=1, pad_token_id=0,
                                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                     "rope_theta": 150000.0})
    model = randomize_(transformers.GptOssForCausalLM(cfg).float().eval(), 0.15, seed=5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.5, 1.0)
    return model


@pytest.fixture(scope="module", params=["mistral", "gpt_oss"])
def windowed(request, tmp_path_factory):
    path, _ = save_checkpoint(str(tmp_path_factory.mktemp(request.param)), {"mistral": _mistral, "gpt_oss": _gpt_oss}[request.param]())
    mc = ModelConfig.from_pretrained(path)
    assert mc.sliding_window_layers and mc.sliding_window < min(len(d) for d in DOCS)
    ours = load_model(path, mc, torch.float32, torch.device("cpu"))
    unwindowed = ModelConfig.from_pretrained(path)
    unwindowed.sliding_window_layers = ()
    return path, ours, load_model(path, unwindowed, torch.float32, torch.device("cpu"))


def _run(path: str, positions: str, native: bool):
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=160, max_model_len=256, squid_positions=positions,
              max_num_batched_tokens=16)
    llm.engine.runner.backend.native = native
    assert llm.engine.max_model_len == 256  # past the window: documents are windowed, not capped
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=1)
    outs = [llm.generate([r], params, use_tqdm=False)[0].outputs[0] for r in (FIRST, SECOND)]
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]
    assert st["documents_hit"] >= 2  # the second request read the first one's documents from the cache
    return [(list(c.token_ids), [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]) for c in outs]


def _dense_logprobs(model, request: dict, tokens: list[int], positions: str) -> torch.Tensor:
    layout = SquidLayout(request["prefix"], request["documents"], positions)
    ctx, tail = layout.dense_context(), request["prompt"] + tokens[:-1]
    mask, pos = layout.dense_mask_and_positions(len(tail))
    with torch.no_grad():
        hidden = model.forward_masked(torch.tensor([ctx + tail]), pos[None], mask[None])[0]
        return model.compute_logits(hidden).log_softmax(-1)[len(ctx) + len(request["prompt"]) - 1 :]


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("positions", ["shared", "concat"])
def test_documents_under_windows_equal_one_dense_forward(windowed, positions, native):
    path, model, unwindowed = windowed
    outs = _run(path, positions, native)
    apart = 0.0
    for request, (tokens, lps) in zip([FIRST, SECOND], outs):
        ref = _dense_logprobs(model, request, tokens, positions)
        for step, d in enumerate(lps):
            for t, lp in d.items():
                assert abs(lp - ref[step, t].item()) <= 2e-5, (positions, step, t, lp, ref[step, t].item())
        full = _dense_logprobs(unwindowed, request, tokens, positions)
        apart = max(apart, (full - ref).abs().max().item())
    assert apart > 1e-2  # without its window the oracle says otherwise: the window is what was checked


def test_backends_without_windowed_documents_refuse_them(windowed, monkeypatch):
    """Triton windows one-segment steps but not documents yet: past W they are refused at
    admission, naming the backend (the CPU cannot run Triton's kernels; the refusal comes first)."""
    path, _, _ = windowed
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=128)
    monkeypatch.setattr(llm.engine.runner.backend, "name", "triton")
    with pytest.raises(ValueError, match="need attention_backend='torch'; the triton backend does not window documents"):
        llm.generate([FIRST], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
