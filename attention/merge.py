"""Exact merging of partial attention results by their log-sum-exp.

Attention of one query over the union of disjoint key sets A and B is a weighted mean of the two
partial results: with lse_X = log sum_{k in X} exp(s_k) (natural log, scaled scores),
    lse = log(exp(lse_A) + exp(lse_B)),   o = exp(lse_A - lse) o_A + exp(lse_B - lse) o_B.
Owns that formula and nothing else: the backends use it to combine a row's segments (cached
documents, a shared prefix, its own tokens). The math is fp32 with the max subtracted, so it is
exact to fp32 rounding and independent of the order of the parts (up to that rounding). A part
with lse = -inf (an empty or fully masked segment) gets weight exactly 0 whatever its o holds;
a row whose parts are all empty gets o = 0 and lse = -inf, never NaN.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def merge_lse(
    o_parts: Sequence[torch.Tensor] | torch.Tensor,  # P x [..., H, D], or one tensor [P, ..., H, D]
    lse_parts: Sequence[torch.Tensor] | torch.Tensor,  # P x [..., H], or one tensor [P, ..., H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge P partial attention results of the same query rows: returns (o fp32 [..., H, D],
    lse fp32 [..., H])."""
    o = o_parts if isinstance(o_parts, torch.Tensor) else torch.stack(list(o_parts))
    lse = lse_parts if isinstance(lse_parts, torch.Tensor) else torch.stack(list(lse_parts))
    if o.shape[0] == 0:
        raise ValueError("merge_lse needs at least one part")
    lse = lse.float()
    m = lse.amax(0)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # all parts empty: no shift
    w = torch.exp(lse - m_safe)  # [P, ..., H]; exactly 0 for empty parts
    total = w.sum(0)
    # weight 0 must not meet a NaN or inf in an empty part's o
    wo = torch.where((w > 0)[..., None], o.float() * w[..., None], 0.0)
    out = wo.sum(0) / torch.where(total > 0, total, 1.0)[..., None]
    return out, m_safe + torch.log(total)


def merge_lse_rows(
    o_parts: torch.Tensor,  # [V, H, D]: one partial result per (row, part)
    lse_parts: torch.Tensor,  # [V, H]
    rows: torch.Tensor,  # [V] int64: the output row each part belongs to
    num_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_lse` where each output row has its own number of parts (any order): part v adds to
    row rows[v]. Returns (o fp32 [num_rows, H, D], lse fp32 [num_rows, H]); a row with no part
    gets o = 0, lse = -inf. Differentiable in o_parts and lse_parts."""
    lse_parts = lse_parts.float()
    heads = lse_parts.shape[1]
    m = torch.full((num_rows, heads), float("-inf"), dtype=torch.float32, device=lse_parts.device)
    # A contiguous index: with an expanded (stride-0) one, torch's multi-threaded CPU
    # scatter_reduce_ took ~60-120 ms for 8 rows x 16 heads (7 us contiguous) on 2 threads.
    # the max is only a shift, which cancels: detached, the merge is differentiable (NSA's training path)
    m.scatter_reduce_(0, rows[:, None].expand(-1, heads).contiguous(), lse_parts.detach(), "amax")
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse_parts - m_safe[rows])  # [V, H]
    total = torch.zeros_like(m).index_add_(0, rows, w)
    wo = torch.where((w > 0)[..., None], o_parts.float() * w[..., None], 0.0)
    out = torch.zeros(num_rows, *o_parts.shape[1:], dtype=torch.float32, device=o_parts.device).index_add_(0, rows, wo)
    out = out / torch.where(total > 0, total, 1.0)[..., None]
    return out, m_safe + torch.log(total)
