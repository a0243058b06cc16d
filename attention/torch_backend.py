"""Torch reference attention over the paged cache: the oracle for every other backend, and the
CPU serving path.

Decode rows of a batch are handled together: by the native CPU kernel (`cpu_kernels`, reading
K/V straight out of the paged cache) when it builds here, else by one gather of their blocks and
two batched matmuls. Prefill chunks of up to NATIVE_PREFILL_MAX_QLEN tokens join the native call
as one row per token (with its causal key count); longer ones, and all of them on the plain-torch
path, go one sequence at a time through SDPA. Grouped-query heads are folded into the query-row dimension
(q viewed as [kv_heads, group * rows, head_dim]) so no K/V head is ever repeated in memory.
Index tensors and masks are planned once per step and shared by all layers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from cuttle.attention import cpu_kernels
from cuttle.attention.backend import write_kv
from cuttle.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, native: bool = True) -> None:
        """native=False keeps every path in plain torch (the oracle the native kernel is tested against)."""
        self._plan: _StepPlan | None = None
        self.native = native and cpu_kernels.load() is not None

    def begin_step(self, meta: AttentionMetadata) -> None:
        self._plan = _StepPlan(meta)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if self._plan is None or self._plan.meta is not meta:
            self._plan = _StepPlan(meta)
        plan = self._plan
        out = torch.empty_like(q)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        group = q.shape[1] // num_kv_heads

        prefills = plan.prefills
        if self.native and cpu_kernels.supports(q, k_cache, out):
            # decode rows, and every row of short prefill chunks (each a query row with its own
            # causal length), in one native call; longer chunks stay with SDPA below
            native = plan.plan_native(NATIVE_PREFILL_MAX_QLEN)
            if native.rows is not None:
                cpu_kernels.paged_decode_attention(
                    q, k_cache, v_cache, out, native.rows, native.tables, native.lens, native.max_len, scale,
                )
            prefills = native.prefills_left
        elif plan.decode_rows is not None:
            # Gather straight into [Bd, Hkv, L, D] (one indexed copy, no transpose pass), then two
            # batched matmuls with the softmax in fp32.
            heads = plan.head_index(num_kv_heads)
            plan.plan_decode_gather()
            kd = k_cache.view(-1, num_kv_heads, head_dim)[plan.decode_slots, heads]
            vd = v_cache.view(-1, num_kv_heads, head_dim)[plan.decode_slots, heads]
            qd = q[plan.decode_rows].view(-1, num_kv_heads, group, head_dim)  # [Bd, Hkv, G, D]
            # Few rows: fp32 (bf16 batched matmul is slow for tiny batches). Many rows: keep the
            # cache dtype, as the fp32 copies of K/V would cost more than the matmuls themselves.
            if kd.dtype != torch.float32 and kd.shape[0] * num_kv_heads < 64:
                kd, vd, qd = kd.float(), vd.float(), qd.float()
            scores = torch.matmul(qd, kd.transpose(-1, -2)).float().mul_(scale).add_(plan.decode_bias)
            od = torch.matmul(torch.softmax(scores, dim=-1).to(vd.dtype), vd)
            out[plan.decode_rows] = od.reshape(-1, q.shape[1], head_dim).to(out.dtype)

        for start, qlen, blocks, mask in prefills:
            kp = k_cache[blocks].view(-1, num_kv_heads, head_dim).transpose(0, 1)  # [Hkv, L, D]
            vp = v_cache[blocks].view(-1, num_kv_heads, head_dim).transpose(0, 1)
            if mask is None:  # a fresh prompt: plain causal attention over exactly its own keys
                qh = q[start : start + qlen].transpose(0, 1)  # [Hq, qlen, D]
                op = F.scaled_dot_product_attention(
                    qh, kp[:, :qlen], vp[:, :qlen], is_causal=True, scale=scale, enable_gqa=group > 1
                )
                out[start : start + qlen] = op.transpose(0, 1)
                continue
            # [qlen, Hq, D] -> [Hkv, G*qlen, D], row index g*qlen + j, so K/V are never repeated
            qp = q[start : start + qlen].view(qlen, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
            qp = qp.reshape(num_kv_heads, group * qlen, head_dim)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask.repeat(group, 1), scale=scale)
            op = op.view(num_kv_heads, group, qlen, head_dim).permute(2, 0, 1, 3)
            out[start : start + qlen] = op.reshape(qlen, -1, head_dim)
        return out


# Prefill chunks up to this many tokens go through the native kernel row by row (row j of a chunk
# reads its j + cached keys, so the work grows with the square of the chunk while SDPA's flash
# kernel tiles it). Measured on the 0.6B model's shape (16 heads, head_dim 128, bf16): a 128-token
# prompt per layer takes ~0.3 ms this way against ~1.3-2.4 ms in SDPA, whose per-call overhead
# dominates at that size.
NATIVE_PREFILL_MAX_QLEN = 256


class _NativeRows:
    """The rows of one step the native kernel takes: per query row, its block table and key count."""

    __slots__ = ("rows", "tables", "lens", "max_len", "prefills_left", "max_qlen")

    def __init__(self, plan: "_StepPlan", max_qlen: int) -> None:
        meta = plan.meta
        device = meta.block_tables.device
        starts = meta.query_start_loc.tolist()
        rows: list[int] = []
        seq_of_row: list[int] = []
        lens: list[int] = []
        taken: set[int] = set()
        for b, qlen in enumerate(meta.query_lens_cpu):
            if qlen > max_qlen:
                continue
            kv_len = meta.seq_lens_cpu[b]
            rows.extend(range(starts[b], starts[b] + qlen))
            seq_of_row.extend([b] * qlen)
            lens.extend(range(kv_len - qlen + 1, kv_len + 1))  # causal: row j sees keys 0 .. cached + j
            taken.add(starts[b])
        self.max_qlen = max_qlen
        self.prefills_left = [p for p in plan.prefills if p[0] not in taken]
        self.rows = self.tables = self.lens = None
        self.max_len = 0
        if rows:
            self.max_len = max(lens)
            nblocks = (self.max_len + meta.block_size - 1) // meta.block_size
            self.rows = torch.tensor(rows, device=device)
            self.tables = meta.block_tables[torch.tensor(seq_of_row, device=device), :nblocks].to(torch.int32).contiguous()
            self.lens = torch.tensor(lens, dtype=torch.int32, device=device)


class _StepPlan:
    """Gather indices and masks for one step; built once and reused by every layer."""

    __slots__ = ("meta", "decode_rows", "decode_tables", "decode_lens", "decode_max_len", "decode_slots",
                 "decode_bias", "prefills", "_heads", "_native")

    def __init__(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        bs = meta.block_size
        device = meta.block_tables.device
        starts = meta.query_start_loc.tolist()
        decode_seqs = [b for b, ql in enumerate(meta.query_lens_cpu) if ql == 1]
        self.decode_rows: torch.Tensor | None = None  # [Bd] int64 query row of each decode sequence
        self.decode_tables: torch.Tensor | None = None  # [Bd, nb] int32 block ids
        self.decode_lens: torch.Tensor | None = None  # [Bd] int32 keys per sequence
        self.decode_max_len = 0
        self.decode_slots: torch.Tensor | None = None  # [Bd, 1, L] flat cache slot of each key (gather path)
        self.decode_bias: torch.Tensor | None = None  # [Bd, 1, 1, L] 0 for real keys, -inf past the end
        self._heads: torch.Tensor | None = None
        self._native: _NativeRows | None = None
        if decode_seqs:
            idx = torch.tensor(decode_seqs, device=device)
            self.decode_max_len = max(meta.seq_lens_cpu[b] for b in decode_seqs)
            nblocks = (self.decode_max_len + bs - 1) // bs
            self.decode_tables = meta.block_tables[idx, :nblocks].to(torch.int32).contiguous()
            self.decode_lens = meta.seq_lens[idx].to(torch.int32).contiguous()
            self.decode_rows = torch.tensor([starts[b] for b in decode_seqs], device=device)
        self.prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []
        for b, qlen in enumerate(meta.query_lens_cpu):
            if qlen == 1:
                continue
            kv_len = meta.seq_lens_cpu[b]
            nblocks = (kv_len + bs - 1) // bs
            blocks = meta.block_tables[b, :nblocks].long()
            mask = None
            if kv_len != qlen:  # a chunk after cached tokens: causal with an offset
                qpos = torch.arange(kv_len - qlen, kv_len, device=device)
                mask = torch.arange(nblocks * bs, device=device)[None, :] <= qpos[:, None]  # [qlen, L]
            self.prefills.append((starts[b], qlen, blocks, mask))

    def plan_decode_gather(self) -> None:
        """Slot indices and the length mask of the gather path, built on first use in a step."""
        if self.decode_slots is not None:
            return
        bs, max_len, device = self.meta.block_size, self.decode_max_len, self.decode_tables.device
        offs = torch.arange(bs, device=device)
        slots = self.decode_tables.long()[:, :, None] * bs + offs
        self.decode_slots = slots.reshape(len(self.decode_lens), 1, -1)[:, :, :max_len]
        valid = torch.arange(max_len, device=device)[None, :] < self.decode_lens[:, None]
        bias = torch.zeros(valid.shape, dtype=torch.float32, device=device).masked_fill_(~valid, float("-inf"))
        self.decode_bias = bias[:, None, None, :]

    def plan_native(self, max_qlen: int) -> _NativeRows:
        """The native kernel's rows for this step, built on first use."""
        if self._native is None or self._native.max_qlen != max_qlen:
            self._native = _NativeRows(self, max_qlen)
        return self._native

    def head_index(self, num_kv_heads: int) -> torch.Tensor:
        if self._heads is None or self._heads.shape[1] != num_kv_heads:
            self._heads = torch.arange(num_kv_heads, device=self.meta.block_tables.device)[None, :, None]
        return self._heads
