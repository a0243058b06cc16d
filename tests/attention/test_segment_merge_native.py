"""The native rotation and merge of segmented steps (`cuttle.attention.native.segments`) against
the torch code they replace: `rotate_partial` bit for bit (fp32 and bf16, partial rotary dims),
and `merge_lse_rows` within an ulp-level bound (exp / log are the C library's), with parts that
are empty (lse -inf, o NaN: weight 0), rows with no part at all (o 0, lse -inf), rows of many
parts in any order, and bf16 output rounded once; under autograd they decline (the caller's
torch path runs)."""
from __future__ import annotations

import pytest
import torch

from cuttle.attention.merge import merge_lse_rows
from cuttle.attention.native import kernels
from cuttle.attention.native.segments import merge_parts, rotate_rows_
from cuttle.attention.rope import rotate_partial

pytestmark = pytest.mark.skipif(kernels().lib is None, reason="the native kernel library did not build here (no C compiler)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("half", [4, 8])
def test_rotate_rows_is_rotate_partial_bit_for_bit(dtype, half):
    g = torch.Generator().manual_seed(half)
    x = torch.randn(9, 3, 16, generator=g).to(dtype)
    rows = torch.tensor([7, 0, 4, 2], dtype=torch.int64)
    angle = torch.randn(4, 1, half, generator=g) * 3
    cos, sin = angle.cos(), angle.sin()
    ref = x.clone()
    ref[rows] = rotate_partial(ref[rows], cos, sin)
    assert rotate_rows_(x, rows, cos, sin)
    assert torch.equal(x, ref)


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    heads, dim, num_rows = 4, 24, 6
    # row 3 has no part; row 0 many; parts listed out of row order
    rows = torch.tensor([0, 2, 0, 5, 1, 0, 2, 4, 0, 5, 1], dtype=torch.int64)
    o = torch.randn(len(rows), heads, dim, generator=g)
    lse = torch.randn(len(rows), heads, generator=g) * 4
    lse[1, 2] = float("-inf")  # an empty part: its o must not count, NaN or not
    o[1, 2] = float("nan")
    lse[7] = float("-inf")  # row 4's only part empty: o 0, lse -inf
    o[7] = float("nan")
    by_row = [[v for v in range(len(rows)) if rows[v] == r] for r in range(num_rows)]
    ptr = torch.tensor([0] + list(torch.tensor([len(b) for b in by_row]).cumsum(0)), dtype=torch.int64)
    idx = torch.tensor([v for b in by_row for v in b], dtype=torch.int64)
    return o, lse, rows, ptr, idx, num_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_parts_equals_merge_lse_rows(dtype):
    o, lse, rows, ptr, idx, num_rows = _case(3)
    ref_o, ref_lse = merge_lse_rows(o, lse, rows, num_rows)
    merged = merge_parts(o, lse, ptr, idx, dtype)
    assert merged is not None
    out, out_lse = merged
    assert out.dtype == dtype and out_lse.dtype == torch.float32
    assert not out.isnan().any()
    assert torch.equal(out[3].float(), torch.zeros_like(out[3].float())) and torch.isneginf(out_lse[3]).all()
    assert torch.equal(out[4].float(), torch.zeros_like(out[4].float())) and torch.isneginf(out_lse[4]).all()
    assert torch.equal(torch.isneginf(out_lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert (out_lse[fin] - ref_lse[fin]).abs().max().item() <= 2e-6 * max(1.0, ref_lse[fin].abs().max().item())
    if dtype == torch.float32:
        assert (out - ref_o).abs().max().item() <= 1e-6
    else:  # one rounding of a value within an fp32 ulp or two of torch's: at most one bf16 step apart
        step = ref_o.abs().clamp_min(1e-30) * 2**-7
        assert ((out.float() - ref_o).abs() <= step).all()


def test_kernels_decline_under_autograd():
    """Under autograd both kernels decline (None / False): their caller (`SegmentBatch`) then runs
    the torch code, which autograd follows."""
    o, lse, rows, ptr, idx, num_rows = _case(5)
    o = o.nan_to_num(0.0).requires_grad_(True)
    assert merge_parts(o, lse, ptr, idx, torch.float32) is None
    assert not rotate_rows_(torch.zeros(2, 1, 4, requires_grad=True), torch.tensor([0]), torch.ones(1, 1, 2), torch.zeros(1, 1, 2))
