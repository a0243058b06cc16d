"""Token-to-expert alignment: the (token, slot) assignments sorted by expert, padded to a block size.

Owns the layout the grouped GEMMs consume (vLLM's `moe_align_block_size` layout). An assignment
is the flat index `t * top_k + j` of `ids[t, j]`; `sorted_ids` lists assignments grouped by
expert, in token order inside an expert, each expert's run padded up to a multiple of `block_size`
with the sentinel `T * top_k`. Block `b` (rows `b*block_size ...`) belongs to `block_expert[b]`.
Pure torch, device-agnostic, and free of host syncs, so a GPU launch can follow it directly.
Must never compute with expert weights or import from `cuttle.engine`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AlignedTokens:
    """Expert-sorted assignments. Lengths are the static bound T*k + E*(block_size-1), rounded up."""

    sorted_ids: torch.Tensor  # int32 [L]: assignment index, or num_assignments for padding
    block_expert: torch.Tensor  # int32 [L // block_size]: expert of each block; num_experts past the end
    expert_offsets: torch.Tensor  # int64 [E + 1]: start of each expert's padded run; [-1] = padded total
    num_assignments: int  # T * top_k, also the padding sentinel
    block_size: int

    @property
    def num_padded(self) -> torch.Tensor:
        return self.expert_offsets[-1]


def align_tokens(ids: torch.Tensor, num_experts: int, block_size: int) -> AlignedTokens:
    """Sort the assignments of `ids` [T, k] by expert and pad each expert's run to `block_size`."""
    flat = ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    # not torch.bincount: on CUDA it reads the largest id back to the host (a sync, and no graph capture)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_size - 1) // block_size * block_size
    zero = torch.zeros(1, dtype=torch.int64, device=ids.device)
    starts = torch.cat([zero, counts.cumsum(0)])
    offsets = torch.cat([zero, padded.cumsum(0)])
    order = torch.argsort(flat, stable=True)
    expert_sorted = flat[order]
    rank = torch.arange(n, device=ids.device) - starts[expert_sorted]
    bound = n + num_experts * (block_size - 1)
    length = (bound + block_size - 1) // block_size * block_size
    sorted_ids = torch.full((length,), n, dtype=torch.int32, device=ids.device)
    sorted_ids[offsets[expert_sorted] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, length, block_size, device=ids.device)
    block_expert = torch.searchsorted(offsets[1:], block_starts, right=True).to(torch.int32)
    return AlignedTokens(sorted_ids, block_expert, offsets, n, block_size)
