"""`native.graph`: a captured run of native kernels replays to the same results on new inputs, and
a capture refuses everything a replay would not reproduce."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from cuttle.attention import native
from cuttle.attention.native import graph, rows
from cuttle.attention.native.fused import add_rms_norm, silu_mul
from cuttle.attention.native.gemm import linear

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernel library not built (no C compiler)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_on_new_inputs_equals_a_fresh_eager_run(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(50, 32, generator=g).to(dtype)
    w13 = torch.randn(128, 32, generator=g).to(dtype)
    w2 = torch.randn(32, 64, generator=g).to(dtype)
    nw = torch.randn(32, generator=g).to(dtype)
    x = torch.randn(3, 32, generator=g).to(dtype)
    ids = torch.tensor([4, 9, 49])

    def step() -> torch.Tensor:
        r, n = add_rms_norm(x, rows.gather(emb, ids), nw, 1e-6)
        return rows.to_float(linear(silu_mul(linear(n, w13)), w2))

    with torch.inference_mode():
        with graph.capture() as kg:
            out = step()
        assert kg.names[:2] == ["gather_rows", "fused_rms_norm"] and kg.names[3] == "fused_silu_mul"
        assert kg.names[-1] == ("widen_bf16_rows" if dtype == torch.bfloat16 else kg.names[4]) and len(kg) >= 5
        for seed in (1, 2):
            x.copy_(torch.randn(3, 32, generator=torch.Generator().manual_seed(seed)))
            ids.copy_(torch.tensor([seed, 2 * seed, 3 * seed]))
            assert kg.replay()
            assert torch.equal(out, step())


def test_weights_packed_on_first_use_inside_a_capture_are_not_repacked_by_its_replays() -> None:
    """A weight packed for the first time inside a capture (a dense bf16 weight where the packed
    GEMM runs, routed experts everywhere) is packed and cached then, but the pack is not part of the
    graph: every replay reads the cached copy."""
    from cuttle.attention.native import moe

    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    w13 = torch.randn(4, 16, 32, generator=g).to(torch.bfloat16)
    x = torch.randn(2, 32, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        with graph.capture() as kg:
            y = linear(x, w)
            p13 = moe.packed_w13(w13, moe.plain_format(w13.dtype))
        packing = [n for n in kg.names if "pack" in n and n != "packed_gemm_bf16"]  # the GEMM itself is a step's work
        assert not packing and len(kg) >= 1, kg.names
        assert moe.packed_w13(w13, moe.plain_format(w13.dtype)) is p13  # cached on the weight by the capture's run
        want = y.clone()
        y.zero_()
        assert kg.replay() and torch.equal(y, want)


def test_a_kernel_answering_differently_stops_the_replay() -> None:
    emb = torch.randn(10, 4)
    ids = torch.tensor([1, 2])
    with torch.inference_mode():
        with graph.capture() as kg:
            out = rows.gather(emb, ids)
        before = out.clone()
        ids[1] = 10  # out of range: the kernel refuses (-3) where it returned 0 at capture
        assert not kg.replay()
        assert torch.equal(out, before)  # and wrote nothing


ZERO = torch.zeros(1, dtype=torch.int64)


@pytest.mark.parametrize("body, what", [
    (lambda x: x + 1, "aten.add"),
    (lambda x: x.add_(1), "aten.add_"),
    (lambda x: x.index_copy_(0, ZERO, x[:1]), "index_copy_"),
    (lambda x: torch.tensor([1.0]), "lift_fresh"),
    (lambda x: float(x[0, 0]), "item"),
    (lambda x: x.clone(), "clone"),
    (lambda x: torch.zeros(3), "zeros"),
])
def test_torch_compute_inside_a_capture_breaks_it(body, what: str) -> None:
    x = torch.randn(4, 4)
    with torch.inference_mode(), pytest.raises(graph.GraphBreak, match=what):
        with graph.capture():
            body(x)


def test_views_and_allocation_are_allowed() -> None:
    x = torch.randn(4, 6)
    with torch.inference_mode():
        with graph.capture() as kg:
            y = x.view(2, 12).reshape(4, 6)[1:].transpose(0, 1).unsqueeze(0)
            torch.empty(3)
            torch.empty_like(x)
    assert len(kg) == 0 and y.shape == (1, 6, 3)


def test_an_address_outside_every_tensor_breaks_the_capture() -> None:
    buf = np.zeros((2, 8), dtype=np.uint16)  # memory no tensor of the capture owns
    out = torch.empty(2, 8)
    with pytest.raises(graph.GraphBreak, match="points at memory"):
        with graph.capture():
            native.kernels().lib.widen_bf16_rows(buf.ctypes.data, 8, out.data_ptr(), 8, 2, 8)


def test_capture_is_per_thread_and_restores_data_ptr() -> None:
    real = torch.Tensor.data_ptr
    seen: list[object] = []
    t = threading.Thread(target=lambda: seen.append(native.kernels().lib))
    with graph.capture():
        assert native.kernels().lib is not native.kernels.__globals__["_current"].lib
        t.start()
        t.join()
    assert seen == [native.kernels().lib]  # another thread kept the plain library
    assert torch.Tensor.data_ptr is real
    with pytest.raises(graph.GraphBreak):
        with graph.capture():
            torch.zeros(1)
    assert torch.Tensor.data_ptr is real and native.kernels() is native.kernels.__globals__["_current"]
