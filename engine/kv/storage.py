"""The KV tensors of one pool and their layout.

Layout: one tensor `[layers, 2 (k, v), blocks, block_size, kv_heads, head_dim]`. Per layer, K
and V are each a contiguous `[blocks, block_size, kv_heads, head_dim]` array (flashinfer's NHD
paged layout), which is what every attention kernel reads: a block is one fixed stride apart, so
kernels index it directly. The cost is on the transfer side: one block's KV for all layers is
`2 * layers` chunks of `block_size * kv_heads * head_dim` elements, not one. Block-major storage
(one contiguous chunk per block) would make a block's copy one memcpy but give every kernel a
per-layer stride of `2 * layers` blocks and break the flat views the kernels and the slot
mapping use. Transfers instead move many blocks at once with one indexed copy over the block
dimension (`read_blocks` / `write_blocks`: a single gather or scatter for all layers), so the
chunk count costs per-call overhead once, not per block. A host tier keeps the same layout, so a
block moves as the same `2 * layers` chunks and an attention kernel could one day read it where
it is (docs/kv_tiers.md, "read in place").

Companions: per-block data a model keeps beside its KV (an NSA model's compressed entries, the
top-k block summaries), each a tensor `[a, b, blocks, ...]` with the blocks on the same dimension.
They belong to the block: every copy, transfer and disk entry of a block carries them (`tensors`
lists the KV tensor, then the companions), so the KV tiers and copy-on-write move them with no
code of their own. A companion is given as (its name, the dims before the blocks, the dims after).
"""
from __future__ import annotations

import torch


# (name, dims before the block dimension (two), dims after it)
Companion = tuple[str, tuple[int, int], tuple[int, ...]]


class KVStorage:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, pin_memory: bool = False, companions: list[Companion] = ()):
        # pin_memory: a host tier under a CUDA pool, so copies to and from it are DMA
        self.tensor = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device,
                                  pin_memory=pin_memory)
        self.layers = [(self.tensor[i, 0], self.tensor[i, 1]) for i in range(num_layers)]
        self.device = device
        self.companion_specs: list[Companion] = [(n, tuple(pre), tuple(post)) for n, pre, post in companions]
        self.companions = {n: torch.zeros(*pre, num_blocks, *post, dtype=dtype, device=device, pin_memory=pin_memory)
                           for n, pre, post in self.companion_specs}
        self.tensors = [self.tensor, *self.companions.values()]  # each block's data, on dimension 2 of each

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's KV and companions, every layer: what a tier moves per block."""
        return sum(t[:, :, 0].numel() * t.element_size() for t in self.tensors)

    def layout_tag(self) -> str:
        """The companions' names and shapes: part of what a disk entry's bytes mean."""
        return ";".join(f"{n}:{pre}:{post}" for n, pre, post in self.companion_specs)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """(src, dst) block copies within this pool, every layer (and companion), one indexed
        assignment each."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for t in self.tensors:
            t[:, :, dst] = t[:, :, src]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[layers, 2, n, block_size, kv_heads, head_dim]: a copy of these blocks' KV (the KV
        tensor only; the tiers move whole blocks through `tensors`)."""
        return self.tensor[:, :, torch.tensor(block_ids, device=self.device)]

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.tensor[:, :, torch.tensor(block_ids, device=self.device)] = data.to(self.device, self.tensor.dtype)
