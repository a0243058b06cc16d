"""Segments through the model's attention call sites (the embedded default model, fp32, torch
backend): a query over a cached document segment equals one sequence that prefills document +
query (the document is a prefix there, so the math is the same), and a document encoded at
positions 0.. and attended with rope_delta = d equals the same prefill started at position d
(translation invariance: pure RoPE, no absolute position input, so only the keys' rotation
changes, and the backend applies it to the query)."""
from __future__ import annotations

import pytest
import torch

from cuttle.attention import native_attention
from cuttle.attention.metadata import AttentionMetadata, KVSegment, SeqLayout
from cuttle.attention.torch_backend import TorchAttentionBackend
from cuttle.engine.config import ModelConfig
from cuttle.engine.default_model import default_model_path
from cuttle.engine.models import load_model

BS = 8
NATIVE = [True, False] if native_attention.available() else [False]


@pytest.fixture(scope="module")
def model():
    path = default_model_path()
    return load_model(path, ModelConfig.from_pretrained(path), torch.float32, torch.device("cpu")).eval()


def _caches(model, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cfg = model.cfg
    shape = (num_blocks, BS, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]


@torch.inference_mode()
def _step(model, backend, caches, tokens: list[int], positions: list[int], layouts: list[SeqLayout]) -> torch.Tensor:
    meta = AttentionMetadata.build(layouts, BS, "cpu", model.rope)
    backend.begin_step(meta)
    return model(torch.tensor(tokens), torch.tensor(positions), caches, meta, backend)


@pytest.mark.parametrize("native", NATIVE, ids=lambda n: "native" if n else "torch")
@pytest.mark.parametrize("delta", [0, 11])
def test_document_segment_equals_prefix_prefill(model, native: bool, delta: int) -> None:
    g = torch.Generator().manual_seed(delta)
    vocab = model.cfg.vocab_size
    doc = torch.randint(1, vocab, (21,), generator=g).tolist()  # ends mid-block (21 = 2 * 8 + 5)
    query = torch.randint(1, vocab, (6,), generator=g).tolist()
    n, m = len(doc), len(query)
    backend = TorchAttentionBackend(native=native)

    # reference: one sequence, document then query, positions delta .. delta + n + m - 1
    ref_caches = _caches(model, 8)
    ref_blocks = [5, 2, 7, 0]
    ref = _step(model, backend, ref_caches, doc + query, list(range(delta, delta + n + m)),
                [SeqLayout(n + m, [KVSegment(ref_blocks, n + m, causal=True)])])[n:]

    # segmented: the document prefilled alone at positions 0 .. n-1 (blocks 3, 6, 1), then the
    # query attends to it as a full segment placed at delta, and to itself causally (blocks 4, 0)
    caches = _caches(model, 8)
    doc_blocks = [3, 6, 1]
    _step(model, backend, caches, doc, list(range(n)), [SeqLayout(n, [KVSegment(doc_blocks, n, causal=True)])])
    own = [4, 0]
    # the query in two steps: a 4-token chunk, then 2 more (chunked prefill over the segment)
    layouts = lambda q, total: [SeqLayout(q, [KVSegment(doc_blocks, n, causal=False, rope_delta=delta),  # noqa: E731
                                              KVSegment(own, total, causal=True)])]
    h1 = _step(model, backend, caches, query[:4], list(range(delta + n, delta + n + 4)), layouts(4, 4))
    h2 = _step(model, backend, caches, query[4:], list(range(delta + n + 4, delta + n + m)), layouts(2, 6))
    out = torch.cat([h1, h2])
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-5, err  # measured ~4e-7 (without the query rotation, delta 11: 0.24)
