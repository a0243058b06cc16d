"""The native row-wise argmax (attention/csrc/argmax.c) the sampler's greedy pick uses: equal to
torch.argmax on every row, including ties (first index wins), NaN (its first index), -inf rows,
rows shorter than a vector and tails, and strided rows."""
from __future__ import annotations

import pytest
import torch

from cuttle.attention import native
from cuttle.attention.native.argmax import argmax


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if native.kernels().lib is None:
        pytest.skip("no native library here")


def _rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    n = 1000 + 37  # not a multiple of 16: a scalar tail
    x = torch.randn(15, n, generator=g)
    x[1] = 0.0  # all tied: index 0
    x[2, 500] = x[2, 17] = 1e9  # tie between lanes
    x[3, 1030] = x[3, 1031] = 1e9  # tie inside the tail
    x[4, 16] = x[4, 1030] = 1e9  # a vector index and a tail index tie: the vector one is first
    x[5, 700] = float("nan")
    x[5, 900] = float("nan")
    x[6, 1033] = float("nan")  # NaN in the tail
    x[7] = float("-inf")
    x[8, 3] = float("inf")
    x[9] = torch.arange(n, 0, -1, dtype=torch.float32)  # max at 0
    x[10] = torch.arange(n, dtype=torch.float32)  # max at the end
    x[11, 0] = float("nan")
    x[12, 8] = x[12, 16] = 1e9  # tie across the AVX2 loop's two accumulators: the later-lane one is first
    x[13] = -0.0  # -0.0 == 0.0: index 0 wins
    x[13, 20] = 0.0
    x[14, 1000] = x[14, 1001] = 1e9  # the same maximum in both accumulators' lanes, late in the row
    return x


def test_argmax_equals_torch() -> None:
    x = _rows()
    assert torch.equal(argmax(x), torch.argmax(x, dim=-1))


def test_argmax_vocab_rows() -> None:
    """Rows as long as Qwen's vocabulary (151936), the batch-1 pick, with the maximum anywhere."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 151936, generator=g)
    x[1, 151935] = 100.0
    x[2, 0] = 100.0
    x[3, 75000] = x[3, 140000] = 100.0
    assert torch.equal(argmax(x), torch.argmax(x, dim=-1))
    assert torch.equal(argmax(x[1:2]), torch.argmax(x[1:2], dim=-1))


@pytest.mark.parametrize("n", [1, 5, 15, 16, 17, 31, 32, 33])
def test_argmax_short_rows(n: int) -> None:
    x = torch.randn(7, n, generator=torch.Generator().manual_seed(n))
    x[0] = 1.0
    assert torch.equal(argmax(x), torch.argmax(x, dim=-1))


def test_argmax_strided_rows_and_fallbacks() -> None:
    wide = _rows()
    x = wide[:, 3:900]  # row stride != row length
    assert torch.equal(argmax(x), torch.argmax(x, dim=-1))
    xb = wide.bfloat16()  # not fp32: torch's own
    assert torch.equal(argmax(xb), torch.argmax(xb, dim=-1))
    assert torch.equal(argmax(wide.t()), torch.argmax(wide.t(), dim=-1))
