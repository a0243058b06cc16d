"""NSA over the paged caches: the attention backend of an NSA model.

Owns the per-step NSA plan (which compressed entries this step completes, where each sequence's
compressed entries live, which rows the native kernel takes) and `forward_nsa`, which
writes a layer's raw K/V, builds and stores the compressed entries completed by this step's
tokens, and runs the three gated branches. A segmented step (squid: a prefix and documents beside
the own tokens) attends part by part (virtual query rows over each part's table, the query
rotated by -delta for a moved document), each part under NSA's rules on its own keys, its three
branches kept apart with their log-sum-exps and merged over the row's parts before the gates
(`nsa.py` `nsa_attend_parts`; docs/nsa.md, "Squid documents under NSA"). Dense layers (and
`forward`) go to the wrapped dense backend untouched. Never allocates cache memory (the runner
does) and never decides a selection differently from the reference (`nsa.py`): the kernels
implement the same rules.

Compressed cache layout (per layer, K and V): `[num_blocks, S_c, kv_heads, head_dim]` indexed by
the *raw cache's own block ids*. Compressed entry i covers keys i*d .. i*d + l - 1 and lives in the
raw block holding its last key e = i*d + l - 1, at slot (e % B) // d (B = the engine's
block_size, S_c = max(1, B // d), so d | B or B | d is required). A raw block therefore carries
the compressed entries that end inside it, and an entry depends only on keys at or before its
block: prefix-cache hits, forked prompts (copy-on-write copies the compressed slots with the raw
block), preemption and freeing need no bookkeeping of their own, and a full block's compressed
entries are a deterministic function of the hashed prefix.

Read in place: a table entry flagged `HOST_BLOCK` names a block of the KV host tier, whose
compressed entries lie in the host tier's companion of the same layout (`host_compressed`, given
by the runner with the tier); the native kernel reads both pools, the torch paths gather from both
(`backend.PoolRows`: a slot computed from a flagged id lies at or above HOST_BLOCK * rows a block).
Only full, hashed blocks before everything a step writes are read in place, so the entries a
step stores always go to the device pool.

Selection (top-n per KV head from Eq. 9 scores) runs per query row: in the native decode kernel
(`native/nsa.py`, every query row on CPU: decode rows and prefill rows alike), in torch (`nsa.py`'s
reference: rows the native kernel does not take, and the index lists the Triton kernel takes).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from cuttle.attention.backend import AttentionBackend, PoolRows, SparseUnits, key_slots, write_kv
from cuttle.attention.metadata import AttentionMetadata
from cuttle.attention.nsa import (NSAConfig, compressed_probs, nsa_attend, nsa_attend_parts, nsa_branches, select_blocks,
                                  selection_scores)

# phi of the layer: (windows of keys, of values) [E, Hkv, l, D] -> compressed ([E, Hkv, D], [E, Hkv, D])
Compressor = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def compressed_slots_per_block(cfg: NSAConfig, block_size: int) -> int:
    """S_c: compressed entries a raw block of `block_size` keys owns."""
    d = cfg.compress_stride
    if block_size % d and d % block_size:
        raise ValueError(
            f"nsa.compress_stride = {d} and block_size = {block_size}: one must divide the other, so that every "
            "raw KV block owns a fixed number of compressed entries"
        )
    return max(1, block_size // d)


class NSAStepPlan(SparseUnits):
    """Host-side plan of one step, shared by every NSA layer: the units it attends (`SparseUnits`)
    and the compressed entries this step completes (the causal segments', with or without
    segments). Slots are computed only for what a step touches (the entries it completes; all keys
    only on the torch path): a list of every key's slot per sequence and step cost 56 ms at
    batch 8 x 64k (`benchmarks/nsa.py --plan`)."""

    __slots__ = ("cfg", "new_src", "new_dst")

    def __init__(self, meta: AttentionMetadata, cfg: NSAConfig, slots_per_block: int, native_rows: bool) -> None:
        super().__init__(meta, native_rows)
        self.cfg = cfg
        bs, l, d = meta.block_size, cfg.compress_block, cfg.compress_stride
        device = meta.block_tables.device
        src: list[torch.Tensor] = []
        dst: list[torch.Tensor] = []
        offs = torch.arange(l, device=device)
        for b, (qlen, num_keys) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            table = meta.block_tables[b, : -(-num_keys // bs)].long()
            ctx = num_keys - qlen
            # entries whose last key e = i*d + l - 1 arrives in this step: ctx <= e < num_keys
            i = torch.arange(max(0, -(-(ctx - l + 1) // d)), cfg.num_compressed(num_keys), device=device)
            if i.numel():
                src.append(key_slots(table, i[:, None] * d + offs, bs))
                dst.append(compressed_slots(table, i, cfg, bs, slots_per_block))
        self.new_src = torch.cat(src) if src else None
        self.new_dst = torch.cat(dst) if dst else None


def compressed_slots(table: torch.Tensor, i: torch.Tensor, cfg: NSAConfig, bs: int, slots_per_block: int) -> torch.Tensor:
    """Compressed cache rows of entries `i` [n]: entry i lives in the raw block holding its last key."""
    e = i * cfg.compress_stride + cfg.compress_block - 1
    return table[e // bs] * slots_per_block + (e % bs) // cfg.compress_stride


class NSABackend:
    """NSA layers' attention over the paged raw and compressed caches; dense calls pass through.

    kernel: "torch" (on CPU every query row, decode and prefill, takes the native kernel when it
    builds; native=False, or tensors it does not take, keep them on the reference per sequence) or
    "triton" (selection in torch, the three branches in one Triton kernel)."""

    def __init__(self, cfg: NSAConfig, dense: AttentionBackend, block_size: int, kernel: str = "torch",
                 native: bool = True) -> None:
        if kernel not in ("torch", "triton"):
            raise ValueError(f"NSA kernel must be 'torch' or 'triton', got {kernel!r}")
        self.cfg = cfg
        self.dense = dense
        self.kernel = kernel
        self.name = f"nsa-{kernel}"
        self.slots_per_block = compressed_slots_per_block(cfg, block_size)
        self.native = False
        if native and kernel == "torch":
            from cuttle.attention.native import nsa as native_nsa

            self.native = native_nsa.available()
        self._plan: NSAStepPlan | None = None
        # per layer (ck, cv) of the KV host tier's compressed caches: blocks read in place
        self.host_compressed: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def takes_segments(self) -> bool:
        """Its own layers take segments on every kernel; dense layers go to the wrapped backend."""
        return self.dense.takes_segments

    def begin_step(self, meta: AttentionMetadata) -> None:
        self.dense.begin_step(meta)
        self._plan = None  # planned at the first NSA layer (a dense model never pays for it)

    def forward(self, layer, q, k, v, k_cache, v_cache, meta, scale):
        return self.dense.forward(layer, q, k, v, k_cache, v_cache, meta, scale)

    def plan(self, meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor) -> NSAStepPlan:
        if self._plan is None or self._plan.meta is not meta:
            native = self.native and q.device.type == "cpu" and k_cache.device.type == "cpu"
            self._plan = NSAStepPlan(meta, self.cfg, self.slots_per_block, native)
        return self._plan

    def forward_nsa(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H, D], RoPE applied
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        gates: torch.Tensor,  # [T, H, 3] sigmoid gates (compressed, selected, window)
        caches: tuple[torch.Tensor, ...],  # (k_cache, v_cache, ck_cache, cv_cache)
        meta: AttentionMetadata,
        scale: float,
        compressor: Compressor,
    ) -> torch.Tensor:
        """Write this step's K/V and the compressed entries it completes, then attend: o [T, H, D]."""
        k_cache, v_cache, ck_cache, cv_cache = caches
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        plan = self.plan(meta, q, k_cache)
        hkv, dim = k_cache.shape[2], k_cache.shape[3]
        ckf, cvf = ck_cache.view(-1, hkv, dim), cv_cache.view(-1, hkv, dim)
        host = None  # the host tier's (k, v, ck, cv) of this layer, when a table names a host block
        if meta.host_kv is not None:
            if self.host_compressed is None:
                raise ValueError("a block table names a host block but the NSA backend has no host compressed cache")
            host = (*meta.host_kv[layer], *self.host_compressed[layer])
        pools = PoolRows(dict(zip("k v ck cv".split(), caches)), None if host is None else dict(zip("k v ck cv".split(), host)))
        if plan.new_src is not None:
            wk = pools("k", plan.new_src).transpose(1, 2)  # [E, l, Hkv, D] -> [E, Hkv, l, D]
            wv = pools("v", plan.new_src).transpose(1, 2)
            ck, cv = compressor(wk, wv)
            ckf.index_copy_(0, plan.new_dst, ck.to(ckf.dtype))
            cvf.index_copy_(0, plan.new_dst, cv.to(cvf.dtype))
        if meta.segments is not None:
            return self._forward_parts(plan, q, gates, caches, pools, host, scale)
        out = torch.empty_like(q)
        if self.kernel == "triton":
            from cuttle.attention.triton_nsa import nsa_paged_attention

            if host is not None:
                raise NotImplementedError("the Triton NSA kernel reads the device pool only: host blocks are copied in")
            idx, row_seq, row_pos = self.select(plan, q, ckf, scale)
            nsa_paged_attention(q, k_cache, v_cache, ck_cache, cv_cache, gates, out, idx, row_seq, row_pos,
                                meta.block_tables, self.cfg, scale)
            return out
        if plan.native_rows is not None:
            from cuttle.attention.native import nsa as native_nsa

            if native_nsa.supports(q, k_cache, out):
                native_nsa.nsa_decode(q, k_cache, v_cache, ck_cache, cv_cache, gates, out, plan.native_rows,
                                      plan.native_tables, plan.native_lens, self.cfg, scale, host=host)
            else:
                for b in plan.native_seqs:
                    self._torch_seq(plan, b, q, pools, gates, out, scale)
        for b in plan.torch_seqs:
            self._torch_seq(plan, b, q, pools, gates, out, scale)
        return out

    def _forward_parts(self, plan: NSAStepPlan, q: torch.Tensor, gates: torch.Tensor, caches: tuple[torch.Tensor, ...],
                       pools: PoolRows, host: tuple[torch.Tensor, ...] | None, scale: float) -> torch.Tensor:
        """A segmented step: every part's three branches apart (virtual rows, the query rotated by
        -delta where a part's keys moved), merged per branch over each row's parts by the
        log-sum-exp, then gated (nsa.py's `nsa_attend_parts`, row by row)."""
        sb = plan.meta.segments
        rows_q = sb.virtual_queries(q)
        v_rows, h, dim = rows_q.shape
        bo = torch.zeros(v_rows, h, 3, dim, dtype=torch.float32, device=q.device)
        bl = torch.full((v_rows, h, 3), float("-inf"), dtype=torch.float32, device=q.device)  # empty parts
        seqs = plan.torch_seqs
        if self.kernel == "triton":
            from cuttle.attention.triton_nsa import nsa_paged_attention

            if host is not None:
                raise NotImplementedError("the Triton NSA kernel reads the device pool only: host blocks are copied in")
            k_cache = caches[0]
            idx, row_seq, row_pos = self.select(plan, rows_q, caches[2].view(-1, *k_cache.shape[2:]), scale)
            nsa_paged_attention(rows_q, *caches, None, None, idx, row_seq, row_pos, sb.block_tables, self.cfg, scale,
                                branches=(bo, bl))
            seqs = []
        elif plan.native_rows is not None:
            from cuttle.attention.native import nsa as native_nsa

            if native_nsa.supports(rows_q, caches[0], bo):
                native_nsa.nsa_decode(rows_q, *caches, None, None, plan.native_rows, plan.native_tables,
                                      plan.native_lens, self.cfg, scale, host=host, branches=(bo, bl))
            else:
                seqs = plan.native_seqs + seqs
        for b in seqs:
            start, qlen = plan.seqs[b][:2]
            o, lse, _ = nsa_branches(rows_q[start : start + qlen].float(), *self._gather(plan, b, pools),
                                     plan.positions(b, q.device), self.cfg, scale)
            bo[start : start + qlen], bl[start : start + qlen] = o, lse
        return nsa_attend_parts(bo, bl, sb.row_index, gates).to(q.dtype)

    def _gather(self, plan: NSAStepPlan, b: int, pools: PoolRows) -> tuple[torch.Tensor, ...]:
        """Sequence (or part) b's keys, values, compressed keys and values, fp32, unpaged."""
        _, _, num_keys, table = plan.seqs[b]
        bs, dev = plan.meta.block_size, table.device
        sl = key_slots(table, torch.arange(num_keys, device=dev), bs)
        cs = compressed_slots(table, torch.arange(self.cfg.num_compressed(num_keys), device=dev), self.cfg, bs,
                              self.slots_per_block)
        return pools("k", sl).float(), pools("v", sl).float(), pools("ck", cs).float(), pools("cv", cs).float()

    def _torch_seq(self, plan: NSAStepPlan, b: int, q, pools: PoolRows, gates, out, scale: float) -> None:
        """Sequence b's rows through the torch reference (gathering all its keys: the oracle path)."""
        start, qlen = plan.seqs[b][:2]
        o, _ = nsa_attend(q[start : start + qlen].float(), *self._gather(plan, b, pools),
                          gates[start : start + qlen].float(), plan.positions(b, q.device), self.cfg, scale)
        out[start : start + qlen] = o.to(out.dtype)

    def select(self, plan: NSAStepPlan, q: torch.Tensor, ckf: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
        """Every row's selected blocks [T, Hkv, top_n] int32 (-1 padded), by the reference's scores
        and rule, with each row's sequence and key index (int32 [T]): the Triton kernel's inputs."""
        cfg, hkv = self.cfg, ckf.shape[1]
        idx = torch.full((q.shape[0], hkv, cfg.top_n), -1, dtype=torch.int32, device=q.device)
        row_seq, row_pos = plan.row_units(q.device)
        for b, (start, qlen, num_keys, table) in enumerate(plan.seqs):
            if num_keys == 0:  # an empty part: its rows attend nothing (their branches stay empty)
                continue
            pos = row_pos[start : start + qlen].long()
            i = torch.arange(cfg.num_compressed(num_keys), device=table.device)
            ck = ckf[compressed_slots(table, i, cfg, plan.meta.block_size, self.slots_per_block)].float()
            p = compressed_probs(q[start : start + qlen].float(), ck, pos, cfg, scale)
            scores = selection_scores(p, q.shape[1] // hkv, -(-num_keys // cfg.select_block), cfg)
            idx[start : start + qlen] = select_blocks(scores, pos, cfg).to(torch.int32)
        return idx, row_seq, row_pos
