"""Continuous batching: which sequences run this step and how many of their tokens.

Each step spends a token budget (`max_num_batched_tokens`): running sequences first, in arrival
order (a decode costs one token, plus its drafts under speculative decoding; an unfinished prompt
takes a chunk of what is left), then waiting
sequences are admitted while blocks and the budget last, so prefill chunks and decodes share a
step. When a decode cannot get a block, the most recently admitted running sequence is preempted:
its blocks are freed and it returns to the front of the queue to be recomputed later (its tokens
and its sampling state are kept, so the results do not change). Under the "priority" policy
(vLLM's `--scheduling-policy priority`) the queue is kept in (priority, arrival) order, lower
priority values first, a preempted sequence goes back to its place in that order, and the victim
is the last in that order among all running sequences (one scheduled earlier in the step gives
its tokens back); squid's document jobs and the queries whose documents just arrived still go to
the front. With KV tiers, a preempted sequence may first keep its partial block in a host swap
slot, and an admitted sequence whose prefix hits lie in a lower tier is *loading*: it holds its
blocks and seats but is not scheduled until its copy is done, while the others keep stepping; a
squid document job found in a lower tier is loading the same way and completes when its copy is
done, never computed. Owns the queues, not the blocks.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cuttle.engine.block_manager import BlockManager
from cuttle.engine.sequence import Sequence, SequenceStatus
from cuttle.engine.spec_decode import Proposer
from cuttle.engine.squid import Squid

if TYPE_CHECKING:
    from cuttle.engine.session import Sessions


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _order(seq: Sequence) -> tuple[int, float]:
    """A sequence's place under the priority policy: its request's priority (lower first), then arrival."""
    return seq.request.priority, seq.request.arrival_time


def _seats(seq: Sequence) -> int:
    req = seq.request
    return 1 if req.forked else req.sampling_params.n


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int, squid: Squid | None = None,
                 spec: Proposer | None = None, policy: str = "fcfs"):
        self.block_manager = block_manager
        self.by_priority = policy == "priority"
        self.squid = squid  # admits sequences with documents (engine/squid.py)
        self.spec = spec  # speculative decoding's drafts (engine/spec_decode.py), or None
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []  # admitted, waiting for their KV to be copied in
        self.num_preemptions = 0
        self.sessions: Sessions | None = None  # agent sessions (engine/session.py): a turn starts from its pins

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if self.by_priority:
            self._enqueue_in_order(seq)
        else:
            self.waiting.append(seq)

    def _enqueue_in_order(self, seq: Sequence) -> None:
        """Into the waiting queue after every sequence that goes before it; searched from the back,
        where a request of the common priority stops at once."""
        key = _order(seq)
        i = len(self.waiting)
        while i > 0 and _order(self.waiting[i - 1]) > key:
            i -= 1
        self.waiting.insert(i, seq)

    def schedule(self) -> SchedulerOutput:
        bm = self.block_manager
        if bm.tiers is None:
            return self._schedule()
        if self.loading:
            done = set(bm.poll_tiers())
            if done:
                ended = [s for s in self.loading if s in done]
                self.running.extend(ended)
                self.loading = [s for s in self.loading if s not in done]
                for seq in ended:
                    if seq.request.job is not None and seq.num_uncomputed_tokens == 0:
                        self.complete_job(seq)  # a document loaded whole: nothing to compute
        else:
            bm.poll_tiers()
        out = self._schedule()
        bm.tiers.flush()
        if out.is_empty and self.loading:  # nothing else can run: the step waits for the KV
            bm.wait_load(self.loading[0])
            return self.schedule()
        return out

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        kept: list[Sequence] = []
        running = self.running
        spec = self.spec
        # too many sequences this step for drafts to pay (engine/spec_decode.py)
        drafting = spec is None or spec.config.disable_by_batch_size is None or len(running) <= spec.config.disable_by_batch_size
        if spec is not None and spec.prepares:  # (the MTP layer's entries keep up on steps without drafts too)
            spec.prepare([s for s in running if s.num_uncomputed_tokens == 1], drafting)
        if not drafting:
            spec = None
        while running and budget > 0:
            seq = running.pop(0)
            if seq.num_uncomputed_tokens == 1:  # decode (or the last prompt token)
                budget += self._make_room(seq, lambda: bm.can_append(seq), running, kept, out)
                if seq.status != SequenceStatus.RUNNING:
                    continue
                bm.append_slot(seq)
                n = 1
                # drafts take budget left after this token and one for each sequence still to
                # schedule: they never push another decode out of the step
                if spec is not None and budget > 1 + len(running):
                    draft = spec.propose(seq, budget - 1 - len(running))
                    if draft:
                        # a block kept free for each sequence still to schedule: drafts never preempt
                        seq.draft = draft[: bm.reserve_draft_slots(seq, len(draft), keep_free=len(running))]
                        n += len(seq.draft)
            else:
                n = min(seq.num_uncomputed_tokens, budget)
                if bm.grows_lazily(seq):  # the chunk's blocks now: as many tokens as blocks can be had, one at least
                    budget += self._make_room(seq, lambda: bm.grow_cost(seq, 1) <= bm.num_free_blocks, running, kept, out)
                    if seq.status != SequenceStatus.RUNNING:
                        continue
                    n = min(n, bm.room(seq))
                    bm.grow(seq, n)
            out.scheduled.append((seq, n))
            budget -= n
            kept.append(seq)
        kept.extend(running)  # out of budget: they wait for the next step
        self.running = kept

        if out.preempted:
            return out
        # max_num_seqs counts sequences, and a request with n samples becomes n sequences when its
        # prompt completes (they fork from it), so an unforked prompt holds n seats from admission.
        seats = sum(_seats(s) for s in self.running) + sum(_seats(s) for s in self.loading)
        unpinned = False
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seats + _seats(seq) > self.max_num_seqs:
                break
            if self.squid is not None and (seq.request.layout is not None or seq.request.job is not None) and not seq.shared:
                ready, jobs = self.squid.admit(seq)
                if not ready:  # parked until its documents are computed; they run first
                    self.waiting.popleft()
                    self.waiting.extendleft(reversed(jobs))
                    continue
            # a document job never takes prefix-cache hits: its blocks go into the document index,
            # and a block lives in one index (a hit on a plain prompt's blocks made insert fail)
            use_cache = seq.request.prompt_logprobs is None and seq.request.job is None
            turn = self.sessions is not None and self.sessions.owns(seq)
            if not (self.sessions.can_allocate(seq, budget) if turn else bm.can_allocate(seq, use_cache, budget)):
                # nothing runs or loads, so no block will come free: the document pins of squid
                # queries not yet running are all that is left to give back (once per schedule)
                if not unpinned and not self.running and not self.loading and self._unpin_waiting():
                    unpinned = True
                    continue
                break
            seats += _seats(seq)
            self.waiting.popleft()
            if turn:
                self.sessions.allocate(seq, budget)
            else:
                bm.allocate(seq, use_cache, budget=budget)
            seq.status = SequenceStatus.RUNNING
            if bm.is_loading(seq):  # its blocks arrive from a lower tier; scheduled once they have
                self.loading.append(seq)
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append((seq, n))
            budget -= n
            self.running.append(seq)
        return out

    def _unpin_waiting(self) -> bool:
        """Release the document pins of parked queries and of waiting sequences that squid set up
        but that got no blocks yet; they are resolved again at admission (their documents stay
        cached in the free LRU unless the blocks are needed). True if anything was released."""
        if self.squid is None:
            return False
        released = self.squid.unpin_parked()
        for s in self.waiting:
            if s.shared and not s.block_table:
                self.block_manager.deallocate(s)
                released = True
        return released

    def _make_room(self, seq: Sequence, fits, running: list[Sequence], kept: list[Sequence], out: SchedulerOutput) -> int:
        """Preempt (`_victim`) until `fits()` or `seq` itself is preempted; returns the budget that
        victims scheduled earlier this step (priority) give back."""
        back = 0
        while not fits():
            victim = self._victim(seq, running, kept)
            if victim is seq:
                self._preempt(seq, out)
                break
            if victim in kept:  # scheduled earlier this step (priority): its tokens and budget come back
                kept.remove(victim)
                i = next(i for i, (s_, _) in enumerate(out.scheduled) if s_ is victim)
                back += out.scheduled.pop(i)[1]
            else:
                running.remove(victim)
            self._preempt(victim, out)
        return back

    def _victim(self, seq: Sequence, rest: list[Sequence], scheduled: list[Sequence]) -> Sequence:
        """Whom to preempt so that `seq` gets a block: under fcfs the most recently admitted of the
        sequences not scheduled yet this step (`rest`), else `seq` itself; under priority the last
        in priority order of every running sequence, those already scheduled this step included
        (vLLM's rule: a low-priority decode never holds a block a higher one needs)."""
        if self.by_priority:
            return max([*scheduled, *rest, seq], key=_order)
        return rest[-1] if rest else seq

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.draft = []
        self.block_manager.swap_out(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        plp = seq.request.prompt_logprobs
        if plp is not None and seq.index == 0 and len(plp) < seq.num_prompt_tokens:
            seq.request.prompt_logprobs = [None]  # recomputed from scratch with the prompt
        if self.by_priority:
            self._enqueue_in_order(seq)
        else:
            self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def insert_running_after(self, anchor: Sequence, seqs: list[Sequence]) -> None:
        i = self.running.index(anchor)
        self.running[i + 1 : i + 1] = seqs
        for s in seqs:
            s.status = SequenceStatus.RUNNING

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence from the queues and free its blocks at once."""
        if seq.status == SequenceStatus.RUNNING:
            if seq in self.loading:
                self.loading.remove(seq)
            else:
                self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        if self.squid is not None and self.squid.is_parked(seq):
            for orphan in self.squid.forget(seq):  # document jobs nobody waits for anymore
                self.finish(orphan)
        if self.sessions is not None:  # a session takes over the blocks of its finished turn
            self.sessions.end_turn(seq)
        self.block_manager.release(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED

    def complete_job(self, jseq: Sequence) -> None:
        """A document job's KV is all there (computed or loaded): cache it, end the job, and
        queue the queries that waited only for it."""
        assert self.squid is not None
        ready = self.squid.complete(jseq)
        self.finish(jseq)
        self.requeue(ready)

    def requeue(self, seqs: list[Sequence]) -> None:
        """Parked sequences whose documents are now cached go back to the front of the queue."""
        self.waiting.extendleft(reversed(seqs))
