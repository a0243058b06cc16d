"""Triton paged-attention backend: writes this step's K/V with a Triton scatter, then runs the paged
attention kernel of triton_kernels.py over the flattened batch, returning each row's output and
log-sum-exp.

Owns the per-step plan: which query rows form which kernel tile, and how decode rows split their
keys. The plan is built from the metadata's host lists (no device sync) once per step and shared
by every layer. Never owns cache memory and never reorders the batch: output row t answers query
row t.

Decode sequences (one new token) get one tile each, split over their keys (flash-decoding) when
contexts are long. Prefill chunks get tiles of `block_m // group` new tokens each, so a tile holds
about `block_m` (query token, head) rows whatever the GQA group size.

A segmented step (`meta.segments`) runs the same kernel over its parts as if each were a
sequence: the parts' query rows are copied (rotated by a part's RoPE offset where it has one),
full-visibility parts are flagged to the kernel, and each row's parts are merged by their
log-sum-exp (`merge.py`, torch ops on the device).

Host-pool blocks (`HOST_BLOCK` ids, read in place) are read by the kernel from `meta.host_kv`.

Sliding windows (`set_windows`: layer -> W) are the kernel's `window`: each row masks keys before
its window and a tile's walk starts at its first row's window. A segmented step (squid's
documents) windows by position too: each part hands the kernel its first query row's position less
its first key's (`gaps`), so a row sees the keys of each part within W - 1 positions of it; a part
wholly before a row's window leaves that row at lse -inf, neutral in the merge.
"""
from __future__ import annotations

import torch
import triton

from cuttle.attention.backend import checked_windows
from cuttle.attention.metadata import AttentionMetadata
from cuttle.attention.triton_kernels import INTERPRETED, paged_attention, write_kv


class TritonAttentionBackend:
    name = "triton"
    takes_segments = True

    def __init__(self, block_m: int = 64, block_n: int = 64, split_len: int = 512, max_splits: int = 16) -> None:
        for label, value in (("block_m", block_m), ("block_n", block_n)):
            if value < 16 or value & (value - 1):
                raise ValueError(f"{label} must be a power of two >= 16, got {value}")
        if split_len < block_n or max_splits < 1:
            raise ValueError(f"need split_len >= block_n and max_splits >= 1, got {split_len}, {max_splits}")
        self.block_m = block_m
        self.block_n = block_n
        self.split_len = split_len
        self.max_splits = max_splits
        self._plan: _StepPlan | None = None
        self.windows: dict[int, int] = {}  # layer -> sliding window W (absent: every position)

    def set_windows(self, windows: dict[int, int]) -> None:
        """The model's sliding windows, per layer id (layers not named attend every position)."""
        self.windows = checked_windows(windows)

    def begin_step(self, meta: AttentionMetadata) -> None:
        self._plan = self._make_plan(meta)

    def _make_plan(self, meta: AttentionMetadata) -> _StepPlan:
        sb = meta.segments
        if sb is None:
            return _StepPlan(meta, meta.query_lens_cpu, meta.seq_lens_cpu, self.block_n, self.split_len, self.max_splits)
        plan = _StepPlan(meta, sb.query_lens_cpu, sb.kv_lens_cpu, self.block_n, self.split_len, self.max_splits)
        plan.full = 1 - sb.causal
        gaps = [q - k for q, k in zip(sb.query_pos_cpu, sb.key_pos_cpu)]
        plan.gaps = torch.tensor(gaps, dtype=torch.int32, device=sb.kv_lens.device)
        # the farthest any row is from a key it may see, plus one: past W a window cuts keys
        plan.reach = max((g + n for g, n in zip(gaps, sb.query_lens_cpu)), default=0)
        return plan

    @staticmethod
    def check_runs_on(device: torch.device, dtype: torch.dtype | None) -> None:
        """ValueError where the kernels cannot run: on CPU without the interpreter, or in the
        interpreter with bf16 (forward checks the same per call)."""
        if device.type == "cpu" and not INTERPRETED:
            raise ValueError("attention_backend='triton' on CPU needs the Triton interpreter (TRITON_INTERPRET=1 set before "
                             "triton is first imported; a test tool, slow): use attention_backend='torch' (the native CPU kernels)")
        if INTERPRETED and dtype == torch.bfloat16:
            raise ValueError("attention_backend='triton' under the Triton interpreter computes bf16 tl.dot wrongly: use "
                             "dtype float32 or float16, or attention_backend='torch'")

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
        if q.device.type == "cpu" and not INTERPRETED:
            raise RuntimeError(
                "the triton attention backend on CPU needs the Triton interpreter: set TRITON_INTERPRET=1 "
                "before triton is first imported, or use attention_backend='torch'"
            )
        if INTERPRETED and q.dtype == torch.bfloat16:
            # The interpreter keeps bf16 as raw uint16 and tl.dot multiplies those integers.
            raise NotImplementedError("the Triton interpreter computes bf16 tl.dot wrongly; use float32 or float16")
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if self._plan is None or self._plan.meta is not meta:
            self._plan = self._make_plan(meta)
        plan = self._plan
        host = meta.host_kv[layer] if meta.host_kv is not None else (None, None)
        if host[0] is not None and host[0].device != k_cache.device:
            raise NotImplementedError(
                "read in place on a GPU needs the host tier's device addresses (unified memory), which cuttle "
                "does not map yet: use copy-in (kv_read_in_place='never')"
            )
        sb = meta.segments
        window = self.windows.get(layer)
        if sb is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
            self._run(plan, q, k_cache, v_cache, host, out, lse, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                      None, scale, window)
            return out, lse
        if window is not None and plan.reach <= window:
            window = None  # no row reaches a key W or more positions back: the plan without it
        qv = sb.virtual_queries(q)
        ov = torch.empty(qv.shape, dtype=torch.float32, device=q.device)
        lv = torch.empty(qv.shape[:2], dtype=torch.float32, device=q.device)
        self._run(plan, qv, k_cache, v_cache, host, ov, lv, sb.query_start_loc, sb.kv_lens, sb.block_tables, plan.full,
                  scale, window, plan.gaps if window is not None else None)
        return sb.merge(ov, lv, q)

    def _run(
        self, plan: _StepPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        host: tuple[torch.Tensor | None, torch.Tensor | None], out: torch.Tensor, lse: torch.Tensor,
        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, full: torch.Tensor | None,
        scale: float, window: int | None = None, gaps: torch.Tensor | None = None,
    ) -> None:
        args = (query_start_loc, seq_lens, block_tables, scale, self.block_n)
        if plan.decode_seqs is not None:
            paged_attention(
                q, k_cache, v_cache, out, lse, plan.decode_seqs, plan.decode_offs, 1, *args,
                num_splits=plan.num_splits, split_len=plan.split_len, full=full, k_host=host[0], v_host=host[1], window=window,
                gaps=gaps,
            )
        if plan.prefill_seqs:
            group_pad = triton.next_power_of_2(q.shape[1] // k_cache.shape[2])
            block_q = max(1, self.block_m // group_pad)
            tile_seqs, tile_offs = plan.prefill_tiles(block_q)
            paged_attention(q, k_cache, v_cache, out, lse, tile_seqs, tile_offs, block_q, *args, full=full,
                            k_host=host[0], v_host=host[1], window=window, gaps=gaps)


class _StepPlan:
    """Tiles and decode split for one step; built once and reused by every layer. Its "sequences"
    are the step's sequences, or the parts of a segmented step."""

    __slots__ = ("meta", "query_lens", "full", "gaps", "reach", "decode_seqs", "decode_offs", "num_splits", "split_len",
                 "prefill_seqs", "_tiles")

    def __init__(
        self, meta: AttentionMetadata, query_lens: list[int], kv_lens: list[int], block_n: int, split_len: int,
        max_splits: int,
    ) -> None:
        self.meta = meta
        self.query_lens = query_lens
        self.full: torch.Tensor | None = None  # [parts] int32, 1 = full visibility (segmented steps)
        self.gaps: torch.Tensor | None = None  # [parts] int32 first query row's position less first key's (segmented)
        self.reach = 0
        device = meta.block_tables.device
        decode = [b for b, ql in enumerate(query_lens) if ql == 1]
        self.prefill_seqs = [b for b, ql in enumerate(query_lens) if ql > 1]
        self._tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.decode_seqs: torch.Tensor | None = None
        self.decode_offs: torch.Tensor | None = None
        self.num_splits = 1
        self.split_len = 0
        if not decode:
            return
        self.decode_seqs = torch.tensor(decode, dtype=torch.int32, device=device)
        self.decode_offs = torch.zeros(len(decode), dtype=torch.int32, device=device)
        max_len = max(kv_lens[b] for b in decode)
        splits = min(max_splits, triton.cdiv(max_len, split_len))
        if splits > 1:
            # Equal chunks, whole BLOCK_N steps each, covering the longest decode context.
            self.split_len = triton.cdiv(triton.cdiv(max_len, splits), block_n) * block_n
            self.num_splits = triton.cdiv(max_len, self.split_len)

    def prefill_tiles(self, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence, first new token) of every `block_q`-token tile of the prefill chunks."""
        if block_q not in self._tiles:
            qlens = self.query_lens
            seqs = [b for b in self.prefill_seqs for _ in range(triton.cdiv(qlens[b], block_q))]
            offs = [j for b in self.prefill_seqs for j in range(0, qlens[b], block_q)]
            device = self.meta.block_tables.device
            self._tiles[block_q] = (
                torch.tensor(seqs, dtype=torch.int32, device=device),
                torch.tensor(offs, dtype=torch.int32, device=device),
            )
        return self._tiles[block_q]
