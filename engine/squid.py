"""Squid: document-level KV caching. Each document's KV is computed once, on its own, and any later
request combines any subset of cached documents, in any order, without computing them again.

A squid prompt is an optional shared prefix, a list of documents and the query (the rest of the
prompt). Attention follows the layout: the prefix is causal; a document's tokens see the prefix
and the earlier tokens of their own document; the query sees the prefix, every document, and
itself causally; decoding continues from the query.

Positions. Every document is *encoded* right after the prefix (positions P .. P + len - 1), so its
KV depends only on its tokens, the prefix and the weights — never on which other documents come
with it or in what order — and one cached copy serves every request. Where a document is *placed*
for the query is the position convention:
- `shared`: every document sits at P; the query starts at P + the longest document. Documents
  need no rotation and the result does not depend on their order. The embedded model is trained
  this way, so it is exact for it: the same numbers as one dense forward with the squid mask.
- `concat`: documents sit one after another in the order given and the query follows them.
  A document placed at P + offset has its keys rotated by offset, which the attention backend
  does by rotating the query by -offset for that segment (the cached keys are never copied).
  With no prefix this equals prefilling the concatenation with the squid mask (a document alone
  is position-invariant up to the rotation of its keys); with a prefix it is an approximation
  (the document was encoded at distance 0 from the prefix, not at its offset), as in CacheBlend
  / EPIC-style reuse; its quality gap is measured in benchmarks/squid.py.

The cache is the block manager's `DocumentIndex`: key = xxh3(tokens, the prefix's key, weight
version, dtype). A document may end mid-block; its segment carries its exact length, and the
backend merges per-segment attention with the log-sum-exp, so nothing is padded or duplicated.
The prefix itself is cached the same way (a document with no prefix).

Mechanics (the one seam into the step): a request with documents becomes a query sequence that
the scheduler admits only through `admit`, which pins every cached document (a `KVHandle` per
segment) or parks the query and enqueues the missing documents as *document jobs*: prefill-only
sequences whose KV goes into the document index when complete (`complete`). A document needed by
several requests at once is computed by one job. With KV tiers a job whose document was offloaded
(host tier, disk) is a *load job*: its blocks are filled by a copy instead of a prefill (the
block manager decides at allocation), the queries park on it the same way, and it completes
when the copy is done. A preempted query lets its pins go and is
resolved again when re-admitted.

The dense equivalent (`SquidLayout.dense_context` / `dense_mask_and_positions`, and for NSA
models `dense_segments`: each token's piece and its shift) is the one place that spells out, as a
token row, its positions and an [S, S] mask, exactly what the engine computes for a layout, so a
trainer (cuttle.rl) can score sampled tokens under the attention they were sampled with through
`CausalLM.forward_masked`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from cuttle.engine.block_manager import BlockManager
from cuttle.engine.kv.document_index import Document, document_key
from cuttle.engine.kv.handles import KVHandle
from cuttle.engine.kv.segments import Segment
from cuttle.engine.sampling_params import SamplingParams
from cuttle.engine.sequence import Request, Sequence

CONVENTIONS = ("shared", "concat")


@dataclass(slots=True)
class SquidLayout:
    prefix: list[int]
    documents: list[list[int]]
    convention: str

    @property
    def prefix_len(self) -> int:
        return len(self.prefix)

    def placements(self) -> list[int]:
        """The position of each document's first token for the query."""
        p = self.prefix_len
        if self.convention == "shared":
            return [p] * len(self.documents)
        out, at = [], p
        for d in self.documents:
            out.append(at)
            at += len(d)
        return out

    def query_start(self) -> int:
        if not self.documents:
            return self.prefix_len
        if self.convention == "shared":
            return self.prefix_len + max(len(d) for d in self.documents)
        return self.prefix_len + sum(len(d) for d in self.documents)

    def flat_tokens(self, query: list[int]) -> list[int]:
        """The whole prompt, prefix + documents in order + query (what the user sees as the prompt)."""
        out = list(self.prefix)
        for d in self.documents:
            out.extend(d)
        return out + list(query)

    # ---- the dense equivalent (training and scoring) -------------------------------------------
    def _dense_segments(self) -> list[tuple[str, int, list[int], int]]:
        """(kind, document index, tokens, first position) of each piece of the dense row before
        the tail: "prefix", then per document an optional "copy" of the prefix and the "doc".

        Why copies: a document is encoded once, right after the prefix (positions P..), and under
        `concat` placed at P + offset for the query. RoPE scores depend only on position
        differences, so "encoded at P after a prefix at 0, keys read at P + offset" is the same
        computation as "a prefix copy at offset, the document at P + offset after it": each
        document after the first gets its own prefix copy, seen by that document only, and the
        query sees the real prefix. Under `shared` (and with no prefix) no copy is needed."""
        if self.convention not in CONVENTIONS:
            raise ValueError(f"squid convention must be one of {CONVENTIONS}, got {self.convention!r}")
        p = self.prefix_len
        segs = [("prefix", -1, self.prefix, 0)] if p else []
        for i, (doc, place) in enumerate(zip(self.documents, self.placements())):
            if p and place != p:
                segs.append(("copy", i, self.prefix, place - p))
            segs.append(("doc", i, doc, place))
        return segs

    def dense_context(self) -> list[int]:
        """The tokens of the dense row before the tail (the query and what follows it): the
        prefix and the documents in the order given (under `concat` with a prefix, each document
        after the first preceded by a copy of the prefix)."""
        return [t for _, _, toks, _ in self._dense_segments() for t in toks]

    def dense_segments(self, tail_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For the same row, per token: the piece it belongs to (the prefix, each copy, each
        document, the tail; numbered in row order) and that piece's shift, how far it sits from
        where the engine encoded it (a document placed at P + offset was encoded at P, its copy
        of the prefix at 0: both shift by offset). [S] int64 each. NSA and top-k
        (`sparse_attention`) layers attend per piece, in its encoded frame
        (`CausalLM.forward_masked(..., segments=, segment_shifts=)`), as the engine attends a
        cached document; dense layers need only the mask."""
        segs = self._dense_segments()
        p = self.prefix_len
        ids: list[int] = []
        shifts: list[int] = []
        for i, (kind, _, toks, start) in enumerate(segs):
            ids += [i] * len(toks)
            shifts += [start - (p if kind == "doc" else 0)] * len(toks)
        return (torch.tensor(ids + [len(segs)] * tail_len, dtype=torch.long),
                torch.tensor(shifts + [0] * tail_len, dtype=torch.long))

    def dense_mask_and_positions(self, tail_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For the row `dense_context() + tail` (tail: the query, then generated tokens; S tokens
        in all): mask [S, S] bool (True: row i may attend to column j) and positions [S] int64,
        such that one dense forward computes what the engine computes for this layout, in
        either convention. Causal everywhere; the prefix and each copy see themselves; a
        document sees its prefix (or its copy) and itself; the tail sees the prefix, every
        document and itself, never a copy."""
        segs = self._dense_segments()
        ctx = sum(len(toks) for _, _, toks, _ in segs)
        S = ctx + tail_len
        allowed = torch.zeros(S, S, dtype=torch.bool)
        positions = torch.empty(S, dtype=torch.long)
        prefix = slice(0, self.prefix_len)
        copies: dict[int, slice] = {}
        at = 0
        for kind, i, toks, start in segs:
            span = slice(at, at + len(toks))
            positions[span] = torch.arange(start, start + len(toks))
            allowed[span, span] = True
            if kind == "copy":
                copies[i] = span
            elif kind == "doc":
                allowed[span, copies.get(i, prefix)] = True
            at = span.stop
        tail = slice(ctx, S)
        positions[tail] = torch.arange(self.query_start(), self.query_start() + tail_len)
        allowed[tail, :] = True
        for span in copies.values():
            allowed[tail, span] = False
        return allowed & torch.ones(S, S, dtype=torch.bool).tril(), positions


def parse_prompt(prompt: dict, encode: Callable[[str, bool], list[int]], check_ids: Callable[[list[int], str], None],
                 convention: str, max_documents: int) -> tuple[SquidLayout, list[int], str | None]:
    """A prompt dict {"prefix"?, "documents", "prompt"} (each text or token ids) -> (layout,
    query ids, query text). `encode(text, add_special_tokens)`. Errors name the field.

    Special tokens: only the layout's first piece gets the ones the tokenizer adds (a BOS): the
    prefix, when it is text. Text documents and the query get none, since a BOS before every file
    would put the model's sequence-start token mid-context. With no prefix and some field given
    as text, the tokens the tokenizer adds on its own (`encode("", True)`: a BOS, or nothing for
    Qwen-style tokenizers) become the prefix, so every document and the query see them as they
    would in a plain prompt. Token ids are taken as given."""
    unknown = set(prompt) - {"prefix", "documents", "prompt"}
    if unknown:
        raise ValueError(f"prompt dict: unknown field(s) {sorted(unknown)}; expected prefix, documents, prompt")
    if "prompt" not in prompt:
        raise ValueError("prompt dict: 'prompt' (the query after the documents) is required")

    def ids_of(value: object, field: str, specials: bool = False) -> list[int]:
        if isinstance(value, str):
            return encode(value, specials)
        if isinstance(value, list):
            check_ids(value, field)
            return list(value)
        raise ValueError(f"{field} must be a string or a list of token ids, got {type(value).__name__}")

    docs = prompt.get("documents", [])
    if not isinstance(docs, list):
        raise ValueError(f"documents must be a list, got {type(docs).__name__}")
    if len(docs) > max_documents:
        raise ValueError(f"documents: {len(docs)} given; the limit is {max_documents} (max_documents)")
    documents = []
    for i, d in enumerate(docs):
        ids = ids_of(d, f"documents[{i}]")
        if not ids:
            raise ValueError(f"documents[{i}] is empty")
        documents.append(ids)
    if "prefix" in prompt:
        prefix = ids_of(prompt["prefix"], "prefix", specials=True)
    elif any(isinstance(v, str) for v in [prompt["prompt"], *docs]):
        prefix = encode("", True)
    else:
        prefix = []
    query_raw = prompt["prompt"]
    query = ids_of(query_raw, "prompt")
    return SquidLayout(prefix, documents, convention), query, query_raw if isinstance(query_raw, str) else None


@dataclass(eq=False)
class DocumentJob:
    """One document being computed, and the queries waiting for it."""

    key: int
    tokens: list[int]
    seq: Sequence
    prefix: Document | None  # the prefix it attends to (pinned by its waiters meanwhile)
    waiters: list[Sequence] = field(default_factory=list)


class Squid:
    def __init__(self, block_manager: BlockManager, dtype_name: str):
        self.bm = block_manager
        self.dtype_name = dtype_name
        self.jobs: dict[int, DocumentJob] = {}  # in flight, by document key
        # pins a parked query already holds (document key -> handle), kept until it is admitted
        self.pins: dict[Sequence, dict[int, KVHandle]] = {}
        self.reused: dict[Sequence, int] = {}  # of those, document tokens that were already cached
        self.counters = {"documents_hit": 0, "documents_computed": 0, "document_tokens_reused": 0,
                         "document_tokens_computed": 0}

    # ---- keys ------------------------------------------------------------------------------
    def keys(self, req: Request) -> tuple[int | None, list[int]]:
        """(prefix key or None, document keys): what each one's KV depends on — its tokens, the
        weight version and cache salt (`extra_key`), the dtype, and for a document the prefix."""
        layout = req.layout
        assert layout is not None
        ctx = req.extra_key + b"|" + self.dtype_name.encode()
        pkey = document_key(layout.prefix, ctx + b"|prefix") if layout.prefix else None
        chain = ctx + b"|doc|" + (pkey.to_bytes(8, "little") if pkey is not None else b"-")
        return pkey, [document_key(d, chain) for d in layout.documents]

    def query_key(self, req: Request) -> bytes:
        """Mixed into the query's prefix-cache hashes: its KV depends on the whole layout (and,
        under `shared`, not on the documents' order)."""
        pkey, dkeys = self.keys(req)
        layout = req.layout
        assert layout is not None
        order = sorted(dkeys) if layout.convention == "shared" else dkeys
        h = xxhash.xxh3_64(layout.convention.encode())
        h.update(np.asarray([pkey or 0, *order], dtype=np.uint64).tobytes())
        return b"|squid|" + h.digest()

    def _wanted(self, req: Request) -> list[tuple[int, list[int], int, int]]:
        """(key, tokens, encode position, placed position) of the prefix and every document."""
        layout = req.layout
        assert layout is not None
        pkey, dkeys = self.keys(req)
        out = [(pkey, layout.prefix, 0, 0)] if pkey is not None else []
        docs = [(k, d, layout.prefix_len, place) for k, d, place in zip(dkeys, layout.documents, layout.placements())]
        if layout.convention == "shared":
            # every document at the same place: attend to them in one canonical order, so any
            # order the user gives computes the very same floating-point sums (bit-identical)
            docs.sort(key=lambda w: w[0])
        return out + docs

    # ---- admission (the scheduler's hook) --------------------------------------------------
    def admit(self, seq: Sequence) -> tuple[bool, list[Sequence]]:
        """For a waiting sequence about to be admitted. Returns (ready, jobs): `ready` means its
        shared segments are pinned and set, so it may be allocated now; otherwise it stays parked
        here (out of the scheduler's queue) and `jobs` are new document sequences to run first.
        A parked query comes back through `complete`."""
        req = seq.request
        if req.job is not None:
            return self._admit_job(seq, req.job)
        if req.layout is None or seq.shared:
            return True, []
        docs = self.bm.document_index
        pins = self.pins.setdefault(seq, {})
        wanted = self._wanted(req)
        missing = []
        for key, tokens, _, _ in wanted:
            if key in pins:
                continue
            doc = docs.lookup(key, tokens)
            if doc is None:
                missing.append((key, tokens))
            else:
                pins[key] = docs.acquire(doc)
                self.reused[seq] = self.reused.get(seq, 0) + doc.length
                self.counters["documents_hit"] += 1
                self.counters["document_tokens_reused"] += doc.length
        if not missing:
            del self.pins[seq]
            seq.num_reused_tokens = self.reused.pop(seq, 0)
            used: set[int] = set()
            for key, tokens, _, place in wanted:
                doc = docs.entries[key]
                # a document listed twice is pinned once per use: every handle is released once
                handle = pins[key] if key not in used else KVHandle(self.bm.pool, doc.blocks)
                used.add(key)
                seq.handles.append(handle)
                seq.shared.append(Segment(doc.blocks, doc.length, pos_base=place, rope_base=doc.pos_base))
            seq.pos_base = req.layout.query_start()
            return True, []
        pkey = wanted[0][0] if req.layout.prefix else None
        if pkey is not None and pkey not in pins:
            missing = missing[:1]  # documents attend to the prefix: compute it first
        new_jobs: list[Sequence] = []
        for key, tokens in missing:
            job = self.jobs.get(key)
            if job is None:
                job = self.jobs[key] = self._new_job(req, key, tokens, pins.get(pkey) if key != pkey else None)
                new_jobs.append(job.seq)
            if seq not in job.waiters:
                job.waiters.append(seq)
        return False, new_jobs

    def _new_job(self, req: Request, key: int, tokens: list[int], prefix: KVHandle | None) -> DocumentJob:
        jreq = Request(f"{req.request_id}#doc-{key:016x}", list(tokens), SamplingParams(max_tokens=1),
                       extra_key=req.extra_key, weight_version=req.weight_version, priority=req.priority, lora=req.lora)
        pdoc = self.bm.document_index.entries[self.keys(req)[0]] if prefix is not None else None
        job = DocumentJob(key, list(tokens), jreq.seqs[0], pdoc)
        jreq.job = job
        return job

    def _admit_job(self, jseq: Sequence, job: DocumentJob) -> tuple[bool, list[Sequence]]:
        """A document job sees the prefix (full visibility) and is encoded right after it; set up
        at every admission, since preemption (or the scheduler unpinning what waits) lets the
        job's pins go. By then the prefix may have been evicted and its blocks reused: it is looked
        up again (`job.prefix` follows a recomputed entry), and when it is gone the job parks like
        a query on a job that computes the prefix again (before, it pinned and attended to the
        old blocks: another document's, partly pinned, or free ones with stale KV)."""
        if job.prefix is None or jseq.shared:
            return True, []
        old = job.prefix
        prefix = self.bm.document_index.lookup(old.key, old.token_ids)
        if prefix is None:
            self.pins.setdefault(jseq, {})
            pjob = self.jobs.get(old.key)
            new_jobs = []
            if pjob is None:
                pjob = self.jobs[old.key] = self._new_job(jseq.request, old.key, list(old.token_ids), None)
                new_jobs.append(pjob.seq)
            if jseq not in pjob.waiters:
                pjob.waiters.append(jseq)
            return False, new_jobs
        # the prefix job's completion pinned it for this job (if it parked): that pin is the job's
        handle = self.pins.pop(jseq, {}).pop(old.key, None)
        self.reused.pop(jseq, None)
        job.prefix = prefix
        jseq.handles.append(handle if handle is not None else KVHandle(self.bm.pool, prefix.blocks))
        jseq.shared.append(Segment(prefix.blocks, prefix.length, pos_base=0, rope_base=0))
        jseq.pos_base = prefix.length
        return True, []

    # ---- completion (after each step) ------------------------------------------------------
    def complete(self, jseq: Sequence) -> list[Sequence]:
        """A document job's KV is all computed: cache it, pin it for the queries waiting on it,
        and return those that now wait on nothing (to be queued again, at the front)."""
        job: DocumentJob = jseq.request.job
        doc = self.bm.document_index.insert(job.key, job.tokens, list(jseq.block_table), jseq.pos_base)
        del self.jobs[job.key]
        # a job filled from a lower KV tier (engine/kv/tiers.py) reused the document: nothing computed
        loaded = jseq.num_cached_tokens == len(job.tokens)
        if loaded:
            self.counters["documents_hit"] += 1
            self.counters["document_tokens_reused"] += len(job.tokens)
        else:
            self.counters["documents_computed"] += 1
            self.counters["document_tokens_computed"] += len(job.tokens)
        ready = []
        for w in job.waiters:
            self.pins[w][job.key] = KVHandle(self.bm.pool, doc.blocks)
            if loaded:
                self.reused[w] = self.reused.get(w, 0) + len(job.tokens)
            if not any(w in j.waiters for j in self.jobs.values()):
                ready.append(w)
        return ready

    def forget(self, seq: Sequence) -> list[Sequence]:
        """A parked query went away (aborted): release its pins and stop waiting for it. Returns
        the job sequences no one waits for anymore (the caller ends them)."""
        for handle in self.pins.pop(seq, {}).values():
            handle.release()
        self.reused.pop(seq, None)
        orphans = []
        for key, job in list(self.jobs.items()):
            if seq in job.waiters:
                job.waiters.remove(seq)
                if not job.waiters:
                    del self.jobs[key]
                    orphans.append(job.seq)
        return orphans

    def unpin_parked(self) -> bool:
        """Release every pin parked queries hold, keeping them parked (their documents stay cached
        in the free LRU and are looked up again at admission). The scheduler's way out when the
        queue's head cannot get blocks, nothing runs, and those pins hold the blocks it needs.
        True if any pin was released."""
        released = False
        for seq, pins in self.pins.items():
            for handle in pins.values():
                handle.release()
                released = True
            pins.clear()
            self.reused[seq] = 0
        return released

    def is_parked(self, seq: Sequence) -> bool:
        return seq in self.pins

    def held_pins(self) -> list[KVHandle]:
        return [h for pins in self.pins.values() for h in pins.values()]
