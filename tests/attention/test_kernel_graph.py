"""`native.graph`: a captured run of native kernels replays to the same results on new inputs, and
a capture refuses everything a replay would not reproduce."""
from __future__ import annotations

import platform
import sys
import threading

import numpy as np
import pytest
import torch

from cuttle.attention import native
from cuttle.attention.native import graph, rows
from cuttle.attention.native.fused import add_rms_norm, silu_mul
from cuttle.attention.native.gemm import linear

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernel library not built (no C compiler)")


C_REPLAY_HERE = sys.platform.startswith("linux") and platform.machine() == "x86_64"


@pytest.fixture(params=["c", "python"])
def replay_mode(request, monkeypatch):
    """Replays from C (csrc/graph_replay.c, where the platform's calling convention allows it) or
    one ctypes call per kernel."""
    monkeypatch.setattr(graph, "C_REPLAY", request.param == "c")
    return request.param


def _check_mode(kg: graph.KernelGraph, mode: str) -> None:
    assert kg.replays_in_c == (mode == "c" and C_REPLAY_HERE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_on_new_inputs_equals_a_fresh_eager_run(dtype: torch.dtype, replay_mode: str) -> None:
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
        _check_mode(kg, replay_mode)
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


def test_a_kernel_answering_differently_stops_the_replay(replay_mode: str) -> None:
    emb = torch.randn(10, 4)
    ids = torch.tensor([1, 2])
    ids2 = torch.tensor([3])
    with torch.inference_mode():
        with graph.capture() as kg:
            out = rows.gather(emb, ids)
            out2 = rows.gather(emb, ids2)
        _check_mode(kg, replay_mode)
        before, before2 = out.clone(), out2.clone()
        ids[1] = 10  # out of range: the kernel refuses (-3) where it returned 0 at capture
        ids2[0] = 5
        assert not kg.replay()
        assert torch.equal(out, before) and torch.equal(out2, before2)  # wrote nothing, ran nothing after


def test_a_handler_settles_a_call_and_the_replay_goes_on(replay_mode: str) -> None:
    """A call with an `on_result` handler that answers otherwise: the handler gets that call's
    result, and when it settles the case the replay runs the calls after it (from C, the replay
    resumes at the next call)."""
    emb = torch.randn(10, 4)
    ids, ids2, ids3 = torch.tensor([1]), torch.tensor([2]), torch.tensor([3])
    seen: list[int] = []

    def settle(result: int) -> bool:
        seen.append(result)
        return True

    with torch.inference_mode():
        with graph.capture() as kg:
            rows.gather(emb, ids)
            out2 = rows.gather(emb, ids2)
            graph.on_result(settle)  # the handler of the call just recorded: the second gather
            out3 = rows.gather(emb, ids3)
        _check_mode(kg, replay_mode)
        ids[0], ids2[0], ids3[0] = 11, 12, 7  # the first refuses (no handler): nothing after it runs
        assert not kg.replay() and seen == []
        ids[0] = 4
        assert kg.replay() and seen == [-3]  # the second settled (its result handed over), the third ran
        assert torch.equal(out3, emb[7:8])
        ids2[0], ids3[0] = 6, 13  # the second answers as at capture, the third refuses (no handler)
        assert not kg.replay() and seen == [-3]
        assert torch.equal(out2, emb[6:7])


def test_float_and_int_arguments_reach_the_kernel(replay_mode: str) -> None:
    """A kernel taking a float beside integers (the norm's eps), at a value that moves the result:
    the replay (from C: passed in a vector register, the integers in theirs and on the stack)
    equals the eager call on new inputs."""
    g = torch.Generator().manual_seed(4)
    x, r, w = (torch.randn(2, 8, generator=g) * 0.1 for _ in range(3))
    w = w[0]
    with torch.inference_mode():
        with graph.capture() as kg:
            res, n = add_rms_norm(x, r, w, 0.75)
        _check_mode(kg, replay_mode)
        x.copy_(torch.randn(2, 8, generator=g) * 0.1)
        assert kg.replay()
        want_res, want_n = add_rms_norm(x, r, w, 0.75)
        assert torch.equal(res, want_res) and torch.equal(n, want_n)
        assert not torch.equal(want_n, add_rms_norm(x, r, w, 1e-6)[1])  # eps matters here


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
