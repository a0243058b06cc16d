"""The description of one flattened batch that every attention backend reads.

Owns the layout contract between the engine's model runner and the kernels; holds no KV itself.

A batch is B sequences whose new tokens are concatenated (no padding) into T query rows.
Sequence b contributes query rows `query_start_loc[b] : query_start_loc[b+1]`; after this step's
K/V are written its cache holds `seq_lens[b]` tokens, laid out in the blocks listed in
`block_tables[b]` (logical token i lives in block `block_tables[b, i // block_size]` at offset
`i % block_size`). New token j of sequence b sits at logical index
`seq_lens[b] - query_len[b] + j` and attends causally to logical indices `0 ..` that index.

The block list of a sequence is just a list: it need not be one contiguous prefix of anything, so
per-document KV (squid) is a block table that concatenates documents' blocks, a sparse subset of
blocks (NSA) is a narrower table per query group, and a block of the CPU tier is a block id whose
bytes were brought back into the pool before the step runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B+1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, KV length per sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32; unused tail entries are 0 and never read
    slot_mapping: torch.Tensor  # [T] int64, flat slot (block * block_size + offset) for each new K/V
    block_size: int
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]  # host copies: loops over sequences never sync the device
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
