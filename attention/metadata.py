"""The description of one flattened batch that every attention backend reads.

Owns the layout contract between the engine's model runner and the kernels; holds no KV itself.

A batch is B sequences whose new tokens are concatenated (no padding) into T query rows.
Sequence b contributes query rows `query_start_loc[b] : query_start_loc[b+1]`.

A sequence's KV is a list of *segments* (`KVSegment`): runs of tokens laid out from slot 0 of
their first block onward, so a segment may end mid-block. The last segment is the sequence's own
tokens and is *causal*: this step's K/V are written there, and query row j of a chunk of qlen rows
sees its keys `0 .. length - qlen + j`. Every earlier segment (a shared prefix, a cached document)
is *full*: every query row of the sequence sees all of its `length` keys. A segment's keys may
have been rotated (RoPE) at other positions than the ones it takes in this sequence: with
`rope_delta` = delta they sit at c + delta but were rotated at c, and the backend rotates the
query by -delta for that segment instead of touching the cached keys (so one cached copy serves
every placement). Attention over several segments is computed per segment and merged exactly by
the log-sum-exp (`merge.py`).

The classic fields (`seq_lens`, `block_tables`, `slot_mapping`, ...) always describe each
sequence's causal segment, exactly as a one-segment step needs them: after this step's K/V are
written its cache holds `seq_lens[b]` tokens in the blocks of `block_tables[b]` (logical token i
in block `block_tables[b, i // block_size]` at offset `i % block_size`), and new token j sits at
logical index `seq_lens[b] - query_len[b] + j`. `segments` is None when no sequence has more than
that one segment (the engine's runner builds these fields directly: the fast path); otherwise it
is a `SegmentBatch`, the step seen as a batch of (sequence, segment) parts, built once per step
by `AttentionMetadata.build`.

Two pools (read in place). A block id with the `HOST_BLOCK` bit set, in any block table of the
batch, names block `id - HOST_BLOCK` of the *host pool* (the KV host tier: same layout, its own
tensors, `host_kv[layer]`), which the kernels read where it lies instead of having it copied into
the device pool first. A segment with `pool=1` has all its blocks there (its table entries are
flagged here); a sequence's own causal table may also mix flagged cold blocks, full and already
computed, with device blocks. New K/V is only ever written to device blocks (`slot_mapping` never
names a host block). `host_kv` is None when no table of the step names a host block.

Given-back blocks. Under a sliding window a sequence's table may start with `NULL_BLOCK` entries:
blocks wholly before every window its queries will use, given back to the pool
(`BlockManager.release_behind_window`). Windowed paths start each row's walk at its window's block
and never read them; a path that reads a whole table masks those keys out and must not index
with the entry (the decode gather maps it to block 0).

Positions (the model's RoPE of this step's q and k) are the caller's: the model rotates q and k at
their absolute positions before the backend; only the per-segment offsets live here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cuttle.attention import native
from cuttle.attention.merge import merge_lse_rows
from cuttle.attention.native import rows as native_rows
from cuttle.attention.native import segments
from cuttle.attention.rope import rotate_partial

if TYPE_CHECKING:
    from cuttle.attention.rope import RotaryEmbedding


# Block-table flag of a host-pool block; block ids of either pool stay below it (csrc/host_pool.h)
HOST_BLOCK = native.HOST_BLOCK


# Block-table entry of a block given back behind a sliding window: never read
NULL_BLOCK = -1


def has_host_blocks(ids: list[int]) -> bool:
    return any(b >= HOST_BLOCK for b in ids)


@dataclass(slots=True)
class KVSegment:
    """A run of `length` KV tokens from slot 0 of `block_ids[0]` onward (it may end mid-block)."""

    block_ids: list[int]
    length: int
    causal: bool  # True only for a sequence's last segment (its own tokens, where new K/V go)
    rope_delta: int = 0  # keys rotated at c, placed at c + rope_delta in this sequence
    pool: int = 0  # 0 = the device pool, 1 = the host pool (read in place; its ids get HOST_BLOCK)
    pos_base: int = 0  # the position its first token takes in this sequence (what sliding windows measure)


@dataclass(slots=True)
class SeqLayout:
    """One sequence of a step: its new tokens (query rows) and its KV segments, causal one last."""

    query_len: int
    segments: list[KVSegment]


@dataclass(slots=True)
class SegmentBatch:
    """A step as a batch of *parts*, one per (sequence, segment), each attended like a sequence of
    its own and merged per query row by the log-sum-exp.

    Part p reads `kv_lens[p]` keys through `block_tables[p]` (same layout as a sequence's table).
    Its query rows are *virtual rows* `query_start_loc[p] : query_start_loc[p+1]`: copies of its
    sequence's query rows (`row_index[v]` is the real row behind virtual row v), so a part whose
    keys need the query rotated has its own copy. Causal parts (`causal[p] = 1`) mask as a
    sequence does (row j sees keys `0 .. kv_len - qlen + j`); full parts show every key to every
    row. Virtual rows `rot_rows` are rotated by `rot_cos`/`rot_sin` (fp32, the angle -delta *
    inv_freq, NeoX halves over the first 2 * rot_cos.shape[-1] dims) before attending. Parts are
    in sequence order, each sequence's causal part last.
    """

    query_start_loc: torch.Tensor  # [P+1] int32, virtual rows of each part
    kv_lens: torch.Tensor  # [P] int32
    block_tables: torch.Tensor  # [P, max_blocks] int32; unused tail entries 0, never read
    causal: torch.Tensor  # [P] int32, 1 = causal part
    row_index: torch.Tensor  # [V] int64, query row of the batch behind each virtual row
    rot_rows: torch.Tensor | None  # [R] int64 virtual rows whose q is rotated; None if no delta
    rot_cos: torch.Tensor | None  # [R, 1, rotary_dim / 2] fp32
    rot_sin: torch.Tensor | None
    seq_ids_cpu: list[int]  # host copies, per part
    query_lens_cpu: list[int]
    kv_lens_cpu: list[int]
    causal_cpu: list[bool]
    deltas_cpu: list[int]
    max_query_len: int
    max_kv_len: int
    # positions, per part: its first key's, and its first query row's (the sequence's first new
    # token); a sliding window compares them (each query at p sees keys p - W + 1 .. p)
    key_pos_cpu: list[int]
    query_pos_cpu: list[int]
    # the merge's grouping: query row r's virtual rows are merge_idx[merge_ptr[r] : merge_ptr[r + 1]]
    merge_ptr: torch.Tensor  # [T + 1] int64
    merge_idx: torch.Tensor  # [V] int64

    @property
    def num_parts(self) -> int:
        return len(self.kv_lens_cpu)

    def virtual_queries(self, q: torch.Tensor) -> torch.Tensor:
        """The parts' query rows [V, H, D]: each part's own copy of its sequence's rows of `q`,
        rotated by -delta where the part's keys sit delta positions from where they were rotated."""
        qv = native_rows.gather(q, self.row_index)
        if self.rot_rows is not None:
            assert self.rot_cos is not None and self.rot_sin is not None
            if 2 * self.rot_cos.shape[-1] > q.shape[-1]:
                raise ValueError(f"rotary dims {2 * self.rot_cos.shape[-1]} exceed head_dim {q.shape[-1]}")
            if not segments.rotate_rows_(qv, self.rot_rows, self.rot_cos, self.rot_sin):
                qv[self.rot_rows] = rotate_partial(qv[self.rot_rows], self.rot_cos, self.rot_sin)
        return qv

    def merge(self, o_parts: torch.Tensor, lse_parts: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The parts' results (fp32 [V, H, D], [V, H]) merged per query row of `q`: (o in q's dtype,
        lse fp32)."""
        merged = segments.merge_parts(o_parts, lse_parts, self.merge_ptr, self.merge_idx, q.dtype)
        if merged is not None:
            return merged
        out, lse = merge_lse_rows(o_parts, lse_parts, self.row_index, q.shape[0])
        return out.to(q.dtype), lse

    @property
    def num_rows(self) -> int:
        """Virtual rows V."""
        return int(sum(self.query_lens_cpu))


@dataclass(slots=True)
class WindowRows:
    """A decode step's rows (one per sequence, each its last key) already cut to a sliding window
    W: each row's table from its window's block, its key count from there, and how many keys of
    that block lie before the window (skipped). The CPU step graphs keep these and fill them every
    step, so a recorded windowed step reads the new values when it replays (engine/step_graphs.py)."""

    window: int
    tables: torch.Tensor  # [B, max_blocks] int32
    lens: torch.Tensor  # [B] int32
    skips: torch.Tensor  # [B] int32


@dataclass(slots=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B+1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, KV length of each causal segment after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32; unused tail entries are 0 and never read
    slot_mapping: torch.Tensor  # [T] int64, flat slot (block * block_size + offset) for each new K/V
    block_size: int
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]  # host copies: loops over sequences never sync the device
    seq_lens_cpu: list[int]
    segments: SegmentBatch | None = None  # None: one causal segment per sequence (the fields above)
    host_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer (k, v) of the host pool
    # a decode step's rows cut to the model's window (the step graphs'; None: cut per step by the
    # backend); where present, a windowed layer reads them whatever the sequences' lengths
    window_rows: WindowRows | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @property
    def has_rope_deltas(self) -> bool:
        return self.segments is not None and self.segments.rot_rows is not None

    @classmethod
    def build(
        cls, seqs: list[SeqLayout], block_size: int, device: torch.device | str, rope: RotaryEmbedding | None = None,
        host_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> AttentionMetadata:
        """The metadata of one step from per-sequence layouts (once per step; shared by every layer).

        Computes the slot of every new K/V (the last `query_len` tokens of the causal segment) and,
        when some sequence has more than one segment, the `SegmentBatch`. `rope` (the model's
        `RotaryEmbedding`) is needed only when some segment has a non-zero `rope_delta`; `host_kv`
        (the host pool's per-layer caches) only when some block lies in the host pool.
        """
        return build_metadata(seqs, block_size, device, rope, host_kv)


def _check(b: int, seq: SeqLayout, block_size: int) -> None:
    if not seq.segments:
        raise ValueError(f"sequence {b}: no KV segment (its own tokens form the last, causal one)")
    if seq.query_len < 1:
        raise ValueError(f"sequence {b}: query_len must be >= 1, got {seq.query_len}")
    last = len(seq.segments) - 1
    for i, s in enumerate(seq.segments):
        if s.pool not in (0, 1):
            raise ValueError(f"sequence {b} segment {i}: pool {s.pool}; pools are 0 (device) and 1 (host)")
        if s.pool == 1 and s.causal:
            raise ValueError(f"sequence {b} segment {i}: the causal segment is where new K/V is written, so it must be "
                             "in the device pool (0), not the host pool")
        if s.causal != (i == last):
            raise ValueError(
                f"sequence {b} segment {i}: only the last segment (the sequence's own tokens) is causal, "
                f"every earlier one is full visibility; got causal={s.causal}"
            )
        if s.length < 0 or len(s.block_ids) * block_size < s.length:
            raise ValueError(
                f"sequence {b} segment {i}: {s.length} tokens do not fit its {len(s.block_ids)} blocks of {block_size}"
            )
    tail = seq.segments[last]
    if tail.length < seq.query_len:
        raise ValueError(f"sequence {b}: causal segment of {tail.length} tokens cannot hold {seq.query_len} new ones")
    if tail.rope_delta != 0:
        raise ValueError(
            f"sequence {b}: the causal segment holds this step's keys, rotated at the positions the model "
            f"gives them, so its rope_delta must be 0 (got {tail.rope_delta})"
        )


def _table(rows: list[list[int]]) -> torch.Tensor:
    width = max([len(r) for r in rows] + [1])
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, r in enumerate(rows):
        if r:
            table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return table


def build_metadata(
    seqs: list[SeqLayout], block_size: int, device: torch.device | str, rope: RotaryEmbedding | None = None,
    host_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> AttentionMetadata:
    """See `AttentionMetadata.build`."""
    if not seqs:
        raise ValueError("a step needs at least one sequence")
    device = torch.device(device)
    for b, seq in enumerate(seqs):
        _check(b, seq, block_size)
    uses_host = any(s.pool == 1 or has_host_blocks(s.block_ids) for seq in seqs for s in seq.segments)
    if uses_host and host_kv is None:
        raise ValueError("a segment reads the host pool (pool=1 or HOST_BLOCK ids) but no host_kv was given")
    for b, seq in enumerate(seqs):
        tail = seq.segments[-1]
        written = tail.block_ids[(tail.length - seq.query_len) // block_size : -(-tail.length // block_size)]
        if has_host_blocks(written):
            raise ValueError(f"sequence {b}: this step's K/V would be written into a host block; new K/V goes to the device pool")
    query_lens = [s.query_len for s in seqs]
    tails = [s.segments[-1] for s in seqs]
    seq_lens = [t.length for t in tails]
    starts = [0]
    slots: list[int] = []
    for q, t in zip(query_lens, tails):
        starts.append(starts[-1] + q)
        ids = t.block_ids
        slots.extend(ids[i // block_size] * block_size + i % block_size for i in range(t.length - q, t.length))
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=_table([t.block_ids for t in tails]).to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_size=block_size,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        host_kv=host_kv if uses_host else None,
    )
    if any(len(s.segments) > 1 for s in seqs):
        meta.segments = _segment_batch(seqs, starts, block_size, device, rope)
    return meta


def _segment_batch(
    seqs: list[SeqLayout], starts: list[int], block_size: int, device: torch.device, rope: RotaryEmbedding | None
) -> SegmentBatch:
    seq_ids: list[int] = []
    qlens: list[int] = []
    kv_lens: list[int] = []
    causal: list[bool] = []
    deltas: list[int] = []
    tables: list[list[int]] = []
    row_index: list[int] = []
    key_pos: list[int] = []
    query_pos: list[int] = []
    vstart = [0]
    for b, seq in enumerate(seqs):
        tail = seq.segments[-1]
        for s in seq.segments:
            key_pos.append(s.pos_base)
            query_pos.append(tail.pos_base + tail.length - seq.query_len)
            seq_ids.append(b)
            qlens.append(seq.query_len)
            kv_lens.append(s.length)
            causal.append(s.causal)
            deltas.append(s.rope_delta)
            ids = s.block_ids[: -(-s.length // block_size)]
            tables.append([i | HOST_BLOCK for i in ids] if s.pool == 1 else ids)
            row_index.extend(range(starts[b], starts[b] + seq.query_len))
            vstart.append(vstart[-1] + seq.query_len)
    rot_rows = rot_cos = rot_sin = None
    moved = [p for p, d in enumerate(deltas) if d != 0]
    if moved:
        if rope is None:
            raise ValueError("segments with a rope_delta need the model's RotaryEmbedding (rope=...) to rotate the query")
        unique = sorted({deltas[p] for p in moved})
        cos, sin = rope.delta_tables(unique)  # [U, r/2] fp32
        which = {d: i for i, d in enumerate(unique)}
        rows = [v for p in moved for v in range(vstart[p], vstart[p + 1])]
        idx = torch.tensor([which[deltas[p]] for p in moved for _ in range(qlens[p])])
        rot_rows = torch.tensor(rows, dtype=torch.int64, device=device)
        rot_cos = cos[idx][:, None, :].to(device)
        rot_sin = sin[idx][:, None, :].to(device)
    by_row: list[list[int]] = [[] for _ in range(starts[-1])]
    for v, r in enumerate(row_index):
        by_row[r].append(v)
    merge_ptr = [0]
    for vs in by_row:
        merge_ptr.append(merge_ptr[-1] + len(vs))
    return SegmentBatch(
        query_start_loc=torch.tensor(vstart, dtype=torch.int32, device=device),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        block_tables=_table(tables).to(device),
        causal=torch.tensor(causal, dtype=torch.int32, device=device),
        row_index=torch.tensor(row_index, dtype=torch.int64, device=device),
        rot_rows=rot_rows,
        rot_cos=rot_cos,
        rot_sin=rot_sin,
        seq_ids_cpu=seq_ids,
        query_lens_cpu=qlens,
        kv_lens_cpu=kv_lens,
        causal_cpu=causal,
        deltas_cpu=deltas,
        max_query_len=max(qlens),
        max_kv_len=max(kv_lens),
        key_pos_cpu=key_pos,
        query_pos_cpu=query_pos,
        merge_ptr=torch.tensor(merge_ptr, dtype=torch.int64, device=device),
        merge_idx=torch.tensor([v for vs in by_row for v in vs], dtype=torch.int64, device=device),
    )
