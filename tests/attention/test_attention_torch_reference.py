"""The torch backend (the oracle of every other backend) against a naive dense causal attention
computed from scratch, and the naive oracle itself against SDPA on the cases SDPA can express."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attention_cases import CASES, Case, build_batch, cache_matches, naive_attention
from cuttle.attention.backend import get_backend
from cuttle.attention.torch_backend import TorchAttentionBackend


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_torch_backend_matches_naive(case: Case) -> None:
    batch = build_batch(case, junk=None)
    backend = TorchAttentionBackend()
    backend.begin_step(batch.meta)
    out, _ = backend.forward(0, batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert out.shape == batch.q.shape and out.dtype == torch.float32
    assert cache_matches(batch)
    err = (out.double() - naive_attention(batch)).abs().max().item()
    assert err <= 1e-5, err


def test_torch_backend_reuses_plan_across_layers() -> None:
    """Two layers of one step share the plan; each layer's own cache gets its own K/V."""
    case = CASES[0]
    layer0, layer1 = build_batch(case, junk=None, seed=1), build_batch(case, junk=None, seed=1)
    layer1.q.mul_(-0.5)
    backend = TorchAttentionBackend()
    backend.begin_step(layer0.meta)
    for layer, batch in enumerate((layer0, layer1)):
        out, _ = backend.forward(layer, batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, layer0.meta, batch.scale)
        assert (out.double() - naive_attention(batch)).abs().max().item() <= 1e-5


def test_naive_oracle_matches_sdpa_on_fresh_prompt() -> None:
    """No cached prefix and one sequence: the oracle's causal offset reduces to SDPA's is_causal."""
    case = Case("fresh", ((0, 13),), 4, 4, 16, 8)
    batch = build_batch(case, junk=None)
    ref = F.scaled_dot_product_attention(
        batch.q.transpose(0, 1).double(), batch.k.transpose(0, 1).double(), batch.v.transpose(0, 1).double(),
        is_causal=True, scale=batch.scale,
    ).transpose(0, 1)
    assert (naive_attention(batch) - ref).abs().max().item() <= 1e-12


def test_naive_oracle_decode_row_sees_whole_context() -> None:
    """A decode row attends to every cached token: plain softmax over all keys."""
    case = Case("decode", ((9, 1),), 2, 1, 16, 4)
    batch = build_batch(case, junk=None)
    k, v = batch.full_k[0][:, 0].double(), batch.full_v[0][:, 0].double()
    for h in range(2):
        expected = torch.softmax(batch.q[0, h].double() @ k.T * batch.scale, -1) @ v
        assert torch.allclose(naive_attention(batch)[0, h], expected, atol=1e-12)


def test_get_backend_resolves_torch_on_cpu() -> None:
    assert get_backend("auto", torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError, match="attention_backend"):
        get_backend("nope", torch.device("cpu"))
