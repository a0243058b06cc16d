"""Runs the model on one scheduled step: owns the KV cache tensors, flattens the batch, returns
logits rows.

The batch is flattened without padding: token ids, positions and cache slots of every scheduled
token, plus the block tables and sequence lengths the attention backend reads. Logits are
computed only for the rows that are sampled (the last token of a sequence that reaches its end)
and the prompt rows whose logprobs were asked for. Pending copy-on-write block copies run first.
The model is loaded here, with its routed experts in MXFP8 when `EngineConfig.moe_quant` asks.
An NSA model (config.json's "nsa") also gets its compressed K/V cache here, one more paged tensor
per layer indexed by the raw cache's block ids (attention/nsa_backend.py), and the NSA backend
around the dense one. Under `EngineConfig.sparse_attention` (training-free top-k) each sparse layer
gets its block-summary cache the same way (attention/topk_backend.py), and the top-k backend
around the dense one. With LoRA enabled (engine/lora.py) a step's rows under adapters go to the
model's LoRA context for the forward; such a step runs eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cuttle.attention.backend import get_backend
from cuttle.attention.metadata import AttentionMetadata, KVSegment, SeqLayout, has_host_blocks
from cuttle.attention import native
from cuttle.attention.native import gemm, hugepages, invariance, mxfp8
from cuttle.attention.nsa_backend import NSABackend, compressed_slots_per_block
from cuttle.attention.topk import parse_sparse_attention
from cuttle.attention.topk_backend import TopKBackend, summary_slots_per_block
from cuttle.attention.torch_backend import TorchAttentionBackend
from cuttle.engine.config import EngineConfig, ModelConfig
from cuttle.engine.kv.storage import KVStorage
from cuttle.engine.lora import LoRABatch, LoRAContext
from cuttle.engine.models import load_model
from cuttle.engine.models.linear_quant import refresh_tied
from cuttle.engine.models.moe_quant import moe_layers, pack_experts
from cuttle.engine.models.nsa_config import nsa_config
from cuttle.engine.models.transformer import sparse_attention_for
from cuttle.engine.sequence import Sequence
from cuttle.engine.spec_decode import SpecConfig
from cuttle.engine.step_graphs import DecodeGraphs, adapter_key


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # rows to compute logits for: prompt-logprob rows, then sample rows
    # sequences that reach their end this step: one logits row each, 1 + len(seq.draft) for one
    # with drafts (speculative decoding)
    sample_seqs: list[Sequence]
    prompt_rows: list[tuple[Sequence, int, int]]  # (seq, first prompt position, count) with logits
    graph: Any = None  # the decode graph whose tensors these are (`DecodeGraphs.stage`), or None
    lora: LoRABatch | None = None  # the rows that run under LoRA adapters (engine/lora.py); None: none
    greedy: torch.Tensor | None = None  # argmax of every logits row, from that graph's replay (plain-greedy steps)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype, num_blocks: int):
        self.config = config
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.backend = get_backend(config.attention_backend, device, dtype)  # before the weights: a backend that cannot run fails fast
        if model_config.sliding_window_layers and hasattr(self.backend, "set_windows"):
            # (a backend without windows serves such a model within its window: llm_engine caps max_model_len)
            self.backend.set_windows({i: model_config.sliding_window for i in model_config.sliding_window_layers})
        spec = SpecConfig.parse(config.speculative_config)
        self.mtp = spec is not None and spec.method == "mtp"  # the checkpoint's MTP layer drafts (engine/mtp_proposer.py)
        self.model = load_model(config.model, model_config, dtype, device, moe_quant=config.moe_quant,
                                quantization=config.quantization, quantize_lm_head=config.quantize_lm_head, mtp=self.mtp).eval()
        self.prepack()
        mc = model_config
        nsa = self.model.nsa
        sparse = sparse_attention_for(config.sparse_attention, mc)
        # what hangs on a block id beside its K/V (KVStorage companions: copies, KV tiers and disk
        # entries move it with the block): an NSA model's compressed entries, the top-k summaries
        companions = []
        if nsa is not None:
            slots = compressed_slots_per_block(nsa, self.block_size)
            companions.append(("nsa", (mc.num_layers, 2), (slots, mc.num_kv_heads, mc.head_dim)))
        if sparse is not None:
            slots = summary_slots_per_block(sparse, self.block_size)
            companions.append(("topk", (mc.num_layers - sparse.dense_layers, 1),
                               (slots, sparse.summary_rows, mc.num_kv_heads, mc.head_dim)))
        # (with MTP drafting its layer's K/V is one more layer, at index num_layers)
        self.kv = KVStorage(mc.num_layers + int(self.mtp), num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim, dtype, device,
                            companions=companions)
        # the KV host tier's per-layer caches, for tables that name host blocks (read in place)
        self.host_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.nsa_cache: torch.Tensor | None = None  # [layers, 2, blocks, S_c, kv_heads, head_dim]
        if nsa is not None:
            self.nsa_cache = self.kv.companions["nsa"]
            kernel = "torch" if self.backend.name == "torch" else "triton"
            self.backend = NSABackend(nsa, self.backend, self.block_size, kernel=kernel)
        # [sparse layers, blocks, S, R, kv_heads, head_dim]: the top-k block summaries
        self.topk_cache: torch.Tensor | None = None
        if sparse is not None:
            self.topk_cache = self.kv.companions["topk"][:, 0]
            summaries = [None] * sparse.dense_layers + list(self.topk_cache.unbind(0))
            self.backend = TopKBackend(sparse, self.backend, self.block_size, summaries)
        # decode steps replayed from kernel graphs: CPU, the plain torch backend on native kernels
        self.graphs: DecodeGraphs | None = None
        self.lora: LoRAContext | None = None  # `enable_lora`
        # the last step's final hidden states, one row per input row (valid until the next step): the
        # MTP drafter reads them (engine/mtp_proposer.py)
        self.hidden: torch.Tensor | None = None
        backend = self.backend
        if (device.type == "cpu" and not config.enforce_eager and config.cpu_graph_max_batch > 0
                and isinstance(backend, TorchAttentionBackend) and backend.native):
            max_len = min(config.max_model_len or mc.max_position_embeddings, num_blocks * self.block_size)
            self.graphs = DecodeGraphs(config.cpu_graph_max_batch, -(-max_len // self.block_size) + 1, self.block_size,
                                       backend.begin_step, self._all_logits, greedy_pick=config.logprobs_mode == "processed",
                                       hot_batches=config.cpu_graph_hot_batches,
                                       window=mc.sliding_window if mc.sliding_window_layers else None,
                                       rope=getattr(self.model, "rope", None))
        if config.batch_invariant:
            why = self._not_batch_invariant()
            if why:
                raise ValueError(f"batch_invariant=True: {why}")

    def _not_batch_invariant(self) -> str | None:
        """Why this engine's forward cannot be batch-invariant, or None: only the native CPU kernels
        have the switch (`native.invariance`); torch's GEMMs, SDPA and the GPU kernels choose their
        summation order by shape."""
        if self.device.type != "cpu":
            return f"supported on the CPU kernels only, not on {self.device.type} (attention backend {self.backend.name!r})"
        if self.dtype not in (torch.float32, torch.bfloat16):
            return f"dtype {str(self.dtype).removeprefix('torch.')} is not supported (float32 or bfloat16)"
        ks = native.kernels()
        if ks.lib is None:
            return f"needs the native CPU kernels, which are off here ({ks.describe or 'library unavailable'})"
        dense = getattr(self.backend, "dense", self.backend)
        if not (isinstance(dense, TorchAttentionBackend) and dense.native):
            return f"needs the native CPU attention kernel (attention backend {self.backend.name!r})"
        if self.dtype == torch.bfloat16 and not (ks.packed_gemm or ks.w16_gemm):
            return "needs a native bf16 GEMM (off: CUTTLE_PACKED_GEMM=0, or a CPU without AVX512-BF16 or AVX2+FMA)"
        torch_experts = [name for name, layer in moe_layers(self.model).items() if layer.packed is None]
        if torch_experts:
            return (f"the routed experts of layer {torch_experts[0]} run on torch (native expert kernels off: "
                    "CUTTLE_MOE_NATIVE=0, or activation quantization)")
        if (self.config.quantization or self.config.moe_quant) and not mxfp8.available():
            return "MXFP8 weights need the native MXFP8 kernels, not built here"
        return None

    def prepack(self) -> None:
        """Lay out the CPU GEMM weights now (after load and after every weight update), not
        during the first request's step: the packed dense weights, the routed experts (held packed
        only: their plain copy is dropped); a tied MXFP8 lm_head is requantized from the embedding.
        On CPU the large weights first move into huge-page memory (`native.hugepages`: fewer TLB
        misses while decode streams them; a no-op for tensors already there)."""
        if getattr(self, "graphs", None) is not None:
            self.graphs.clear()  # they hold addresses of the weights about to move or be repacked
        if self.device.type == "cpu":
            hugepages.back_module(self.model)
        refresh_tied(self.model)
        if self.device.type == "cpu":
            gemm.prepack(self.model.linear_weights())
            pack_experts(self.model)

    @staticmethod
    def kv_bytes_per_block(mc: ModelConfig, block_size: int, dtype: torch.dtype,
                           sparse_attention: str | dict[str, Any] | None = None, extra_layers: int = 0) -> int:
        """Bytes one KV block costs: raw K/V (of `extra_layers` more layers too: an MTP drafter's),
        plus what hangs on its block id (an NSA model's compressed entries; under training-free
        top-k (`EngineConfig.sparse_attention`) each sparse layer's block summaries)."""
        layers = mc.num_layers + extra_layers
        raw = KVStorage.bytes_per_block(layers, block_size, mc.num_kv_heads, mc.head_dim, dtype)
        per_vector = raw // (layers * 2 * block_size)  # one token's K (or V) in one layer
        nsa = nsa_config(mc.hf_config)
        if nsa is not None:
            # an NSA block also holds its compressed entries (S_c slots of K and V per layer)
            raw += raw // block_size * compressed_slots_per_block(nsa, block_size)
        sparse = parse_sparse_attention(sparse_attention)
        if sparse is not None:
            sparse_layers = max(0, mc.num_layers - sparse.dense_layers)
            raw += sparse_layers * summary_slots_per_block(sparse, block_size) * sparse.summary_rows * per_vector
        return raw

    @property
    def reads_host_in_place(self) -> str | None:
        """Why this runner's attention cannot read host-tier blocks where they lie, or None when it
        can: the CPU kernels (dense, NSA, top-k) and the torch paths take both pools; the Triton
        NSA / top-k kernels read the device pool only."""
        if self.device.type != "cpu":
            return "it needs the CPU attention kernels"
        if self.kv.companions and getattr(self.backend, "kernel", "torch") != "torch":
            return f"the {self.backend.name} kernel reads the device pool only"
        return None

    def attach_host_tier(self, host: KVStorage) -> None:
        """The KV host tier's caches (KV and companions, the device pool's layout), for steps whose
        tables name host blocks: `host_kv` goes into those steps' metadata, the companions to the
        sparse backend (NSA's compressed entries, the top-k summaries)."""
        self.host_kv = host.layers
        if self.graphs is not None:  # graphs from now on read the host tier where a table names it
            self.graphs.clear()
            self.graphs.host_kv = host.layers
        if self.nsa_cache is not None:
            hc = host.companions["nsa"]
            self.backend.host_compressed = [(hc[i, 0], hc[i, 1]) for i in range(hc.shape[0])]
        if self.topk_cache is not None:
            hs = host.companions["topk"][:, 0]
            self.backend.host_summaries = [None] * (len(self.kv.layers) - hs.shape[0]) + list(hs.unbind(0))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.kv.copy_blocks(copies)  # a copied (copy-on-write) block takes its companions along

    def layer_caches(self) -> list[tuple[torch.Tensor, ...]]:
        """Each layer's cache views: (k, v), or (k, v, compressed k, compressed v) for NSA."""
        if self.nsa_cache is None:
            return self.kv.layers
        return [(k, v, self.nsa_cache[i, 0], self.nsa_cache[i, 1]) for i, (k, v) in enumerate(self.kv.layers)]

    def enable_lora(self) -> None:
        """Let steps carry LoRA adapter rows (engine/lora.py): the projections read them through
        one context. A decode step whose rows all run under one adapter may replay a kernel graph
        of its own (step_graphs.py), as does a step mixing adapters, keyed by its layout of rows."""
        self.lora = LoRAContext()
        self.model.enable_lora(self.lora)

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> StepInputs:
        # a sequence's rows are n (a decode with drafts: its last token and each draft)
        lora = LoRABatch.build([(seq.request.lora, n) for seq, n in scheduled], self.device) if self.lora is not None else None
        if self.graphs is not None:
            staged = self.graphs.stage(scheduled, self.host_kv is not None, adapter_key(lora))
            if staged is not None:
                staged.lora = lora
                return staged
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logit_rows: list[int] = []  # prompt-logprob rows first, then one row per sampled sequence
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prompt_rows: list[tuple[Sequence, int, int]] = []
        segmented = any(seq.shared for seq, _ in scheduled)
        tables: list[list[int]] = []  # one-segment steps: each query's block table
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            end = start + n
            row0 = query_start[-1]
            draft = seq.draft  # speculative decoding: a decode that also computes these (start is its last token)
            ids.extend(seq.token_ids[start:end])
            if draft:
                ids.extend(draft)
            positions.extend(range(seq.pos_base + start, seq.pos_base + end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if draft and not segmented:
                # each row a query of its own over the keys up to it (the K/V of the rows before it
                # are written first, as a decode row's own is): the step is a decode step of more
                # rows, with the decode kernels and its kernel graphs
                for i in range(n):
                    query_start.append(row0 + i + 1)
                    seq_lens.append(start + i + 1)
                    query_lens.append(1)
                    tables.append(table)
            else:
                query_start.append(row0 + n)
                seq_lens.append(end)
                query_lens.append(n)
                tables.append(table)
            req = seq.request
            if req.prompt_logprobs is not None and seq.index == 0 and len(req.prompt_logprobs) < seq.num_prompt_tokens:
                # position p's logits score prompt token p+1
                last = min(end, seq.num_prompt_tokens - 1)
                logit_rows.extend(range(row0, row0 + last - start))
                prompt_rows.append((seq, start, last - start))
            if end == len(seq.token_ids) + len(draft) and req.job is None:  # a document job is prefill only
                if draft:  # every row is sampled: the last token's and each draft's
                    sample_rows.extend(range(row0, row0 + n))
                else:
                    sample_rows.append(row0 + n - 1)
                sample_seqs.append(seq)
        dev = self.device
        if segmented:
            meta = self._segment_metadata(scheduled)
        else:  # the fast path: one causal segment per sequence
            meta = self.causal_metadata(tables, query_start, seq_lens, query_lens, slots)
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=meta,
            logit_rows=torch.tensor(logit_rows + sample_rows, dtype=torch.long, device=dev),
            sample_seqs=sample_seqs,
            prompt_rows=prompt_rows,
            lora=lora,
        )

    def _segment_metadata(self, scheduled: list[tuple[Sequence, int]]) -> AttentionMetadata:
        """Sequences that read shared KV (a prefix, squid documents): each one's segments, its
        own causal tokens last, with the rotation each shared segment needs."""
        layouts = []
        for seq, n in scheduled:
            segs = [KVSegment(s.blocks, s.length, causal=False, rope_delta=s.rope_delta, pool=s.pool, pos_base=s.pos_base)
                    for s in seq.shared]
            segs.append(KVSegment(seq.block_table, seq.num_computed_tokens + n, causal=True, pos_base=seq.pos_base))
            layouts.append(SeqLayout(n, segs))
        return AttentionMetadata.build(layouts, self.block_size, self.device, rope=self.model.rope, host_kv=self.host_kv)

    def causal_metadata(self, block_tables: list[list[int]], query_start: list[int], seq_lens: list[int],
                        query_lens: list[int], slots: list[int]) -> AttentionMetadata:
        """Rows laid out as one causal segment per query (`query_start`, each reading its table's
        first `seq_lens` keys), written at `slots`; the KV host tier's caches when a table names
        host blocks."""
        tables = torch.zeros(len(block_tables), max(map(len, block_tables)), dtype=torch.int32)
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_size=self.block_size,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        if self.host_kv is not None and any(has_host_blocks(t) for t in block_tables):
            meta.host_kv = self.host_kv
        return meta

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Returns float32 logits for `inputs.logit_rows`, in that order (valid until the next
        step: a replayed decode step returns its graph's logits tensor)."""
        with invariance.batch_invariant(self.config.batch_invariant):
            return self._run(inputs)

    def _run(self, inputs: StepInputs) -> torch.Tensor:
        if inputs.lora is None:
            return self._run_graph_or_eager(inputs)
        assert self.lora is not None
        self.lora.batch = inputs.lora  # read by the projections of an eager step or a capture
        try:
            return self._run_graph_or_eager(inputs)
        finally:
            self.lora.batch = None

    def _run_graph_or_eager(self, inputs: StepInputs) -> torch.Tensor:
        if self.graphs is not None:
            logits = self.graphs.run(inputs)
            if logits is not None:
                self.hidden = self.graphs.hidden
                return logits
        return self._run_eager(inputs)

    def _run_eager(self, inputs: StepInputs) -> torch.Tensor:
        self.backend.begin_step(inputs.meta)
        if inputs.logit_rows.numel() == inputs.input_ids.numel() and not inputs.prompt_rows:
            return self._all_logits(inputs.input_ids, inputs.positions, inputs.meta)[0].cpu()  # every row: no gather
        caches = self.kv.layers if self.nsa_cache is None else self.layer_caches()
        hidden = self.hidden = self.model(inputs.input_ids, inputs.positions, caches, inputs.meta, self.backend)
        if inputs.logit_rows.numel() == 0:
            return torch.empty(0, self.model_config.vocab_size)
        return self.model.compute_logits(hidden[inputs.logit_rows]).cpu()

    def _all_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The model on a planned step (`begin_step` done): the logits and final hidden states of every row."""
        caches = self.kv.layers if self.nsa_cache is None else self.layer_caches()
        hidden = self.hidden = self.model(input_ids, positions, caches, meta, self.backend)
        return self.model.compute_logits(hidden), hidden
