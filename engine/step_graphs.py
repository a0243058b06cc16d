"""CPU decode steps replayed from kernel graphs (`cuttle.attention.native.graph`).

Owns one graph per decode batch size (up to `EngineConfig.cpu_graph_max_batch`; `enforce_eager`
turns them off), the static tensors each graph reads and writes, and when a graph may be trusted.
The runner asks `run(inputs)` first and runs the step eagerly whenever it answers None.

Larger batch sizes (up to `max_num_seqs`) get a graph only once they recur: a size is captured
after HOT_STEPS qualifying decode steps of it within a window of HOT_WINDOW such steps, and at
most `cpu_graph_hot_batches` of them are kept, the least recently replayed dropped to make room.
Every batch size's graph keeps its own buffers (~1 MB a row on the 8-layer MoE preset, the fp32
logits 0.6 MB of it; ~2 MB on the 28-layer Qwen3-0.6B shape), and a new graph costs steps: the capture runs the step eagerly while
recording it, and the next step of that size runs the replay and the eager step both (the
validation). So a size that only passes through (a batch shrinking as requests finish) stays
eager, while a steady batch (an offline wave, a server at steady concurrency) replays.

A step qualifies when every scheduled sequence decodes one token, its logits are exactly its rows,
and the model runs on CPU through the plain torch attention backend with the native kernels.
Sequences over segments (squid's documents, a shared prefix) qualify too: the step is then a
decode of one virtual row per part (each document, the prefix, the sequence's own tokens), and
its graph is keyed by that structure as well (parts, parts whose query is turned for a moved
document); `stage` writes the parts' lengths, tables, turns (cos / sin rows made once per rope
delta) and merge grouping into the graph's `SegmentBatch` each step, so one graph serves any
documents of that structure. At most MAX_SEGMENT_GRAPHS such graphs are kept (the least recently
used dropped). A window that cuts a part's keys or a sequence with drafts keeps such a step
eager. Under a sliding window a plain decode step replays past W too: every graph of such a model
keeps its rows cut to the window (`WindowRows`: each row's table from its window's block, its key
count from there and the keys of that block to skip), which `stage` fills per step and every
windowed layer reads, whatever the sequences' lengths (so a graph captured while they fit in W
replays past it). With a KV host tier (`host_kv`, set when it is attached) every graph hands the host pool to
the attention kernel, which picks the pool per block, so steps whose tables (or documents) name
host blocks read in place replay the same graphs as steps that name none. A sequence with drafts (speculative decoding, engine/spec_decode.py) counts as one row
per token it computes, each a query of its own over the keys up to it, so its step is a decode
step of that many rows and takes the graph of that row count. The first step of a batch size is captured: the eager forward and logits run for real on
the graph's own input tensors (token ids, positions, and the metadata's lengths, slots and block
tables, the latter sized for `max_model_len`), recording every kernel call. The next step of that
size replays the graph and is then also run eagerly; the graph is kept only if the two logits
agree bit for bit (a graph that holds a value of its capture step where the step's own should be
fails here), else that batch size stays eager. From then on a step is: write its inputs into the
graph's tensors (`stage`, called by the runner's `prepare` straight from the scheduled sequences,
so no per-step tensor or metadata is built), replay, and return the graph's logits tensor, which
stays valid until the next step (the sampler reads it in place). Each graph also records the
argmax of its logits rows after them, run only when the staged step's rows are all plain greedy
(`sampler.plain_greedy`; a flag the replay reads): the sampler then takes that pick
(`StepInputs.greedy`) instead of scanning the logits itself. A replay that diverges (a kernel
answers differently than at capture and no handler settles it, e.g. an out-of-range token id)
returns None, and the eager rerun writes the same KV slots again (and raises what it raises).

A step whose rows run under LoRA adapters (engine/lora.py; its delta a native kernel per
adapter's rows) has graphs of its own, keyed by the adapters' weights as well: a graph holds those
adapters' tensors, so a name reloaded with the same weights replays it and other weights get
another. A step mixing adapters, or adapters with the base model, is keyed by each adapter's rows
too (`adapter_key`), so it replays while its batch keeps that layout (a steady multi-adapter
batch) and a new layout captures another graph. At most MAX_ADAPTER_GRAPHS are kept (the least
recently used dropped).

Graphs hold addresses of weights, packed weights and caches: `clear()` drops them all; the
runner calls it whenever weights are loaded, moved or repacked (`ModelRunner.prepack`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from cuttle.attention import native
from cuttle.attention.metadata import HOST_BLOCK, AttentionMetadata, WindowRows
from cuttle.attention.native.argmax import argmax_into_if
from cuttle.attention.native.graph import GraphBreak, KernelGraph, capture
from cuttle.engine.sampler import plain_greedy

if TYPE_CHECKING:
    from cuttle.attention.rope import RotaryEmbedding
    from cuttle.engine.lora import LoRABatch
    from cuttle.engine.model_runner import StepInputs
    from cuttle.engine.sequence import Sequence

logger = logging.getLogger(__name__)

# Captures of one batch size that may break (a transient cause, e.g. a routing tie routed by the
# torch router during the capture step) before that size stays eager.
MAX_CAPTURE_TRIES = 3
# Graphs of steps whose rows run under LoRA adapters (keyed by the adapters' weights as
# well): at most this many are kept, the least recently used dropped to make room.
MAX_ADAPTER_GRAPHS = 8
# Graphs of steps over segments (squid's documents), keyed by their structure as well (parts,
# rotated parts): at most this many are kept, the least recently used dropped to make room.
MAX_SEGMENT_GRAPHS = 8
# A batch size above cpu_graph_max_batch is captured once it has run this many qualifying decode
# steps within a window of HOT_WINDOW such steps (the counts restart with each window).
HOT_STEPS = 16
HOT_WINDOW = 64


# (rows, torch threads, the kernel library, the step's LoRA adapters (`adapter_key`) or None,
# a step over segments: (parts, rotated parts), or None)
_Key = tuple[int, int, int, "bytes | tuple | None", "tuple[int, int] | None"]


@dataclass(slots=True)
class _SegmentViews:
    """numpy views of a segmented graph's `SegmentBatch` tensors, which `stage` fills per step."""

    kv_lens: np.ndarray  # [P] int32
    tables: np.ndarray  # [P, width] int32
    causal: np.ndarray  # [P] int32
    row_index: np.ndarray  # [P] int64
    merge_ptr: np.ndarray  # [B + 1] int64
    merge_idx: np.ndarray  # [P] int64
    rot_rows: np.ndarray | None  # [R] int64
    rot_cos: np.ndarray | None  # [R, half] fp32
    rot_sin: np.ndarray | None


@dataclass(slots=True)
class _Graph:
    """One batch size's graph and the tensors it reads (inputs) and writes (logits)."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    meta: AttentionMetadata  # seq_lens, slot_mapping, block_tables [B, width]: filled per step
    graph: KernelGraph | None = None
    logits: torch.Tensor | None = None  # [B, vocab] fp32, written by every replay
    hidden: torch.Tensor | None = None  # [B, hidden]: the final hidden states, written by every replay
    validated: bool = False
    last_used: int = 0  # DecodeGraphs._clock at its last step: the least recently used hot graph goes first
    rows: torch.Tensor | None = None  # arange(B): the logits rows of a staged step
    # the greedy pick, recorded after the logits: computed by a replay when want[0] is 1 (staged
    # steps whose every row is plain greedy), so the sampler need not scan the logits again
    want: torch.Tensor | None = None  # int32 [1]
    greedy: torch.Tensor | None = None  # int64 [B]
    np_want: np.ndarray | None = None
    # numpy views of the input tensors above: `stage` writes a step's inputs through them
    np_ids: np.ndarray | None = None
    np_positions: np.ndarray | None = None
    np_lens: np.ndarray | None = None
    np_slots: np.ndarray | None = None
    np_tables: np.ndarray | None = None
    seg: _SegmentViews | None = None  # a step over segments (squid's documents): its parts' tensors
    win: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # views of meta.window_rows (tables, lens, skips)


class DecodeGraphs:
    def __init__(self, max_batch: int, table_width: int, block_size: int, begin_step: Callable[[AttentionMetadata], None],
                 forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], tuple[torch.Tensor, torch.Tensor]],
                 greedy_pick: bool = True, hot_batches: int = 0, window: int | None = None,
                 rope: RotaryEmbedding | None = None) -> None:
        """`begin_step(meta)`: the attention backend's per-step planning (run before a capture, not
        recorded); `forward(input_ids, positions, meta)`: the model, and (the logits, the final
        hidden states) of every row (what a capture records); `greedy_pick`: whether a replay may also pick the argmax of
        plain-greedy steps (the engine's logprobs_mode is "processed", where those rows need
        nothing else); `hot_batches`: how many graphs of sizes above `max_batch` may be kept
        (captured once they recur, see the module docstring); `window`: the model's sliding window,
        whose rows every graph of a plain decode step keeps cut (`WindowRows`; a step over
        segments whose window cuts a part runs eagerly); `rope`: the model's RotaryEmbedding, whose
        tables turn the query for a document placed away from where it was encoded (steps over
        segments; None: such steps run eagerly)."""
        self.window = window
        self.rope = rope
        # the KV host tier's per-layer caches once attached (`ModelRunner.attach_host_tier`): every
        # graph then hands them to the attention kernel, and steps reading host blocks in place replay
        self.host_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._turns: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # rope delta -> (cos, sin) rows
        self.greedy_pick = greedy_pick
        self.max_batch = max_batch
        self.hot_batches = hot_batches
        self._seen: dict[_Key, int] = {}  # qualifying steps of each larger size in this window
        self._window = 0
        self._clock = 0  # qualifying steps so far: the hot graphs' recency
        self.table_width = table_width
        self.block_size = block_size
        self._begin_step = begin_step
        self._forward = forward
        self.hidden: torch.Tensor | None = None  # the final hidden states of the last step `run` answered
        self._graphs: dict[_Key, _Graph] = {}
        self._breaks: dict[_Key, int] = {}
        self._eager: set[_Key] = set()
        self.counters = {"graph_steps": 0, "graph_captures": 0, "graph_evictions": 0}
        # The capture's dispatch mode imports torch._dynamo on its first use (~1.3 s here): pay it at
        # load, not in the middle of the first decode step a user waits on.
        import torch._dynamo  # noqa: F401

    def clear(self) -> None:
        """Forget every graph (their weight and cache addresses may be stale) and every verdict."""
        self._graphs.clear()
        self._breaks.clear()
        self._eager.clear()
        self._seen.clear()
        self._window = 0

    def qualifies(self, inputs: StepInputs) -> bool:
        m = inputs.meta
        return (
            (m.host_kv is None or self.host_kv is not None) and m.max_query_len == 1 and 1 <= m.num_seqs
            and (m.num_seqs <= self.max_batch or self.hot_batches > 0)
            and inputs.logit_rows.numel() == m.num_seqs and inputs.input_ids.numel() == m.num_seqs and not inputs.prompt_rows
            and m.block_tables.dim() == 2 and m.block_tables.shape[1] <= self.table_width
            and (m.segments is None or self._segments_qualify(m))
        )

    def _segments_qualify(self, m: AttentionMetadata) -> bool:
        """A step over segments (squid's documents) replays when each part is one decode row over
        a table that fits, its rotation (if any) can be staged, and no window cuts a part's keys."""
        sb = m.segments
        assert sb is not None
        return (
            sb.max_query_len == 1 and sb.block_tables.shape[1] <= self.table_width
            and (sb.rot_rows is None or self.rope is not None)
            and (self.window is None or (max(m.seq_lens_cpu) <= self.window
                                         and max(q - k for q, k in zip(sb.query_pos_cpu, sb.key_pos_cpu)) < self.window))
        )

    @staticmethod
    def _shape(m: AttentionMetadata) -> tuple[int, int] | None:
        """A step's segment structure as a graph keys it: (parts, rotated parts), or None."""
        sb = m.segments
        if sb is None:
            return None
        return sb.num_parts, 0 if sb.rot_rows is None else sb.rot_rows.shape[0]

    def stage(self, scheduled: list[tuple[Sequence, int]], host_tier: bool, adapter: bytes | tuple | None = None) -> StepInputs | None:
        """The inputs of a decode step whose batch size has a trusted graph, written straight
        into that graph's tensors (no tensors are built for the step), or None: prepare the step
        the usual way. The step qualifies as in `qualifies`: every sequence decodes its last token
        (its table may name host-tier blocks, read in place, once the graphs hold the host tier;
        `host_tier`: a host pool exists, so without that tables are checked for its blocks), asks
        for no prompt logprobs and is not a document job. The
        returned inputs' tensors are the graph's own, so `run` replays without copying them.
        `adapter`: the step's `adapter_key` (None: the base model)."""
        from cuttle.engine.model_runner import StepInputs

        B = sum(n for _, n in scheduled)  # rows: a sequence with drafts has one per draft too
        if B > self.max_batch and not self.hot_batches:
            return None
        if any(seq.shared for seq, _ in scheduled):
            return self._stage_segments(scheduled, host_tier, adapter)
        g = self._graphs.get((B, torch.get_num_threads(), id(native.kernels()), adapter, None))
        if g is None or not g.validated:
            return None
        assert g.np_ids is not None and g.np_positions is not None and g.np_lens is not None
        assert g.np_slots is not None and g.np_tables is not None
        bs, width = self.block_size, self.table_width
        lens: list[int] = []
        greedy = self.greedy_pick
        i = 0
        for seq, n in scheduled:
            p = seq.num_computed_tokens
            table = seq.block_table
            req = seq.request
            draft = seq.draft
            if (n != 1 + len(draft) or p + 1 != len(seq.token_ids) or seq.shared or req.job is not None or len(table) > width
                    or (req.prompt_logprobs is not None and seq.index == 0 and len(req.prompt_logprobs) < seq.num_prompt_tokens)
                    or (host_tier and self.host_kv is None and any(b >= HOST_BLOCK for b in table))):
                return None  # what this wrote so far is overwritten by the next step's inputs
            # the last token's row, then each draft's (speculative decoding): a row of its own
            # over the keys up to it, as the runner's `prepare` lays them out
            for j in range(n):
                q = p + j
                g.np_ids[i] = seq.token_ids[p] if j == 0 else draft[j - 1]
                g.np_positions[i] = seq.pos_base + q
                g.np_lens[i] = q + 1
                g.np_slots[i] = table[q // bs] * bs + q % bs
                g.np_tables[i, : len(table)] = table
                if g.win is not None:
                    _cut_row(*g.win, i, table, q + 1, self.window, bs)
                lens.append(q + 1)
                greedy = greedy and plain_greedy(req.sampling_params, seq.num_output_tokens + j)
                i += 1
        assert g.np_want is not None
        g.np_want[0] = int(greedy)
        self._clock += 1
        g.last_used = self._clock
        m = g.meta
        meta = AttentionMetadata(query_start_loc=m.query_start_loc, seq_lens=m.seq_lens, block_tables=m.block_tables,
                                 slot_mapping=m.slot_mapping, block_size=bs, max_query_len=1, max_seq_len=max(lens),
                                 query_lens_cpu=[1] * B, seq_lens_cpu=lens, host_kv=m.host_kv, window_rows=m.window_rows)
        return StepInputs(input_ids=g.input_ids, positions=g.positions, meta=meta, logit_rows=g.rows,
                          sample_seqs=[seq for seq, _ in scheduled], prompt_rows=[], graph=g,
                          greedy=g.greedy if greedy else None)

    def _stage_segments(self, scheduled: list[tuple[Sequence, int]], host_tier: bool,
                        adapter: bytes | tuple | None) -> StepInputs | None:
        """`stage` for a decode step over segments (squid's documents, a shared prefix): each
        sequence's parts (its shared segments in order, its own tokens last) written into the
        graph's SegmentBatch, one virtual row per part. None where a sequence has drafts, a part
        lies in the host pool or does not fit the tables, a window would cut a part, or no trusted
        graph has this structure (parts, rotated parts)."""
        from cuttle.engine.model_runner import StepInputs

        B = len(scheduled)
        P = R = 0
        for seq, n in scheduled:
            if n != 1 or seq.draft:
                return None
            P += len(seq.shared) + 1
            R += sum(1 for sh in seq.shared if sh.rope_delta != 0)
        g = self._graphs.get((B, torch.get_num_threads(), id(native.kernels()), adapter, (P, R)))
        if g is None or not g.validated:
            return None
        sv = g.seg
        assert sv is not None and g.np_ids is not None and g.np_positions is not None and g.np_lens is not None
        assert g.np_slots is not None and g.np_tables is not None and g.meta.segments is not None
        bs, width, window = self.block_size, self.table_width, self.window
        lens: list[int] = []
        kv_lens: list[int] = []
        causal: list[bool] = []
        deltas: list[int] = []
        key_pos: list[int] = []
        query_pos: list[int] = []
        greedy = self.greedy_pick
        v = r = 0
        for i, (seq, _) in enumerate(scheduled):
            p = seq.num_computed_tokens
            table = seq.block_table
            req = seq.request
            qpos = seq.pos_base + p
            if (p + 1 != len(seq.token_ids) or req.job is not None or len(table) > width
                    or (window is not None and p + 1 > window)
                    or (req.prompt_logprobs is not None and seq.index == 0 and len(req.prompt_logprobs) < seq.num_prompt_tokens)
                    or (host_tier and self.host_kv is None and any(b >= HOST_BLOCK for b in table))):
                return None  # what this wrote so far is overwritten by the next step's inputs
            g.np_ids[i] = seq.token_ids[p]
            g.np_positions[i] = qpos
            g.np_lens[i] = p + 1
            g.np_slots[i] = table[p // bs] * bs + p % bs
            g.np_tables[i, : len(table)] = table
            lens.append(p + 1)
            greedy = greedy and plain_greedy(req.sampling_params, seq.num_output_tokens)
            sv.merge_ptr[i] = v
            for sh in seq.shared:
                blocks = sh.blocks[: -(-sh.length // bs)]
                # (a whole segment in the host pool, pool 1: the engine copies such documents in)
                if (sh.pool != 0 or len(blocks) > width or (window is not None and qpos - sh.pos_base >= window)
                        or (host_tier and self.host_kv is None and any(b >= HOST_BLOCK for b in blocks))):
                    return None
                sv.kv_lens[v], sv.causal[v], sv.row_index[v], sv.merge_idx[v] = sh.length, 0, i, v
                sv.tables[v, : len(blocks)] = blocks
                if sh.rope_delta != 0:
                    assert sv.rot_rows is not None and sv.rot_cos is not None and sv.rot_sin is not None
                    sv.rot_rows[r] = v
                    sv.rot_cos[r], sv.rot_sin[r] = self._turn(sh.rope_delta)
                    r += 1
                kv_lens.append(sh.length)
                causal.append(False)
                deltas.append(sh.rope_delta)
                key_pos.append(sh.pos_base)
                query_pos.append(qpos)
                v += 1
            sv.kv_lens[v], sv.causal[v], sv.row_index[v], sv.merge_idx[v] = p + 1, 1, i, v
            sv.tables[v, : len(table)] = table
            kv_lens.append(p + 1)
            causal.append(True)
            deltas.append(0)
            key_pos.append(seq.pos_base)
            query_pos.append(qpos)
            v += 1
        sv.merge_ptr[B] = v
        assert g.np_want is not None
        g.np_want[0] = int(greedy)
        self._clock += 1
        g.last_used = self._clock
        m, sb = g.meta, g.meta.segments
        segs = replace(sb, seq_ids_cpu=list(sv.row_index.tolist()), query_lens_cpu=[1] * P, kv_lens_cpu=kv_lens,
                       causal_cpu=causal, deltas_cpu=deltas, max_kv_len=max(kv_lens), key_pos_cpu=key_pos,
                       query_pos_cpu=query_pos)
        meta = AttentionMetadata(query_start_loc=m.query_start_loc, seq_lens=m.seq_lens, block_tables=m.block_tables,
                                 slot_mapping=m.slot_mapping, block_size=bs, max_query_len=1, max_seq_len=max(lens),
                                 query_lens_cpu=[1] * B, seq_lens_cpu=lens, segments=segs, host_kv=m.host_kv)
        return StepInputs(input_ids=g.input_ids, positions=g.positions, meta=meta, logit_rows=g.rows,
                          sample_seqs=[seq for seq, _ in scheduled], prompt_rows=[], graph=g,
                          greedy=g.greedy if greedy else None)

    def _turn(self, delta: int) -> tuple[np.ndarray, np.ndarray]:
        """The cos / sin rows that turn a query by -delta (the model's `delta_tables`), made once."""
        turn = self._turns.get(delta)
        if turn is None:
            assert self.rope is not None
            cos, sin = self.rope.delta_tables([delta])
            turn = self._turns[delta] = (cos[0].numpy(), sin[0].numpy())
        return turn

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The step's logits [B, vocab] fp32 from a graph, or None: run the step eagerly."""
        staged = inputs.graph
        if staged is not None:  # inputs already in place (`stage`), the graph trusted
            if not staged.graph.replay():
                inputs.greedy = None  # the eager rerun's logits are not the pick's
                return None
            self.counters["graph_steps"] += 1
            self.hidden = staged.hidden
            return staged.logits
        if not self.qualifies(inputs):
            return None
        adapter = adapter_key(inputs.lora)
        key = (inputs.meta.num_seqs, torch.get_num_threads(), id(native.kernels()), adapter, self._shape(inputs.meta))
        if key in self._eager:
            return None
        g = self._graphs.get(key)
        self._clock += 1
        if g is None:
            if key[0] > self.max_batch and not self._hot(key):
                return None
            if adapter is not None:
                self._make_room(lambda k: k[3] is not None, MAX_ADAPTER_GRAPHS)
            if key[4] is not None:
                self._make_room(lambda k: k[4] is not None, MAX_SEGMENT_GRAPHS)
            return self._capture(key, inputs)
        g.last_used = self._clock
        self._fill(g, inputs)
        assert g.graph is not None and g.logits is not None
        if not g.graph.replay():
            return None
        if not g.validated:
            replayed = g.logits.clone()
            self._begin_step(inputs.meta)
            eager, self.hidden = self._forward(inputs.input_ids, inputs.positions, inputs.meta)
            if not torch.equal(replayed.view(torch.int32), eager.view(torch.int32)):
                logger.warning("kernel graph of decode batch %d differs from the eager step: that batch size runs "
                               "eagerly from now on", key[0])
                del self._graphs[key]
                self._eager.add(key)
            else:
                g.validated = True
            return eager
        self.counters["graph_steps"] += 1
        self.hidden = g.hidden
        return g.logits

    def _hot(self, key: _Key) -> bool:
        """Count one qualifying step of a batch size above max_batch that has no graph; True
        when it is now to be captured (room made for it: the least recently used hot graph is
        dropped if `hot_batches` are held)."""
        self._window += 1
        if self._window > HOT_WINDOW:
            self._seen.clear()
            self._window = 1
        n = self._seen[key] = self._seen.get(key, 0) + 1
        if n < HOT_STEPS:
            return False
        del self._seen[key]
        held = [k for k in self._graphs if k[0] > self.max_batch and k[3] is None and k[4] is None]
        while held and len(held) >= self.hot_batches:
            oldest = min(held, key=lambda k: self._graphs[k].last_used)
            del self._graphs[oldest]
            held.remove(oldest)
            self.counters["graph_evictions"] += 1
        return True

    def _make_room(self, kind: Callable[[_Key], bool], most: int) -> None:
        """Keep at most `most` - 1 graphs of a kind (adapter graphs, segment graphs) before a new
        one of that kind is captured: the least recently used go."""
        held = [k for k in self._graphs if kind(k)]
        while held and len(held) >= most:
            oldest = min(held, key=lambda k: self._graphs[k].last_used)
            del self._graphs[oldest]
            held.remove(oldest)
            self.counters["graph_evictions"] += 1

    def _fill(self, g: _Graph, inputs: StepInputs) -> None:
        m, gm = inputs.meta, g.meta
        g.input_ids.copy_(inputs.input_ids)
        g.positions.copy_(inputs.positions)
        gm.seq_lens.copy_(m.seq_lens)
        gm.slot_mapping.copy_(m.slot_mapping)
        gm.block_tables[:, : m.block_tables.shape[1]].copy_(m.block_tables)
        if g.win is not None:
            tables = m.block_tables.numpy()
            for i, n in enumerate(m.seq_lens_cpu):
                _cut_row(*g.win, i, tables[i], n, self.window, self.block_size)
        sb, gsb = m.segments, gm.segments
        if sb is not None:
            assert gsb is not None
            for name in ("kv_lens", "causal", "row_index", "merge_ptr", "merge_idx", "rot_rows", "rot_cos", "rot_sin"):
                src = getattr(sb, name)
                if src is not None:
                    getattr(gsb, name).copy_(src)
            gsb.block_tables[:, : sb.block_tables.shape[1]].copy_(sb.block_tables)

    def _capture(self, key: _Key, inputs: StepInputs) -> torch.Tensor | None:
        m = inputs.meta
        B = m.num_seqs
        meta = AttentionMetadata(
            query_start_loc=torch.arange(B + 1, dtype=torch.int32),
            seq_lens=torch.empty(B, dtype=torch.int32),
            block_tables=torch.zeros(B, self.table_width, dtype=torch.int32),
            slot_mapping=torch.empty(B, dtype=torch.int64),
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=self.table_width * self.block_size,  # a bound: each replay has its own lengths
            query_lens_cpu=[1] * B,
            seq_lens_cpu=list(m.seq_lens_cpu),
            # with a host tier every graph reads it where a table names it, so one graph serves
            # steps with and without host blocks (the kernel picks the pool per block)
            host_kv=self.host_kv,
        )
        sb = m.segments
        if sb is not None:  # the parts' tensors, sized as this step's, the tables as wide as the graph's
            P = sb.num_parts
            meta.segments = replace(
                sb, query_start_loc=torch.arange(P + 1, dtype=torch.int32), kv_lens=torch.empty(P, dtype=torch.int32),
                block_tables=torch.zeros(P, self.table_width, dtype=torch.int32), causal=torch.empty(P, dtype=torch.int32),
                row_index=torch.empty(P, dtype=torch.int64), merge_ptr=torch.empty(B + 1, dtype=torch.int64),
                merge_idx=torch.empty(P, dtype=torch.int64),
                rot_rows=None if sb.rot_rows is None else torch.empty_like(sb.rot_rows),
                rot_cos=None if sb.rot_cos is None else torch.empty_like(sb.rot_cos),
                rot_sin=None if sb.rot_sin is None else torch.empty_like(sb.rot_sin))
        elif self.window is not None:  # a plain decode step: its rows cut to the window, filled per step
            meta.window_rows = wr = WindowRows(self.window, torch.zeros(B, self.table_width, dtype=torch.int32),
                                               torch.empty(B, dtype=torch.int32), torch.empty(B, dtype=torch.int32))
        g = _Graph(torch.empty(B, dtype=torch.int64), torch.empty(B, dtype=torch.int64), meta, last_used=self._clock)
        g.want, g.greedy = torch.zeros(1, dtype=torch.int32), torch.zeros(B, dtype=torch.int64)
        if meta.window_rows is not None:
            g.win = (wr.tables.numpy(), wr.lens.numpy(), wr.skips.numpy())
        self._fill(g, inputs)
        self._begin_step(meta)
        try:
            with capture() as graph:
                logits, hidden = self._forward(g.input_ids, g.positions, g.meta)
                argmax_into_if(g.want, logits, g.greedy)  # want is 0 now: recorded, not run
        except GraphBreak as e:
            n = self._breaks[key] = self._breaks.get(key, 0) + 1
            if n >= MAX_CAPTURE_TRIES:
                self._eager.add(key)
                logger.info("decode batch %d runs eagerly: its step cannot be replayed from a kernel graph (%s)", B, e)
            return None
        g.graph, g.logits, g.hidden = graph, logits, hidden
        self.hidden = hidden
        g.rows = torch.arange(B)
        g.np_ids, g.np_positions = g.input_ids.numpy(), g.positions.numpy()
        g.np_lens, g.np_slots, g.np_tables = meta.seq_lens.numpy(), meta.slot_mapping.numpy(), meta.block_tables.numpy()
        g.np_want = g.want.numpy()
        gsb = meta.segments
        if gsb is not None:
            R = 0 if gsb.rot_rows is None else gsb.rot_rows.shape[0]
            g.seg = _SegmentViews(
                gsb.kv_lens.numpy(), gsb.block_tables.numpy(), gsb.causal.numpy(), gsb.row_index.numpy(),
                gsb.merge_ptr.numpy(), gsb.merge_idx.numpy(), None if gsb.rot_rows is None else gsb.rot_rows.numpy(),
                None if gsb.rot_cos is None else gsb.rot_cos.view(R, -1).numpy(),
                None if gsb.rot_sin is None else gsb.rot_sin.view(R, -1).numpy())
        self._graphs[key] = g
        self.counters["graph_captures"] += 1
        return logits


def _cut_row(tables: np.ndarray, lens: np.ndarray, skips: np.ndarray, i: int, table, length: int, window: int,
             block_size: int) -> None:
    """Row i of a graph's `WindowRows` for a decode row of `length` keys in `table` (as
    torch_backend's `_NativeRows._cut` cuts a row per step)."""
    start = max(0, length - window)  # the row's first key in its window
    first = start // block_size
    n = -(-length // block_size) - first
    tables[i, :n] = table[first : first + n]
    lens[i] = length - first * block_size
    skips[i] = start - first * block_size


def adapter_key(lora: LoRABatch | None) -> bytes | tuple | None:
    """What of a step's LoRA rows a graph records, as a key: None when no row has an adapter, the
    adapter's key when every row runs under one, else each adapter's key with the rows it covers
    (a graph of a mixed step holds those adapters' weights and that grouping of rows: a slice's
    offset, an index tensor's contents, so a step replays it only with the same layout)."""
    if lora is None:
        return None
    if len(lora.groups) == 1 and lora.groups[0][1] is None:
        return lora.groups[0][0].key
    parts = []
    for adapter, rows in lora.groups:
        if rows is None:
            spec: tuple | None = None
        elif isinstance(rows, slice):
            spec = (rows.start, rows.stop)
        else:
            spec = tuple(rows.tolist())
        parts.append((adapter.key, spec))
    return tuple(parts)
