"""Sliding-window attention in the torch backend (`TorchAttentionBackend.set_windows`): a query at
position p sees keys p - W + 1 .. p. Checked against the float64 dense oracle with the window's
mask, on the native kernel (fp32 scalar loops; bf16 fast items, row-major and token-major) and the
plain-torch paths (decode gather, SDPA chunks), with windows that start inside a block, on a
block's first key, and cover everything; a layer without a window is untouched."""
from __future__ import annotations

import pytest
import torch

from attention_cases import Case, build_batch, give_back_behind_window, naive_attention
from cuttle.attention import native, native_attention
from cuttle.attention.torch_backend import TorchAttentionBackend

CASES = (
    Case("mixed", ((0, 7), (37, 1), (20, 13), (15, 1), (0, 1), (61, 1)), 8, 2, 32, 16),
    Case("long_chunks", ((0, 70), (40, 30), (90, 1), (3, 40)), 4, 2, 64, 8),  # chunks past the SDPA limit below
    Case("decodes_d128", tuple((n, 1) for n in (5, 33, 64, 100, 127)), 4, 1, 128, 16),
)
WINDOWS = (1, 5, 16, 17, 48, 500)


def _out(backend: TorchAttentionBackend, batch, layer: int) -> torch.Tensor:
    backend.begin_step(batch.meta)
    return backend.forward(layer, batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale)[0]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("path", ["native", "torch"])
def test_windowed_layers_equal_the_windowed_oracle(case: Case, window: int, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "native" and not native_attention.available():
        pytest.fail("the native kernel must build here (a C compiler is part of the test image)")
    from cuttle.attention import torch_backend

    monkeypatch.setattr(torch_backend, "NATIVE_PREFILL_MAX_QLEN", 32)  # longer chunks go through SDPA
    batch = build_batch(case, junk=None, seed=window)
    backend = TorchAttentionBackend(native=path == "native")
    backend.set_windows({1: window})
    want = naive_attention(batch, window)
    got = _out(backend, batch, 1).double()
    assert (got - want).abs().max().item() < 2e-5
    # layer 0 has no window: plain causal attention, as before
    assert (_out(backend, batch, 0).double() - naive_attention(batch)).abs().max().item() < 2e-5


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("window", (1, 5, 16, 17))
@pytest.mark.parametrize("path", ["native", "torch"])
def test_blocks_given_back_behind_the_window_are_never_read(case: Case, window: int, path: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables whose blocks before each sequence's window are given back (engine/block_manager.py),
    their KV NaN: the native rows start at their window's block and never read a given-back entry
    (here each names a block of NaN); the plain-torch decode gather reads every table entry under
    its mask, NULL_BLOCK as block 0, so there the entries are NULL_BLOCK and the given-back KV
    large but finite."""
    from cuttle.attention import torch_backend

    monkeypatch.setattr(torch_backend, "NATIVE_PREFILL_MAX_QLEN", 32)
    batch = build_batch(case, junk=None, seed=window)
    native_path = path == "native"
    assert give_back_behind_window(batch, window, float("nan") if native_path else 1e4, poison_entries=native_path) > 0
    backend = TorchAttentionBackend(native=path == "native")
    backend.set_windows({1: window})
    got = _out(backend, batch, 1).double()
    assert (got - naive_attention(batch, window)).abs().max().item() < 2e-5


@pytest.mark.parametrize("row_major", [1, 0])
@pytest.mark.parametrize("window", (5, 16, 17))
def test_bf16_fast_items_skip_the_keys_before_the_window(row_major: int, window: int) -> None:
    """The bf16 items (the AVX512-BF16 one in both layouts, or the AVX2 one) weigh the skipped keys
    exactly 0: within bf16 rounding of the oracle, and bit-identical to the scalar loops' result
    rounded the same way is not asked (they sum otherwise)."""
    lib = native.kernels().lib
    case = CASES[2]
    batch = build_batch(case, junk=None, seed=window, dtype=torch.bfloat16)
    backend = TorchAttentionBackend()
    backend.set_windows({0: window})
    want = naive_attention(batch, window)
    try:
        lib.paged_decode_set_row_major(row_major)
        got = _out(backend, batch, 0).double()
        assert lib.paged_decode_last_call_fast() == 1  # the fast item ran, not the scalar loops
    finally:
        lib.paged_decode_set_row_major(1)
    assert (got - want).abs().max().item() < 2e-2


def test_a_window_covering_every_key_changes_nothing() -> None:
    batch = build_batch(CASES[0], junk=None, seed=3)
    plain, windowed = TorchAttentionBackend(), TorchAttentionBackend()
    windowed.set_windows({0: max(batch.meta.seq_lens_cpu)})
    assert torch.equal(_out(plain, batch, 0), _out(windowed, batch, 0))
    with pytest.raises(ValueError, match="positive integers"):
        windowed.set_windows({0: 0})
