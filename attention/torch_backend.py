"""Torch reference attention over the paged cache: the oracle for every other backend, and the
CPU serving path. Returns each query row's output and the log-sum-exp of its scaled scores.

Decode rows of a batch are handled together: by the native CPU kernel (`native_attention`,
reading K/V straight out of the paged cache) when it builds here, else by one gather of their
blocks and two batched matmuls. Prefill chunks of up to NATIVE_PREFILL_MAX_QLEN tokens join the
native call as one row per token (with its causal key count); longer ones, and all of them on the
plain-torch path, go one sequence at a time through torch's CPU flash attention in fp32 (SDPA's
kernel, called directly because it also returns the log-sum-exp). A batch-invariant step
(`native.invariance`) sends every chunk to the native rows: SDPA tiles by the chunk's length, so a
token would otherwise depend on how its prompt was chunked. Grouped-query heads are never
repeated in memory. Index tensors and masks are planned once per step and shared by all layers.

A segmented step (`meta.segments`, see metadata.py) runs the same machinery over its parts: the
query rows of each (sequence, segment) part are copied (and rotated by the part's RoPE offset),
attended against that segment alone (full or causal), and merged per row by the log-sum-exp.

Blocks of the host pool (`HOST_BLOCK` ids, `meta.host_kv`: read in place) are read where they
lie: the native kernel picks the pool per block; the torch paths gather each block from its pool.

Sliding windows (`set_windows`: layer -> W, Mistral's / StarCoder2's / Qwen2's): a query at
position p attends keys p - W + 1 .. p. A windowed layer of a step whose sequences all fit in W
runs as any other; otherwise it takes a plan of its own (`_StepPlan(meta, window)`, made once a
step per window): native rows start at their window's block with the keys before the window in
it skipped (`skips`, weight exactly 0), the decode gather path's bias masks them, and SDPA chunks
read from their first window's block under a causal-and-window bias. Segmented steps (squid's
documents) window by position too: a part's keys sit from its `pos_base` on (where squid places a
document), so a query row sees the keys of each part within W - 1 positions of it; a part wholly
before a row's window is neutral in that row's merge (output 0, log-sum-exp -inf), exactly what
one dense forward with the window by position computes (`CausalLM.forward_masked`).
"""
from __future__ import annotations

import torch

from cuttle.attention import native_attention
from cuttle.attention.native import invariance
from cuttle.attention.backend import checked_windows, gather_pools, write_kv
from cuttle.attention.metadata import HOST_BLOCK, AttentionMetadata


class TorchAttentionBackend:
    name = "torch"
    takes_segments = True

    def __init__(self, native: bool = True) -> None:
        """native=False keeps every path in plain torch (the oracle the native kernel is tested against)."""
        self._plan: _StepPlan | None = None
        self.native = native and native_attention.available()
        self.windows: dict[int, int] = {}  # layer -> sliding window W (absent: every position)

    def set_windows(self, windows: dict[int, int]) -> None:
        """The model's sliding windows, per layer id (layers not named attend every position)."""
        self.windows = checked_windows(windows)

    def begin_step(self, meta: AttentionMetadata) -> None:
        self._plan = _StepPlan(meta)
        if self.native and meta.max_query_len == 1:
            # an all-decode step's native rows now, before the layers (a recorded step,
            # `native.graph`, must not make its first tensors inside the capture)
            self._plan.plan_native(_native_max_qlen())

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if self._plan is None or self._plan.meta is not meta:
            self._plan = _StepPlan(meta)
        plan = self._plan
        k_host, v_host = meta.host_kv[layer] if meta.host_kv is not None else (None, None)
        window = self.windows.get(layer)
        if window is not None:
            plan = plan.windowed(window)
        if meta.segments is not None:
            return self._segmented(q, k_cache, v_cache, k_host, v_host, plan, scale)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        group = q.shape[1] // num_kv_heads

        prefills = plan.prefills
        if self.native and native_attention.supports(q, k_cache, out):
            # decode rows, and every row of short prefill chunks (each a query row with its own
            # causal length), in one native call; longer chunks stay with SDPA below
            native = plan.plan_native(_native_max_qlen())
            if native.rows is not None:
                native_attention.paged_attention_rows(
                    q, k_cache, v_cache, out, lse, native.rows, native.rows, native.tables, native.lens,
                    scale, k_host, v_host, native.skips,
                )
            prefills = native.prefills_left
        elif plan.has_decode:
            # Gather straight into [Bd, Hkv, L, D] (one indexed copy, no transpose pass), then two
            # batched matmuls with the softmax in fp32.
            heads = plan.head_index(num_kv_heads)
            plan.plan_decode_gather()
            assert plan.decode_rows is not None
            kd = _take_slots(k_cache, k_host, plan.decode_slots, plan.decode_host, heads)
            vd = _take_slots(v_cache, v_host, plan.decode_slots, plan.decode_host, heads)
            qd = q[plan.decode_rows].view(-1, num_kv_heads, group, head_dim)  # [Bd, Hkv, G, D]
            # Few rows: fp32 (bf16 batched matmul is slow for tiny batches). Many rows: keep the
            # cache dtype, as the fp32 copies of K/V would cost more than the matmuls themselves.
            if kd.dtype != torch.float32 and kd.shape[0] * num_kv_heads < 64:
                kd, vd, qd = kd.float(), vd.float(), qd.float()
            scores = torch.matmul(qd, kd.transpose(-1, -2)).float().mul_(scale).add_(plan.decode_bias)
            lse_d = torch.logsumexp(scores, dim=-1)  # [Bd, Hkv, G]
            probs = scores.sub_(lse_d[..., None]).exp_()
            od = torch.matmul(probs.to(vd.dtype), vd)
            out[plan.decode_rows] = od.reshape(-1, q.shape[1], head_dim).to(out.dtype)
            lse[plan.decode_rows] = lse_d.reshape(-1, q.shape[1])

        for start, qlen, blocks, kv_len, causal, mask in prefills:
            bias = plan.bias(start, mask)
            o, l = _attend(q[start : start + qlen], k_cache, v_cache, k_host, v_host, blocks, kv_len, causal, bias, scale)
            out[start : start + qlen] = o
            lse[start : start + qlen] = l
        return out, lse

    def _segmented(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_host: torch.Tensor | None,
        v_host: torch.Tensor | None, plan: _StepPlan, scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sb = plan.meta.segments
        assert sb is not None
        qv = sb.virtual_queries(q)
        ov = torch.empty(qv.shape, dtype=torch.float32, device=q.device)
        lv = torch.empty(qv.shape[:2], dtype=torch.float32, device=q.device)
        parts = plan.parts
        if self.native and native_attention.supports(qv, k_cache, ov):
            native = plan.plan_native(_native_max_qlen())
            if native.rows is not None:
                native_attention.paged_attention_rows(
                    qv, k_cache, v_cache, ov, lv, native.rows, native.rows, native.tables, native.lens,
                    scale, k_host, v_host, native.skips,
                )
            if native.unseen is not None:  # rows before whose window the whole part lies
                ov[native.unseen] = 0.0
                lv[native.unseen] = float("-inf")
            parts = native.prefills_left
        for start, qlen, blocks, kv_len, causal, mask in parts:
            if kv_len == 0:  # an empty segment, or one wholly before its rows' windows: neutral in the merge
                ov[start : start + qlen] = 0.0
                lv[start : start + qlen] = float("-inf")
                continue
            bias = plan.bias(start, mask)
            o, l = _attend(qv[start : start + qlen], k_cache, v_cache, k_host, v_host, blocks, kv_len, causal, bias, scale)
            ov[start : start + qlen] = o
            lv[start : start + qlen] = l
            unseen = plan.unseen(start, mask)
            if unseen is not None:  # some rows see none of the part's keys (their scores all -inf)
                ov[unseen] = 0.0
                lv[unseen] = float("-inf")
        return sb.merge(ov, lv, q)


def _take_blocks(cache: torch.Tensor, host: torch.Tensor | None, blocks: torch.Tensor) -> torch.Tensor:
    """cache[blocks], except that HOST_BLOCK ids come from the host pool (a copy either way)."""
    return gather_pools(cache, host, blocks, HOST_BLOCK)


def _take_slots(
    cache: torch.Tensor, host: torch.Tensor | None, slots: torch.Tensor, on_host: torch.Tensor | None, heads: torch.Tensor
) -> torch.Tensor:
    """[Bd, Hkv, L, D]: the keys (or values) at flat `slots` [Bd, 1, L] of each head, those with
    `on_host` set from the host pool."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    flat = cache.view(-1, num_kv_heads, head_dim)
    if on_host is None:
        return flat[slots, heads]
    dev = flat[slots.masked_fill(on_host, 0), heads]
    cold = host.view(-1, num_kv_heads, head_dim)[slots.masked_fill(~on_host, 0), heads]
    return torch.where(on_host[..., None], cold, dev)


def _attend(
    q: torch.Tensor,  # [qlen, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_host: torch.Tensor | None,  # the host pool's caches (HOST_BLOCK ids), or None
    v_host: torch.Tensor | None,
    blocks: torch.Tensor,  # [nb] int64 block ids holding the keys
    kv_len: int,
    causal: bool,
    bias: torch.Tensor | None,  # [qlen, nb * block_size] fp32 additive (0 / -inf); None: see below
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's (or part's) rows against its keys: (o [qlen, Hq, D], lse [qlen, Hq]), both
    fp32. Without a bias a causal unit is a fresh prompt (kv_len == qlen: plain causal) and a full
    one sees all kv_len keys.

    The math is fp32 whatever the cache dtype: torch's bf16 flash kernel rounds the probabilities
    to bf16 before p.V (about 1.3x the error of fp32 math), and fp32 flash is still 2-4x faster
    than the math path SDPA used to take here (for 3-D inputs)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    kp = _take_blocks(k_cache, k_host, blocks).view(-1, num_kv_heads, head_dim).transpose(0, 1)  # [Hkv, L, D]
    vp = _take_blocks(v_cache, v_host, blocks).view(-1, num_kv_heads, head_dim).transpose(0, 1)
    if bias is None:
        kp, vp = kp[:, :kv_len], vp[:, :kv_len]
    qh = q.transpose(0, 1)[None].float()  # [1, Hq, qlen, D]
    o, lse = _sdpa_lse(qh, kp[None].float(), vp[None].float(), causal and bias is None, bias, scale)
    return o[0].transpose(0, 1), lse[0].transpose(0, 1)


def _sdpa_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, bias: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scaled dot-product attention that also returns the log-sum-exp: q [1, Hq, M, D], k/v
    [1, Hkv, N, D] (Hq a multiple of Hkv), bias additive [M, N] or None, causal aligned at the
    start (M == N)."""
    if q.device.type == "cpu":
        # SDPA's own CPU kernel (flash, GQA-aware); SDPA does not hand out its log-sum-exp
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        scores.masked_fill_(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if bias is not None:
        scores += bias
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v), lse


# Prefill chunks up to this many tokens go through the native kernel row by row (row j of a chunk
# reads its j + cached keys, so the work grows with the square of the chunk while SDPA's flash
# kernel tiles it). Measured on the 0.6B model's shape (16 heads, head_dim 128, bf16): a 128-token
# prompt per layer takes ~0.3 ms this way against ~1.3-2.4 ms in SDPA, whose per-call overhead
# dominates at that size.
NATIVE_PREFILL_MAX_QLEN = 256
# ... and only while the chunk's rows read few keys in all: the native kernel streams each row's
# keys on its own, so a chunk over a long cached context reads that context once per row (a
# 64-token turn resumed on a 4k-token history read the history 64 times per layer: 2 GB a layer
# on the 0.6B shape), where SDPA reads it once for the whole chunk. Decode rows (qlen 1) always
# stay native.
NATIVE_PREFILL_MAX_KEY_READS = 64 * 1024


def _native_max_qlen() -> int | None:
    """The chunk limit of the native rows, None (no limit: neither of the two above) for a
    batch-invariant step (`native.invariance`): SDPA's flash kernel tiles a chunk by its length,
    so a token attended in a long chunk would differ from the same token in a short chunk or a
    decode row, and how a prompt is chunked depends on the other requests of the step."""
    return None if invariance.on() else NATIVE_PREFILL_MAX_QLEN

# One attention unit of a step: a sequence (one-segment steps) or a part (segmented steps).
# (first query row, query rows, block ids [nb] int64, keys, causal, mask [qlen, nb * bs] or None)
_Unit = tuple[int, int, torch.Tensor, int, bool, torch.Tensor | None]


# arange(n) int64 per row count: the query (and output) rows of an all-decode step
_ROWS: dict[int, torch.Tensor] = {}


def _read_directly(tables: torch.Tensor, lens: torch.Tensor) -> bool:
    """Whether the native kernel can take a step's block tables and key counts as they are."""
    return (tables.dtype == torch.int32 and tables.stride(1) == 1 and tables.is_cpu and lens.dtype == torch.int32
            and lens.is_contiguous())


class _NativeRows:
    """The rows of one step the native kernel takes: per query row, its block table and key count.

    A step of decode rows only (one causal segment each) hands the kernel the metadata's own
    block tables and lengths and a shared arange of rows: no tensor is made per step, so a
    recorded step (`native.graph`) reads whatever the metadata tensors hold when it replays.

    Under a sliding window each row's table starts at its window's block and `skips` its keys
    before the window there; a row that sees none of a part's keys (the part lies wholly before
    its window) is left out and listed in `unseen`, to be made neutral in the merge."""

    __slots__ = ("rows", "tables", "lens", "skips", "unseen", "prefills_left", "max_qlen")

    def __init__(self, plan: _StepPlan, max_qlen: int | None) -> None:
        meta = plan.meta
        self.max_qlen = max_qlen
        self.skips: torch.Tensor | None = None  # [N] int32 keys before each row's window in its first block
        self.unseen: torch.Tensor | None = None  # rows whose window holds none of their part's keys
        # one query row per sequence (a 0-token row would make the shared arange name q / out rows
        # past the step's tokens: the general path below takes such a step row by row)
        sb = meta.segments
        if (sb is None and meta.max_query_len == 1 and min(meta.query_lens_cpu, default=0) == 1
                and _read_directly(meta.block_tables, meta.seq_lens)):
            wr = meta.window_rows
            if plan.window is not None and wr is not None and wr.window == plan.window:  # cut already (a step graph's)
                self._direct(meta.num_seqs, wr.tables, wr.lens)
                self.skips = wr.skips
                return
            self._direct(meta.num_seqs, meta.block_tables, meta.seq_lens)
            if plan.window is not None:  # each row is its sequence's last key: its window starts W - 1 before it
                self._cut((self.lens.long() - plan.window).clamp(min=0), meta.block_size)
            return
        if sb is not None and plan.window is None and sb.max_query_len == 1 and _read_directly(sb.block_tables, sb.kv_lens):
            # a decode step over segments (squid's documents): one virtual row per part, reading
            # the part's own table and length
            self._direct(sb.num_parts, sb.block_tables, sb.kv_lens)
            return
        block_size = meta.block_size
        rows: list[int] = []
        unit_of_row: list[int] = []
        lens: list[int] = []
        firsts: list[int] = []  # under a window: each row's first key in it
        unseen: list[int] = []
        taken: set[int] = set()
        for u, (start, qlen, kv_len, causal) in enumerate(plan.units):
            if max_qlen is not None and (qlen > max_qlen or (qlen > 1 and qlen * kv_len > NATIVE_PREFILL_MAX_KEY_READS)):
                continue
            row_lens = list(range(kv_len - qlen + 1, kv_len + 1)) if causal else [kv_len] * qlen  # causal: row j sees keys 0 .. cached + j
            if plan.window is None:
                rows.extend(range(start, start + qlen))
                unit_of_row.extend([u] * qlen)
                lens.extend(row_lens)
            else:
                gap = plan.gaps[u]
                for j, n in enumerate(row_lens):
                    first = max(0, gap + j - plan.window + 1)
                    if first >= n:
                        unseen.append(start + j)
                        continue
                    rows.append(start + j)
                    unit_of_row.append(u)
                    lens.append(n)
                    firsts.append(first)
            if rows and rows[-1] >= start:
                taken.add(start)
            elif unseen and unseen[-1] >= start:  # every row of the part: neutral, here
                taken.add(start)
        self.prefills_left = [p for p in plan.prefills if p[0] not in taken]
        self.rows = self.tables = self.lens = None
        device = plan.tables.device
        if unseen:
            self.unseen = torch.tensor(unseen, device=device)
        if rows:
            nblocks = max(1, (max(lens) + block_size - 1) // block_size)
            self.rows = torch.tensor(rows, device=device)
            self.tables = plan.tables[torch.tensor(unit_of_row, device=device), :nblocks].to(torch.int32).contiguous()
            self.lens = torch.tensor(lens, dtype=torch.int32, device=device)
            if plan.window is not None:
                self._cut(torch.tensor(firsts, device=device), block_size)

    def _direct(self, n: int, tables: torch.Tensor, lens: torch.Tensor) -> None:
        """Rows 0 .. n-1, each reading its own row of the metadata's `tables` and `lens` as they
        are: no tensor is made per step, so a recorded step reads whatever they hold."""
        arange = _ROWS.get(n)
        if arange is None:
            arange = _ROWS[n] = torch.arange(n)
        self.rows, self.tables, self.lens = arange, tables, lens
        self.prefills_left = []

    def _cut(self, first: torch.Tensor, block_size: int) -> None:
        """Each row's keys from its `first` on [N] int64: its table from that key's block, its count
        less that block's start, and the keys of that block before `first` skipped."""
        assert self.tables is not None and self.lens is not None
        lens = self.lens.long()
        start_block = first // block_size
        nb = self.tables.shape[1]
        cols = (torch.arange(nb, device=lens.device)[None, :] + start_block[:, None]).clamp(max=nb - 1)
        self.tables = self.tables.gather(1, cols.to(self.tables.device)).to(torch.int32).contiguous()
        self.lens = (lens - start_block * block_size).to(torch.int32).contiguous()
        self.skips = (first - start_block * block_size).to(torch.int32).contiguous()


class _StepPlan:
    """Gather indices and masks for one step; built once and reused by every layer.

    `units` are what gets attended: the sequences of a one-segment step, or the parts of a
    segmented one (then `prefills` lists every part, since all of them may need the torch path).
    A sliding window's plan (`windowed`) masks each query at position p to keys p - W + 1 .. p,
    positions measured in the sequence: a part's keys from its `pos_base` on (squid places a
    document there), its query rows from the sequence's first new token."""

    __slots__ = ("meta", "units", "gaps", "tables", "decode_rows", "decode_tables", "decode_lens", "decode_max_len",
                 "decode_slots", "decode_host", "decode_bias", "prefills", "has_decode", "_heads", "_native", "_bias",
                 "_unseen", "window", "reach", "_windowed")

    def __init__(self, meta: AttentionMetadata, window: int | None = None) -> None:
        self.meta = meta
        self.window = window  # a sliding window's plan: keys p - W + 1 .. p per query p
        self._windowed: dict[int, _StepPlan] = {}
        bs = meta.block_size
        self.decode_rows: torch.Tensor | None = None  # [Bd] int64 query row of each decode sequence
        self.decode_tables: torch.Tensor | None = None  # [Bd, nb] int32 block ids
        self.decode_lens: torch.Tensor | None = None  # [Bd] int32 keys per sequence
        self.decode_max_len = 0
        self.decode_slots: torch.Tensor | None = None  # [Bd, 1, L] flat cache slot of each key (gather path)
        self.decode_bias: torch.Tensor | None = None  # [Bd, 1, 1, L] 0 for real keys, -inf past the end
        self.decode_host: torch.Tensor | None = None  # [Bd, 1, L] key in the host pool; None: none is
        self._heads: torch.Tensor | None = None
        self._native: _NativeRows | None = None
        self._bias: dict[int, torch.Tensor] = {}
        self._unseen: dict[int, torch.Tensor | None] = {}
        self.prefills: list[_Unit] = []
        self.has_decode = False  # some sequence has a single query row (one-segment steps)
        sb = meta.segments
        if sb is not None:
            starts = sb.query_start_loc.tolist()
            self.tables = sb.block_tables
            self.units = list(zip(starts[:-1], sb.query_lens_cpu, sb.kv_lens_cpu, sb.causal_cpu))
            # per part: its first query row's position less its first key's
            self.gaps = [q - k for q, k in zip(sb.query_pos_cpu, sb.key_pos_cpu)]
            for p, (start, qlen, kv_len, causal) in enumerate(self.units):
                self.prefills.append(_unit(self.tables, p, start, qlen, kv_len, causal, bs, window, self.gaps[p]))
            # the farthest any row is from a key it may see, plus one: past W a window cuts keys
            self.reach = max((g + q for g, q in zip(self.gaps, sb.query_lens_cpu)), default=0)
            return
        starts = meta.query_start_loc.tolist()
        self.tables = meta.block_tables
        self.units = [(starts[b], ql, meta.seq_lens_cpu[b], True) for b, ql in enumerate(meta.query_lens_cpu)]
        self.gaps = [kv - ql for kv, ql in zip(meta.seq_lens_cpu, meta.query_lens_cpu)]
        self.has_decode = any(ql == 1 for ql in meta.query_lens_cpu)
        self.reach = max(meta.seq_lens_cpu, default=0)
        for b, qlen in enumerate(meta.query_lens_cpu):
            if qlen != 1:
                self.prefills.append(_unit(meta.block_tables, b, starts[b], qlen, meta.seq_lens_cpu[b], True, bs, window))

    def windowed(self, window: int) -> _StepPlan:
        """This step's plan under a sliding window of `window` keys, made on first use; this plan
        itself where no row of the step reaches a key W or more positions back, unless the step
        carries its rows cut to that window (a step graph's, which must read them at any length)."""
        wr = self.meta.window_rows
        if self.reach <= window and (wr is None or wr.window != window):
            return self
        plan = self._windowed.get(window)
        if plan is None:
            plan = self._windowed[window] = _StepPlan(self.meta, window)
        return plan

    @property
    def parts(self) -> list[_Unit]:
        return self.prefills

    def plan_decode_gather(self) -> None:
        """The decode rows' tables, slot indices and length mask for the gather path, built on first
        use in a step (the native kernel needs none of them)."""
        if self.decode_slots is not None:
            return
        meta, bs = self.meta, self.meta.block_size
        device = meta.block_tables.device
        starts = meta.query_start_loc.tolist()
        decode_seqs = [b for b, ql in enumerate(meta.query_lens_cpu) if ql == 1]
        idx = torch.tensor(decode_seqs, device=device)
        self.decode_max_len = max_len = max(meta.seq_lens_cpu[b] for b in decode_seqs)
        nblocks = (max_len + bs - 1) // bs
        self.decode_tables = meta.block_tables[idx, :nblocks].to(torch.int32).contiguous()
        self.decode_lens = meta.seq_lens[idx].to(torch.int32).contiguous()
        self.decode_rows = torch.tensor([starts[b] for b in decode_seqs], device=device)
        offs = torch.arange(bs, device=device)
        # (NULL_BLOCK entries, given back behind the window, lie wholly before it: masked below)
        tables = self.decode_tables.long().clamp(min=0)
        if self.meta.host_kv is not None:
            on_host = (tables >= HOST_BLOCK)[:, :, None].expand(-1, -1, bs)
            self.decode_host = on_host.reshape(len(self.decode_lens), 1, -1)[:, :, :max_len]
            tables = tables % HOST_BLOCK
        slots = tables[:, :, None] * bs + offs
        self.decode_slots = slots.reshape(len(self.decode_lens), 1, -1)[:, :, :max_len]
        keys = torch.arange(max_len, device=device)[None, :]
        valid = keys < self.decode_lens[:, None]
        if self.window is not None:
            valid &= keys >= self.decode_lens[:, None] - self.window
        bias = torch.zeros(valid.shape, dtype=torch.float32, device=device).masked_fill_(~valid, float("-inf"))
        self.decode_bias = bias[:, None, None, :]

    def plan_native(self, max_qlen: int | None) -> _NativeRows:
        """The native kernel's rows for this step (chunks up to `max_qlen` tokens; None: all),
        built on first use."""
        if self._native is None or self._native.max_qlen != max_qlen:
            self._native = _NativeRows(self, max_qlen)
        return self._native

    def bias(self, start: int, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The additive fp32 form of a unit's mask (the flash kernel takes no bool mask), made at
        the first layer that needs it."""
        if mask is None:
            return None
        if start not in self._bias:
            self._bias[start] = torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))
        return self._bias[start]

    def unseen(self, start: int, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The rows (of the virtual rows from `start`) to which a unit's mask shows no key: a
        window that ends before a part's first key. None: every row sees one."""
        if mask is None:
            return None
        if start not in self._unseen:
            rows = (~mask.any(1)).nonzero().squeeze(1)
            self._unseen[start] = rows + start if rows.numel() else None
        return self._unseen[start]

    def head_index(self, num_kv_heads: int) -> torch.Tensor:
        if self._heads is None or self._heads.shape[1] != num_kv_heads:
            self._heads = torch.arange(num_kv_heads, device=self.meta.block_tables.device)[None, :, None]
        return self._heads


def _unit(tables: torch.Tensor, row: int, start: int, qlen: int, kv_len: int, causal: bool, bs: int,
          window: int | None = None, gap: int | None = None) -> _Unit:
    """One unit's keys and mask. `gap`: its first query row's position less its first key's (a
    causal unit's, the default: kv_len - qlen); a window W shows row j the keys within W - 1
    positions of it."""
    nblocks = (kv_len + bs - 1) // bs
    if gap is None:
        gap = kv_len - qlen
    if window is not None and gap + qlen > window:
        first = max(0, gap - window + 1)  # the first row's first key in its window
        if first >= kv_len:  # (a full part) wholly before every row's window: neutral in the merge
            return (start, qlen, tables[row, :0].long(), 0, causal, None)
        # from the block of the first row's window on, under (causal and) window
        b0 = first // bs
        device = tables.device
        j = torch.arange(qlen, device=device)[:, None]
        kpos = torch.arange(b0 * bs, nblocks * bs, device=device)[None, :]
        mask = (kpos > gap + j - window) & (kpos < kv_len)  # [qlen, L]
        if causal:
            mask &= kpos <= kv_len - qlen + j
        return (start, qlen, tables[row, b0:nblocks].long(), kv_len - b0 * bs, causal, mask)
    blocks = tables[row, :nblocks].long()
    mask = None
    if causal and kv_len != qlen:  # a chunk after cached tokens: causal with an offset
        device = tables.device
        qpos = torch.arange(kv_len - qlen, kv_len, device=device)
        mask = torch.arange(nblocks * bs, device=device)[None, :] <= qpos[:, None]  # [qlen, L]
    return (start, qlen, blocks, kv_len, causal, mask)
