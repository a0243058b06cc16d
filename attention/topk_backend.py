"""Training-free top-k attention over the paged cache: the backend an ordinary checkpoint runs under
`sparse_attention="topk:..."` (rules and reference: `topk.py`).

Owns the per-step plan (which block summaries this step completes, each sequence's key slots and
summary slots, the rows the native kernel takes) and `forward`: for a sparse layer it
writes the raw K/V, stores the summaries of the blocks this step completes, and attends each query
row to the blocks its selection picks; a segmented step (squid: a prefix and documents beside the
own tokens) attends part by part, each under the rule on its own keys, merged by the log-sum-exp
(docs/nsa.md, "Squid documents under top-k"). The first `dense_layers` layers (and every layer
without a summary cache) go to the wrapped dense backend untouched. Never allocates cache memory (the runner
does) and never selects differently from the reference: the native kernel implements the same rule.

Summary cache layout (per sparse layer): `[num_blocks, S, R, kv_heads, head_dim]` indexed by the
*raw cache's own block ids*, R = 2 (Quest's min, max) or 1 (mean). Block j of a sequence (keys
j*P .. j*P + P - 1) is summarised once complete, into the raw block holding its last key
e = j*P + P - 1, at slot (e % B) // P (B = the engine's block_size, S = max(1, B // P); both are
powers of two). A raw block therefore carries the summaries of the blocks that end inside it,
which depend only on keys at or before it: prefix-cache hits, forked prompts (copy-on-write copies
the summary slots with the raw block), preemption and freeing need no bookkeeping of their own,
exactly as NSA's compressed cache (`nsa_backend.py`).

Read in place: a table entry flagged `HOST_BLOCK` names a block of the KV host tier, whose
summaries lie in the host tier's companion (`host_summaries`, given by the runner with the tier);
the native kernel reads both pools and the torch paths gather from both (`backend.PoolRows`), as in
`nsa_backend.py`. The summaries a step stores end in blocks it writes: always the device pool.
"""
from __future__ import annotations

import torch

from cuttle.attention.backend import AttentionBackend, PoolRows, SparseUnits, key_slots, write_kv
from cuttle.attention.metadata import AttentionMetadata
from cuttle.attention.topk import TopKConfig, block_scores, select_blocks, summarize, topk_attend_chunked


def summary_slots_per_block(cfg: TopKConfig, block_size: int) -> int:
    """S: block summaries one raw KV block owns."""
    return max(1, block_size // cfg.block)


class TopKStepPlan(SparseUnits):
    """Host-side plan of one step, shared by every sparse layer: the units it attends
    (`SparseUnits`: sequences, or squid parts) and the block summaries this step completes (the
    causal segments', with or without segments)."""

    __slots__ = ("new_src", "new_dst")

    def __init__(self, meta: AttentionMetadata, cfg: TopKConfig, slots_per_block: int, native_rows: bool) -> None:
        super().__init__(meta, native_rows)
        bs, P = meta.block_size, cfg.block
        device = meta.block_tables.device
        src: list[torch.Tensor] = []
        dst: list[torch.Tensor] = []
        offs = torch.arange(P, device=device)
        for b, (qlen, num_keys) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            table = meta.block_tables[b, : -(-num_keys // bs)].long()
            ctx = num_keys - qlen
            # blocks whose last key j*P + P - 1 arrives in this step: ctx <= j*P + P - 1 < num_keys
            j = torch.arange(ctx // P, num_keys // P, device=device)
            if j.numel():
                src.append(key_slots(table, j[:, None] * P + offs, bs))
                dst.append(_summary_slot(table, j, P, bs, slots_per_block))
        self.new_src = torch.cat(src) if src else None
        self.new_dst = torch.cat(dst) if dst else None


def _summary_slot(table: torch.Tensor, j: torch.Tensor, P: int, bs: int, slots_per_block: int) -> torch.Tensor:
    e = j * P + P - 1
    return table[e // bs] * slots_per_block + (e % bs) // P


class TopKBackend:
    """Sparse layers' attention over the paged raw cache and its block summaries; dense layers
    pass through. `summaries[layer]` is that layer's summary cache, None for a dense layer.

    kernel: "torch" (beside the torch dense backend: on CPU every query row, decode and prefill
    alike, takes the native kernel when it builds, native=False keeps them on the torch reference,
    the oracle the kernels are tested against) or "triton" (beside any other dense backend: the
    choice in torch by the reference's rule, then one Triton kernel for all rows,
    `triton_topk.py`); None picks by the dense backend, as the runner does for NSA."""

    def __init__(self, cfg: TopKConfig, dense: AttentionBackend, block_size: int,
                 summaries: list[torch.Tensor | None], native: bool = True, kernel: str | None = None) -> None:
        kernel = kernel or ("torch" if dense.name == "torch" else "triton")
        if kernel not in ("torch", "triton"):
            raise ValueError(f"top-k kernel must be 'torch' or 'triton', got {kernel!r}")
        self.cfg = cfg
        self.dense = dense
        self.kernel = kernel
        self.name = f"topk-{dense.name}"
        self.summaries = summaries
        self.slots_per_block = summary_slots_per_block(cfg, block_size)
        self.native = False
        if native and kernel == "torch":
            from cuttle.attention.native import topk as native_topk

            self.native = native_topk.available()
        self._plan: TopKStepPlan | None = None
        # per layer the KV host tier's summary cache (None for a dense layer): blocks read in place
        self.host_summaries: list[torch.Tensor | None] | None = None

    @property
    def takes_segments(self) -> bool:
        """Its own layers take segments on every kernel; dense layers go to the wrapped backend."""
        return self.dense.takes_segments

    def begin_step(self, meta: AttentionMetadata) -> None:
        self.dense.begin_step(meta)
        self._plan = None  # planned at the first sparse layer

    def plan(self, meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor) -> TopKStepPlan:
        if self._plan is None or self._plan.meta is not meta:
            native = self.native and q.device.type == "cpu" and k_cache.device.type == "cpu"
            self._plan = TopKStepPlan(meta, self.cfg, self.slots_per_block, native)
        return self._plan

    def forward(self, layer, q, k, v, k_cache, v_cache, meta, scale):
        summ = self.summaries[layer] if layer < len(self.summaries) else None
        if summ is None:
            return self.dense.forward(layer, q, k, v, k_cache, v_cache, meta, scale)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        plan = self.plan(meta, q, k_cache)
        hkv, dim = k_cache.shape[2], k_cache.shape[3]
        sf = summ.view(-1, summ.shape[2], hkv, dim)  # [blocks * S, R, Hkv, D]
        host = None  # the host tier's (k, v, summaries) of this layer, when a table names a host block
        if meta.host_kv is not None:
            if self.host_summaries is None:
                raise ValueError("a block table names a host block but the top-k backend has no host summary cache")
            host = (*meta.host_kv[layer], self.host_summaries[layer])
        pools = PoolRows({"k": k_cache, "v": v_cache, "s": summ},
                         None if host is None else dict(zip("k v s".split(), host)))
        if plan.new_src is not None:
            windows = pools("k", plan.new_src).transpose(1, 2)  # [E, P, Hkv, D] -> [E, Hkv, P, D]
            sf.index_copy_(0, plan.new_dst, summarize(windows, self.cfg).to(sf.dtype))
        sb = meta.segments
        if sb is not None:  # squid parts: virtual query rows (rotated where a part's keys moved), merged below
            rows_q = sb.virtual_queries(q)
            out = torch.zeros(rows_q.shape, dtype=torch.float32, device=q.device)
            lse = torch.full(rows_q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)  # empty parts
        else:
            rows_q, out = q, torch.empty_like(q)
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if self.kernel == "triton":
            from cuttle.attention.triton_topk import topk_paged_attention

            if host is not None:
                raise NotImplementedError("the Triton top-k kernel reads the device pool only: host blocks are copied in")
            # squid parts: virtual rows over the parts' tables, each part under the rule on its own
            # keys (a whole part's rows at its last key), merged below as on the CPU paths
            idx, row_seq, row_pos = self.select(plan, rows_q, sf, scale)
            topk_paged_attention(rows_q, k_cache, v_cache, out, lse, idx, row_seq, row_pos,
                                 meta.block_tables if sb is None else sb.block_tables, self.cfg, scale)
            return (out, lse) if sb is None else sb.merge(out, lse, q)
        seqs = plan.torch_seqs
        if plan.native_rows is not None:
            from cuttle.attention.native import topk as native_topk

            if native_topk.supports(rows_q, k_cache, out):
                native_topk.topk_decode(rows_q, k_cache, v_cache, summ, out, lse, plan.native_rows, plan.native_tables,
                                        plan.native_lens, self.cfg, scale, host=host)
            else:
                seqs = plan.native_seqs + seqs
        for b in seqs:
            self._torch_seq(plan, b, rows_q, pools, out, lse, scale)
        return (out, lse) if sb is None else sb.merge(out, lse, q)

    def select(self, plan: TopKStepPlan, q: torch.Tensor, sf: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
        """Every row's chosen blocks [T, Hkv, n] int32 (ascending, -1 padded), by the reference's
        scores and rule, with each row's sequence and key index (int32 [T]): the Triton kernel's inputs."""
        cfg, hkv, P = self.cfg, sf.shape[2], self.cfg.block
        n = cfg.num_blocks
        idx = torch.full((q.shape[0], hkv, n), -1, dtype=torch.int32, device=q.device)
        row_seq, row_pos = plan.row_units(q.device)
        for b, (start, qlen, num_keys, table) in enumerate(plan.seqs):
            if num_keys == 0:  # an empty part: its rows attend nothing (lse stays -inf)
                continue
            pos = row_pos[start : start + qlen].long()
            summ = sf[_summary_slot(table, torch.arange(num_keys // P, device=q.device), P, plan.meta.block_size,
                                    self.slots_per_block)].float()
            qs = q[start : start + qlen].float()
            chosen = select_blocks(block_scores(qs, summ, cfg, scale), pos, cfg, q.shape[1] // hkv)
            nb = chosen.shape[-1]
            j = torch.arange(nb, device=q.device).expand_as(chosen)
            # the chosen block ids first (ascending), then nb for "none"; at most n are chosen
            ids = torch.where(chosen, j, nb).sort(-1).values[..., :n]
            idx[start : start + qlen, :, : ids.shape[-1]] = torch.where(ids == nb, -1, ids).to(torch.int32)
        return idx, row_seq, row_pos

    def _torch_seq(self, plan: TopKStepPlan, b: int, q, pools: PoolRows, out, lse, scale: float) -> None:
        """Sequence (or squid part) b's rows through the reference (gathering all its keys: the oracle
        path); a full part's rows all sit at its last key."""
        start, qlen, num_keys, table = plan.seqs[b]
        bs, P = plan.meta.block_size, self.cfg.block
        slots = key_slots(table, torch.arange(num_keys, device=q.device), bs)
        summ = pools("s", _summary_slot(table, torch.arange(num_keys // P, device=q.device), P, bs, self.slots_per_block))
        pos = plan.positions(b, q.device)
        o, l = topk_attend_chunked(q[start : start + qlen].float(), pools("k", slots).float(), pools("v", slots).float(), pos,
                                   self.cfg, scale, summ.float())
        out[start : start + qlen] = o.to(out.dtype)
        lse[start : start + qlen] = l
