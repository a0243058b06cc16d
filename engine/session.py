"""Agent sessions: one conversation's KV kept pinned in the pool between its turns.

A session is a token stream (prompt, sampled turns, appended tool results) plus a `KVHandle` on
the blocks that hold the KV of its first `computed` tokens. A turn is an ordinary request over the
session's whole stream; at admission its block table starts with the pinned blocks (the full ones
shared by reference, the partial last one copied, so a pinned block is never written), so only
the tokens not yet in KV are computed: what was appended since, plus the previous turn's last
sampled token (no engine computes a token's KV before something follows it). When the turn ends,
the session pins the turn's blocks and lets the old pins go. While a session is open its blocks
cannot be evicted, whatever the pressure on the pool; closing it releases every block.

Sessions forked from one another (`fork`) share their pinned blocks by reference; siblings that
have not diverged yet run their next turn as one request with `n` = their number, so a GRPO
group's prompt is prefilled once. KV computed under old weights is never reused: after a weight
update every pin is dropped and the next turn recomputes the whole stream (the prefix cache was
reset too). An aborted turn leaves the session as it was before the turn.

A session may run under a LoRA adapter (engine/lora.py), named when it is opened and inherited
by its forks: each turn runs under whatever that name resolves to then (after `update_lora`, the
new adapter), and pins are reused only by a turn under the very adapter (its key) they were
computed with, so a name reloaded with other weights recomputes the stream.

Bounded: at most `max_sessions` open, and the distinct blocks pinned by sessions plus what the
turns in flight may add stay within `max_session_kv_blocks`; beyond either, the call is refused
naming the limit and nothing changes, so the engine keeps serving everything else. With the KV
tiers on, a pinned block is never offloaded (only free cached blocks are); a session whose pins
were dropped finds its history through the prefix cache and the tiers like any request.

Owns the session table and the turn <-> session wiring; the scheduler asks it to allocate a turn's
blocks and tells it when a turn's sequence ends. Never runs the model, never frees a block it does
not hold.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from cuttle.attention.metadata import NULL_BLOCK
from cuttle.engine.block_manager import BlockManager
from cuttle.engine.kv.handles import KVHandle
from cuttle.engine.lora import LoRARequest
from cuttle.engine.sequence import Request, Sequence

_origins = itertools.count()


class SessionLimitError(ValueError):
    """A session or a turn refused for room alone (`max_sessions`, `max_session_kv_blocks`): a
    caller with another way to run (the server's beam search) takes it instead."""


@dataclass(eq=False, slots=True)
class Session:
    session_id: str
    token_ids: list[int]
    handle: KVHandle | None = None  # pins the blocks holding the KV of the first `computed` tokens
    computed: int = 0
    weight_version: int = 0  # the weights the pinned KV was computed with
    origin: int = field(default_factory=lambda: next(_origins))  # equal for siblings that have not diverged
    request: Request | None = None  # the turn in flight
    num_turns: int = 0
    lora_request: LoRARequest | None = None  # the adapter every turn runs under (None: the base model)
    lora_key: bytes | None = None  # the adapter the pinned KV was computed with

    @property
    def pinned_blocks(self) -> list[int]:
        return [b for b in self.handle.blocks if b != NULL_BLOCK] if self.handle is not None else []


class Sessions:
    def __init__(self, block_manager: BlockManager, max_sessions: int, max_session_kv_blocks: int):
        self.bm = block_manager
        self.max_sessions = max_sessions
        self.max_session_kv_blocks = max_session_kv_blocks
        self.table: dict[str, Session] = {}
        self.turns: dict[Request, list[Session]] = {}  # a turn in flight -> its sessions, by sample index
        self.reserved: dict[Request, int] = {}  # a turn in flight -> the blocks it may add to the pins
        self._ids = itertools.count()
        self.counters = {"sessions_opened": 0, "session_turns": 0, "session_tokens_reused": 0}

    # ---- lifecycle -------------------------------------------------------------------------
    def open(self, token_ids: list[int], lora_request: LoRARequest | None = None) -> Session:
        if not token_ids:
            raise ValueError("a session's prompt must not be empty")
        self._check_room(1)
        s = Session(f"session-{next(self._ids)}", list(token_ids), lora_request=lora_request)
        self.table[s.session_id] = s
        self.counters["sessions_opened"] += 1
        return s

    def fork(self, session_id: str, n: int) -> list[Session]:
        """`n` new sessions with the same stream, sharing its pinned blocks by reference."""
        parent = self.get(session_id)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if parent.request is not None:
            raise ValueError(f"session {session_id!r} has a turn in flight; fork it between turns")
        self._check_room(n)
        out = []
        for _ in range(n):
            s = Session(f"session-{next(self._ids)}", list(parent.token_ids), computed=parent.computed,
                        weight_version=parent.weight_version, origin=parent.origin, lora_request=parent.lora_request,
                        lora_key=parent.lora_key)
            if parent.handle is not None:
                s.handle = KVHandle(self.bm.pool, parent.handle.blocks)
            self.table[s.session_id] = s
            out.append(s)
        self.counters["sessions_opened"] += n
        return out

    def _check_room(self, n: int) -> None:
        if len(self.table) + n > self.max_sessions:
            raise SessionLimitError(f"{len(self.table)} sessions are open and {n} more would exceed max_sessions "
                             f"({self.max_sessions}); close one first")

    def get(self, session_id: str) -> Session:
        s = self.table.get(session_id)
        if s is None:
            raise ValueError(f"session {session_id!r} is not open")
        return s

    def append(self, session_id: str, token_ids: list[int]) -> None:
        s = self.get(session_id)
        if s.request is not None:
            raise ValueError(f"session {session_id!r} has a turn in flight; append after it ends")
        s.token_ids.extend(token_ids)
        s.origin = next(_origins)  # it no longer matches its siblings

    def replace_last(self, session_id: str, token_id: int) -> None:
        """Put `token_id` in place of the stream's last token, one whose KV is not computed yet
        (what a turn leaves: its sampled token): beam search forks a turn's session once per
        candidate it keeps and gives each its own next token. Nothing pinned changes."""
        s = self.get(session_id)
        if s.request is not None:
            raise ValueError(f"session {session_id!r} has a turn in flight; change it after the turn ends")
        if s.computed >= len(s.token_ids):
            raise ValueError(f"session {session_id!r}: its last token's KV is computed; only an uncomputed one can be replaced")
        s.token_ids[-1] = token_id
        s.origin = next(_origins)  # it no longer matches its siblings

    def close(self, session_id: str) -> Request | None:
        """Forget the session and release its pins; returns its turn in flight (the caller aborts
        it: for siblings that share one request that ends the turn of all of them)."""
        s = self.table.pop(session_id, None)
        if s is None:
            raise ValueError(f"session {session_id!r} is not open")
        self._drop_pins(s)
        return s.request

    def invalidate(self, weight_version: int) -> None:
        """New weights: no pinned KV may be reused, so every pin goes (the next turn recomputes)."""
        for s in self.table.values():
            self._drop_pins(s)
            s.weight_version = weight_version

    def _drop_pins(self, s: Session) -> None:
        if s.handle is not None:
            s.handle.release()
        s.handle, s.computed = None, 0

    # ---- turns -----------------------------------------------------------------------------
    def turn_sessions(self, session_ids: list[str]) -> list[Session]:
        """The sessions of one turn request: one session, or siblings that have not diverged."""
        if not session_ids:
            raise ValueError("session_ids must name at least one session")
        sessions = [self.get(sid) for sid in session_ids]
        if len(set(session_ids)) != len(session_ids):
            raise ValueError("session_ids must not repeat a session")
        for s in sessions:
            if s.request is not None:
                raise ValueError(f"session {s.session_id!r} already has a turn in flight")
        first = sessions[0]
        for s in sessions[1:]:
            if s.origin != first.origin or s.token_ids != first.token_ids:
                raise ValueError(f"sessions {first.session_id!r} and {s.session_id!r} have diverged: only forks with the "
                                 "same stream run one turn together (n samples of one prompt)")
        return sessions

    def begin_turn(self, sessions: list[Session], req: Request) -> None:
        """Register `req` as the turn of `sessions`; refused (nothing registered) when its pins
        could exceed `max_session_kv_blocks`."""
        bm = self.bm
        length = len(req.prompt_token_ids)
        first = sessions[0]
        pinned_full = first.computed // bm.block_size if self._usable(first, req) else 0
        shared = bm.blocks_needed(length) - pinned_full  # the stream's new blocks, computed once
        # each sample's growth, and with siblings the copy of the shared partial block it writes into
        own = bm.blocks_needed(length + req.max_tokens) - bm.blocks_needed(length) + (len(sessions) > 1)
        grow = shared + own * len(sessions)
        held = self.pinned_block_count() + sum(self.reserved.values())
        if held + grow > self.max_session_kv_blocks:
            raise SessionLimitError(f"this turn may pin {grow} more KV blocks; sessions hold or reserve {held} and "
                             f"max_session_kv_blocks is {self.max_session_kv_blocks}: close a session first")
        for s in sessions:
            s.request = req
        self.turns[req] = sessions
        self.reserved[req] = grow
        self.counters["session_turns"] += 1

    def _usable(self, s: Session, req: Request) -> bool:
        return (s.handle is not None and s.weight_version == req.weight_version and s.computed > 0
                and s.lora_key == _adapter_key(req))

    def owns(self, seq: Sequence) -> bool:
        return seq.request in self.turns

    def _session_of(self, seq: Sequence) -> Session:
        """The session a turn's sequence continues: its own sample's. Siblings share pins at the
        turn's start, but a sibling that ended first has already pinned its own stream on its
        session, so a preempted sibling coming back must not read session 0's."""
        return self.turns[seq.request][seq.index]

    def can_allocate(self, seq: Sequence, budget: int | None = None) -> bool:
        s = self._session_of(seq)
        if not self._usable(s, seq.request):
            return self.bm.can_allocate(seq, budget=budget)
        bm = self.bm
        needed = bm.blocks_needed(bm.backed_tokens(seq, s.computed, budget)) - s.computed // bm.block_size
        return needed <= bm.pool.num_free

    def allocate(self, seq: Sequence, budget: int | None = None) -> None:
        """The turn's blocks: the pinned full blocks shared, the pinned partial block copied (a
        pinned block is never written), new blocks for the rest (a lazily growing sequence's: for
        its first `budget` tokens to compute, `BlockManager.grows_lazily`). Without usable pins
        (first turn, new weights) the block manager allocates as for any request, prefix cache
        included."""
        s = self._session_of(seq)
        bm = self.bm
        if not self._usable(s, seq.request):
            bm.allocate(seq, read_in_place=False, budget=budget)  # the turn's table becomes a device-pool pin (KVHandle)
            return
        assert not seq.block_table, "sequence already holds blocks"
        pool = bm.pool
        assert s.computed < len(seq.token_ids), "a turn always has a token past its session's pinned KV"
        full, partial = divmod(s.computed, bm.block_size)
        table = list(s.handle.blocks[:full])
        for bid in table:
            if bid != NULL_BLOCK:  # (given back behind a sliding window: nothing to share)
                pool.ref(bid)
        if partial:
            new = pool.take()
            bm.pending_copies.append((s.handle.blocks[full], new))
            table.append(new)
        for _ in range(bm.blocks_needed(bm.backed_tokens(seq, s.computed, budget)) - len(table)):
            table.append(pool.take())
        seq.block_table = table
        seq.num_computed_tokens = seq.num_cached_tokens = s.computed
        self.counters["session_tokens_reused"] += s.computed
        if bm.tiers is not None:  # a swap slot from a preemption is not how this sequence comes back
            bm.tiers.drop_swap(seq)

    def end_turn(self, seq: Sequence) -> None:
        """A turn's sequence ends (finished or aborted), before its blocks are freed: a finished
        sample's session takes its stream and pins its blocks; an aborted turn changes nothing."""
        req = seq.request
        sessions = self.turns.get(req)
        if sessions is None:
            return
        if req.aborted:
            for s in sessions:
                s.request = None
        s = sessions[seq.index]
        if s.request is req:
            s.request = None
            if s.session_id in self.table:  # not closed while the turn ran
                computed = seq.num_computed_tokens
                old = s.handle
                s.handle = KVHandle(self.bm.pool, seq.block_table[: self.bm.blocks_needed(computed)])
                if old is not None:
                    old.release()
                s.token_ids = list(seq.token_ids)
                s.computed = computed
                s.weight_version = req.weight_version
                s.lora_key = _adapter_key(req)
                s.origin = next(_origins)
                s.num_turns += 1
        if all(x.request is not req for x in sessions):
            del self.turns[req], self.reserved[req]

    # ---- accounting ------------------------------------------------------------------------
    def pinned_block_count(self) -> int:
        return len({b for s in self.table.values() for b in s.pinned_blocks})

    def pins(self) -> list[KVHandle]:
        """Every handle sessions hold (for `BlockManager.check_invariants`)."""
        return [s.handle for s in self.table.values() if s.handle is not None]

    def stats(self) -> dict[str, int]:
        return {**self.counters, "sessions_open": len(self.table), "session_pinned_blocks": self.pinned_block_count()}


def _adapter_key(req: Request) -> bytes | None:
    return req.lora.key if req.lora is not None else None
