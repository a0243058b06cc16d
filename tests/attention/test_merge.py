"""merge_lse / merge_lse_rows (attention/merge.py): merging per-part (o, lse) equals attention over
the concatenated keys (float64 reference), does not depend on the order of the parts, treats an
empty part (lse = -inf, whatever its o holds) as neutral, and gives o = 0, lse = -inf (no NaN)
when every part is empty."""
from __future__ import annotations

import pytest
import torch

from cuttle.attention.merge import merge_lse, merge_lse_rows


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [R, H, D], k/v [N, H, D] -> o [R, H, D], lse [R, H] in float64 (N may be 0)."""
    scores = torch.einsum("rhd,nhd->rhn", q.double(), k.double()) * q.shape[-1] ** -0.5
    if k.shape[0] == 0:
        return torch.zeros(q.shape, dtype=torch.float64), torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("rhn,nhd->rhd", torch.exp(scores - lse[..., None]), v.double()), lse


def _parts(seed: int, sizes: list[int], rows: int = 5, heads: int = 3, dim: int = 16):
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    q = torch.randn(rows, heads, dim, generator=g) * 2  # spread scores so the weights differ widely
    k = torch.randn(n, heads, dim, generator=g)
    v = torch.randn(n, heads, dim, generator=g)
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    parts = [_attend(q, k[a:b], v[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    return q, k, v, parts


@pytest.mark.parametrize("sizes", [[7], [3, 9, 1], [16, 0, 5, 2], [1, 1, 1, 1, 1, 1]])
def test_merge_equals_attention_over_concatenated_keys(sizes: list[int]) -> None:
    q, k, v, parts = _parts(0, sizes)
    ref_o, ref_lse = _attend(q, k, v)
    o, lse = merge_lse([p[0].float() for p in parts], [p[1].float() for p in parts])
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    assert (o.double() - ref_o).abs().max().item() <= 1e-6
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-5


def test_merge_is_order_invariant() -> None:
    _, _, _, parts = _parts(1, [4, 11, 0, 6, 2])
    o, lse = merge_lse([p[0].float() for p in parts], [p[1].float() for p in parts])
    for perm in ([4, 3, 2, 1, 0], [2, 0, 4, 1, 3], [1, 4, 0, 3, 2]):
        po, plse = merge_lse([parts[i][0].float() for i in perm], [parts[i][1].float() for i in perm])
        assert (po - o).abs().max().item() <= 1e-6
        assert (plse - lse).abs().max().item() <= 1e-6


@pytest.mark.parametrize("junk", [0.0, float("nan"), float("inf"), 1e30])
def test_empty_part_is_neutral_whatever_its_output(junk: float) -> None:
    _, _, _, parts = _parts(2, [5, 8])
    o, lse = merge_lse([p[0].float() for p in parts], [p[1].float() for p in parts])
    empty_o = torch.full_like(parts[0][0], junk).float()
    empty_lse = torch.full_like(parts[0][1], float("-inf")).float()
    for where in (0, 1, 2):
        os_ = [p[0].float() for p in parts]
        ls_ = [p[1].float() for p in parts]
        os_.insert(where, empty_o)
        ls_.insert(where, empty_lse)
        eo, e_lse = merge_lse(os_, ls_)
        assert torch.isfinite(eo).all()
        assert (eo - o).abs().max().item() <= 1e-6 and (e_lse - lse).abs().max().item() <= 1e-6


def test_all_empty_gives_zero_output_and_minus_inf() -> None:
    o_parts = [torch.full((3, 2, 8), float("nan")), torch.zeros(3, 2, 8)]
    lse_parts = [torch.full((3, 2), float("-inf"))] * 2
    o, lse = merge_lse(o_parts, lse_parts)
    assert torch.equal(o, torch.zeros(3, 2, 8))
    assert torch.isneginf(lse).all()


def test_one_part_is_returned_unchanged() -> None:
    _, _, _, parts = _parts(3, [9])
    o, lse = merge_lse([parts[0][0].float()], [parts[0][1].float()])
    assert torch.allclose(o, parts[0][0].float(), rtol=0, atol=1e-7) and torch.equal(lse, parts[0][1].float())


def test_merge_rows_matches_merge_per_row() -> None:
    """Each output row gets its own number of parts, given in a shuffled order; a row with no part
    at all comes out as o = 0, lse = -inf."""
    g = torch.Generator().manual_seed(4)
    counts = [3, 1, 0, 4, 2]
    o_rows, lse_rows, owners = [], [], []
    expected = []
    for r, c in enumerate(counts):
        o = torch.randn(c, 2, 8, generator=g)
        lse = torch.randn(c, 2, generator=g) * 3
        if c > 1:
            lse[0, 1] = float("-inf")  # one empty head-part
        o_rows.append(o)
        lse_rows.append(lse)
        owners += [r] * c
        expected.append(merge_lse(o, lse) if c else (torch.zeros(2, 8), torch.full((2,), float("-inf"))))
    perm = torch.randperm(sum(counts), generator=g)
    o_all, lse_all = torch.cat(o_rows)[perm], torch.cat(lse_rows)[perm]
    rows = torch.tensor(owners)[perm]
    o, lse = merge_lse_rows(o_all, lse_all, rows, len(counts))
    for r, (eo, e_lse) in enumerate(expected):
        assert (o[r] - eo).abs().max().item() <= 1e-6
        assert torch.equal(torch.isinf(lse[r]), torch.isinf(e_lse))
        fin = torch.isfinite(e_lse)
        if fin.any():
            assert (lse[r][fin] - e_lse[fin]).abs().max().item() <= 1e-6
