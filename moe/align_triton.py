"""Token-to-expert alignment in one Triton program: the layout of `cuttle.moe.align.align_tokens`,
bit for bit, meant for GPU decode and small prefill chunks. Tested in the Triton interpreter only:
no GPU was left to this work after it was written, so the Triton expert path still aligns with the
torch version until a GPU run (tests/gpu/run_checks.sh) checks and times it (docs/gpu.md).

Owns the kernel and its launcher. The torch version is a dozen small ops (a scatter-add count, cumsums,
a stable argsort, scatters, a searchsorted): on an H200 ~45 µs of a ~90 µs Qwen3-30B-A3B expert
layer at batch 1 even replayed from a CUDA graph, and more eagerly. Here one program walks the
assignments in chunks: per-expert counts by comparing a chunk against every expert id, padded
offsets by a cumsum, each expert's block index by comparing block starts with the offsets, and
each assignment's slot as its expert's running cursor plus its rank among earlier equal ids in
its chunk (so assignments stay in token order inside an expert, as the stable argsort keeps
them). One program is sequential in the chunks, so it is meant for up to
`TRITON_ALIGN_MAX_ASSIGNMENTS` (a guess until timed), the torch version above. Never imports
`cuttle.engine`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cuttle.moe.align import AlignedTokens

# above this many assignments (tokens x top_k) the torch version's parallel sort should be faster
# than one program walking the chunks in turn (not measured yet: benchmarks/moe.py times both)
TRITON_ALIGN_MAX_ASSIGNMENTS = 8192


@triton.jit
def _align_kernel(
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    offsets_ptr,
    cursor_ptr,  # int32 [E_P2] scratch: each expert's next free slot
    n,
    num_experts,
    length,
    BLOCK_SIZE: tl.constexpr,
    E_P2: tl.constexpr,
    CHUNK: tl.constexpr,
):
    experts = tl.arange(0, E_P2)
    lanes = tl.arange(0, CHUNK)
    # 1. tokens per expert
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for start in range(0, n, CHUNK):
        offs = start + lanes
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    # 2. each expert's run padded to the block size; offsets [E + 1] with offsets[0] = 0
    padded = (counts + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(offsets_ptr + 1 + experts, ends.to(tl.int64), mask=experts < num_experts)
    tl.store(offsets_ptr + experts, tl.zeros([E_P2], dtype=tl.int64), mask=experts == 0)
    tl.store(cursor_ptr + experts, starts)
    # 3. padding everywhere first, then the expert of each block: how many runs end at or before
    #    its start (searchsorted(offsets[1:], start, right=True); num_experts past the last run)
    for start in range(0, length, CHUNK):
        offs = start + lanes
        tl.store(sorted_ptr + offs, tl.zeros([CHUNK], dtype=tl.int32) + n, mask=offs < length)
    ends_valid = tl.where(experts < num_experts, ends, 2147483647)
    for start in range(0, length // BLOCK_SIZE, CHUNK):
        blocks = start + lanes
        owner = tl.sum((ends_valid[None, :] <= (blocks * BLOCK_SIZE)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, owner, mask=blocks < length // BLOCK_SIZE)
    tl.debug_barrier()  # the padding and the cursors are written before any slot is
    # 4. each assignment to its expert's cursor + its rank among earlier equal ids in the chunk
    earlier = lanes[None, :] < lanes[:, None]
    for start in range(0, n, CHUNK):
        offs = start + lanes
        valid = offs < n
        ids = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int32)
        rank = tl.sum(((ids[:, None] == ids[None, :]) & earlier).to(tl.int32), axis=1)
        base = tl.load(cursor_ptr + ids, mask=valid, other=0)
        tl.store(sorted_ptr + base + rank, offs.to(tl.int32), mask=valid)
        taken = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
        tl.debug_barrier()  # every lane read its cursor before any moves
        tl.store(cursor_ptr + experts, tl.load(cursor_ptr + experts) + taken)
        tl.debug_barrier()


def align_tokens_triton(ids: torch.Tensor, num_experts: int, block_size: int) -> AlignedTokens:
    """`align_tokens(ids, num_experts, block_size)`, the same tensors, in one launch."""
    flat = ids.reshape(-1)
    n = flat.numel()
    bound = n + num_experts * (block_size - 1)
    length = (bound + block_size - 1) // block_size * block_size
    e_p2 = triton.next_power_of_2(num_experts)
    chunk = max(16, min(128, 16384 // e_p2))  # keeps the [chunk, experts] comparisons in registers
    dev = ids.device
    sorted_ids = torch.empty(length, dtype=torch.int32, device=dev)
    block_expert = torch.empty(length // block_size, dtype=torch.int32, device=dev)
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=dev)
    cursor = torch.empty(e_p2, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](flat.contiguous(), sorted_ids, block_expert, offsets, cursor, n, num_experts, length,
                        BLOCK_SIZE=block_size, E_P2=e_p2, CHUNK=chunk, num_warps=4)
    return AlignedTokens(sorted_ids, block_expert, offsets, n, block_size)
