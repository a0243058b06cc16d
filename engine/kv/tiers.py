"""The KV tiers under the device pool: a host tier, an optional disk tier, and the moves between them.

Owns the host pool (its own `BlockPool`: ref counts and LRU; its own `KVStorage`, pinned on CUDA;
its own `PrefixIndex` over the same hash chain), the disk tier, the swap slots of preempted
sequences and every transfer in flight. The device side stays the block manager's; this module
plugs in at three seams:

- **Offload** (the device pool's `on_evict` hook): a full, hashed block about to be handed out
  again is given a host block and queued for a copy; a copy to disk follows it (write-through, so
  the host tier never has to copy anything out when it evicts). The queued copies of one schedule
  go to the copy worker as one job when the schedule ends (`flush`); the new owner of an evicted
  device block writes it only in the step's forward (or a copy-on-write before it), and
  `before_write` makes those wait for every offload in flight — so a device block is never
  reused before its copy is done, while the runner builds the step's inputs meanwhile.
- **Lookup and reload** (`plan_load`, from the block manager's allocation): after the device
  prefix hits, the same hash chain and token re-check continue into the host index, then into
  the disk tier. The sequence gets its device blocks at once; the hits are copied into them by
  one job (disk -> host staging -> device), submitted after this schedule's offloads (FIFO: a
  block evicted and reused as a load target is read before it is overwritten), and the
  scheduler holds the sequence until `poll` reports the job done. A disk entry that turns out
  short or corrupt ends the hit there: the sequence computes the rest.
- **Documents** (squid): a cached document's blocks carry no chain hash but a document key
  (tokens + prefix key + weight version + dtype). When the first of them is evicted the whole
  entry goes down (its other blocks are free too: an entry is pinned whole or not at all) into a
  host `DocumentIndex`, block for block, and each block is written through to disk under a key
  derived from the document key and its index. A document job (engine/squid.py) that finds its
  document below (`plan_document_load`) is filled by a load instead of a prefill: the job's
  blocks are its targets, and it completes when the copy is done. Any bad disk block makes the
  whole document a miss (a document is used whole or not at all): the job then computes it.
- **Read in place** (also in `plan_load`): where the attention kernels can address the host
  tier (CPU here), a run of host hits may stay where it is instead of being copied in: the
  sequence's table names those host blocks (`HOST_BLOCK` ids; the sequence holds a host reference
  on each until it lets go of its table) and their device blocks go back unwritten. The cost
  model chooses per run (`read_in_place`: "auto"), or the engine option forces one way. Only full,
  hashed blocks are read in place, and new K/V never goes to them.
- **Swap** (`swap_out`, at preemption): a sequence's full blocks are hashed and stay in the
  prefix cache, so under pressure they are offloaded like any prefix block and come back by the
  lookup above; what would be lost is the partial last block, which is copied to a host swap slot
  when the cost model says copying beats recomputing, and reloaded with the rest if the whole
  chain before it was found.

Every key is the prefix chain hash, which carries the weight version and cache salt; the disk
tier adds a namespace for the checkpoint. Holders are explicit: a transfer pins its source and
target blocks until `poll` sees it done, a swap slot pins its host block. Never runs a model.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import xxhash

from cuttle.attention.metadata import HOST_BLOCK
from cuttle.engine.kv.cost_model import CostModel
from cuttle.engine.kv.disk_tier import DiskTier
from cuttle.engine.kv.document_index import Document, DocumentIndex
from cuttle.engine.kv.pool import NO_HASH, Block, BlockPool
from cuttle.engine.kv.prefix_index import PrefixIndex, hash_block
from cuttle.engine.kv.storage import KVStorage
from cuttle.engine.kv.transfer import Ticket, TransferEngine, block_payload, byte_views, set_block_payload
from cuttle.engine.sequence import Sequence


@dataclass(slots=True, eq=False)
class Swap:
    """The partial last block of a preempted sequence, kept in a host block."""

    host_id: int
    num_tokens: int  # the sequence's computed tokens when it was preempted
    block_index: int  # where that partial block sits in its table


@dataclass(slots=True, eq=False)
class Load:
    """Blocks brought back into a sequence's table from below, in chain order: host hits, disk
    hits (through host staging blocks), then the swapped partial block."""

    seq: Sequence
    first: int  # index in the table of the first block this load fills
    dev_ids: list[int]  # target device blocks (pinned by the load)
    host_ids: list[int]  # host hits (pinned by the load)
    disk: list[tuple[int, tuple[int, ...], int]]  # (key, tokens, host staging block) per disk hit
    swap: Swap | None
    document: Document | None = None  # a document load: key, tokens, length, pos_base (no blocks)
    ticket: Ticket | None = None
    queued_at: float = field(default_factory=time.perf_counter)


def document_block_key(doc_key: int, index: int) -> int:
    """The disk key of block `index` of a document: the document key already carries everything
    its KV depends on (tokens, prefix, weight version, dtype); the disk namespace adds the rest."""
    h = xxhash.xxh3_64(b"cuttle-document-block")
    h.update(doc_key.to_bytes(8, "little") + index.to_bytes(4, "little"))
    return h.intdigest()


class KVTiers:
    def __init__(self, device_pool: BlockPool, device_kv: KVStorage, block_size: int, host_blocks: int,
                 transfer: TransferEngine, bytes_per_block: int, disk: DiskTier | None = None, pin_memory: bool = False):
        if host_blocks < 1:
            raise ValueError(f"the host tier needs at least one block, got {host_blocks}")
        self.device_pool = device_pool
        self.device_kv = device_kv
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.transfer = transfer
        self.disk = disk
        L, _, _, bs, heads, dim = device_kv.tensor.shape
        self.host_pool = BlockPool(host_blocks, pool_id=1)
        self.host_kv = KVStorage(L, host_blocks, bs, heads, dim, device_kv.tensor.dtype, torch.device("cpu"), pin_memory,
                                 companions=device_kv.companion_specs)
        self.host_index = PrefixIndex(self.host_pool, block_size)
        self.host_docs = DocumentIndex(self.host_pool, block_size)
        self.device_docs: DocumentIndex | None = None  # the block manager's, for offloading documents
        self.device_index: PrefixIndex | None = None  # the block manager's, for chains read in place
        self.cost: CostModel | None = None  # measured by the engine once the pools exist
        self.read_in_place = "never"  # host hits: "auto" (the cost model chooses), "never", "always"
        device_pool.on_evict(self._offload, first=True)
        self._offloads: list[tuple[int, int]] = []  # (device, host) copies decided, not yet submitted
        self._to_disk: list[tuple[int, tuple[int, ...], int, list[str]]] = []  # (key, tokens, host, victims)
        self._queued: list[Load] = []  # loads decided, submitted after this schedule's offloads
        self._offload_jobs: list[tuple[Ticket, list[int]]] = []  # in flight, with the host blocks they pin
        self._disk_jobs: list[tuple[Ticket, list[int], list[int]]] = []  # in flight: ticket, host pins, keys
        self.loads: dict[Sequence, Load] = {}
        self.swapped: dict[Sequence, Swap] = {}
        self.counters: dict[str, float] = {
            "kv_host_hit_blocks": 0, "kv_disk_hit_blocks": 0, "kv_disk_bad_entries": 0,
            "kv_offloaded_blocks": 0, "kv_bytes_device_to_host": 0, "kv_bytes_host_to_device": 0,
            "kv_bytes_host_to_disk": 0, "kv_bytes_disk_to_host": 0, "kv_transfer_blocked_s": 0.0,
            "kv_swap_outs": 0, "kv_swap_ins": 0, "kv_preempt_recompute": 0, "kv_offload_skipped_full": 0,
            "kv_offloaded_documents": 0, "kv_host_document_hits": 0, "kv_disk_document_hits": 0,
            "kv_read_in_place_blocks": 0, "kv_read_in_place_runs": 0, "kv_copy_in_runs": 0,
        }

    # ---- offload (device eviction hook) ----------------------------------------------------
    def _offload(self, block: Block) -> None:
        if block.document is not None:
            self._offload_document(block.document)
            return
        if block.hash == NO_HASH:
            return
        hit = self.host_index.find(block.hash, block.token_ids)
        if hit is not None:  # already below: refresh its place in the host LRU
            self.host_pool.ref(hit)
            self.host_pool.unref(hit)
            return
        if self.host_pool.num_free == 0:
            self._reclaim()
        if self.host_pool.num_free == 0:  # every host block is pinned by a swap slot or a load
            self.counters["kv_offload_skipped_full"] += 1
            return
        hid = self.host_pool.take()  # its one reference is the copy's, dropped when it is done
        self.host_index.insert(self.host_pool.blocks[hid], block.hash, block.token_ids)
        self._offloads.append((block.block_id, hid))
        if self.disk is not None and block.hash not in self.disk:
            self.host_pool.ref(hid)  # and the disk write's
            self._to_disk.append((block.hash, block.token_ids, hid, self.disk.reserve(block.hash)))

    def _offload_document(self, key: int) -> None:
        """The first block of a cached document is being evicted: copy the whole entry down (its
        other blocks are free as well, and become plain free blocks once the device index forgets
        the entry, so the copy job is fenced by `before_write` like any offload)."""
        assert self.device_docs is not None
        doc = self.device_docs.entries.get(key)
        if doc is None:
            return
        hit = self.host_docs.lookup(key, doc.token_ids)
        if hit is not None:  # already below: refresh its place in the host LRU, tail last
            for hid in hit.blocks:
                self.host_pool.ref(hid)
            for hid in reversed(hit.blocks):
                self.host_pool.unref(hid)
            return
        n = len(doc.blocks)
        if self.host_pool.num_free < n:
            self._reclaim()
        if self.host_pool.num_free < n:
            self.counters["kv_offload_skipped_full"] += 1
            return
        host = [self.host_pool.take() for _ in range(n)]  # each one's reference is the copy's
        self.host_docs.insert(key, doc.token_ids, host, doc.pos_base)
        self._offloads.extend(zip(doc.blocks, host))
        self.counters["kv_offloaded_documents"] += 1
        if self.disk is not None:
            bs = self.block_size
            for i, hid in enumerate(host):
                dkey = document_block_key(key, i)
                if dkey in self.disk:
                    continue
                self.host_pool.ref(hid)  # and the disk write's
                self._to_disk.append((dkey, doc.token_ids[i * bs : (i + 1) * bs], hid, self.disk.reserve(dkey)))

    def flush(self) -> None:
        """Submit what this schedule decided, in the order that keeps every read before the
        write that reuses its block: device -> host, host -> disk, then the loads."""
        bpb = self.bytes_per_block
        if self._offloads:
            dev = [d for d, _ in self._offloads]
            host = [h for _, h in self._offloads]
            self._offloads = []
            t = self.transfer.submit(lambda: self.transfer.device_to_host(self.device_kv, dev, self.host_kv, host))
            self._offload_jobs.append((t, host))
            self.counters["kv_offloaded_blocks"] += len(dev)
            self.counters["kv_bytes_device_to_host"] += len(dev) * bpb
        if self._to_disk:
            entries, self._to_disk = self._to_disk, []
            disk, ns, views = self.disk, self.disk.namespace, byte_views(self.host_kv)

            def write() -> int:
                return sum(disk.write(key, ns, tokens, block_payload(views, hid), victims) for key, tokens, hid, victims in entries)

            self._disk_jobs.append((self.transfer.submit(write), [e[2] for e in entries], [e[0] for e in entries]))
        for load in self._queued:
            load.ticket = self.transfer.submit(self._load_job(load))
        self._queued = []

    def before_write(self) -> None:
        """Called before anything writes the device pool (the forward, copy-on-write copies):
        every offload in flight must have read its blocks."""
        if not self._offload_jobs:
            return
        t = time.perf_counter()
        for ticket, _ in self._offload_jobs:
            ticket.order_before_compute()
        self.counters["kv_transfer_blocked_s"] += time.perf_counter() - t

    # ---- lookup and reload -----------------------------------------------------------------
    def plan_load(self, seq: Sequence, first: int, parent: int, extra_key: bytes) -> bool:
        """`seq` was just given its blocks, the first `first` of them hits (device prefix hits and
        what `attach_in_place` attached; the last with chain hash `parent`). Continue the chain
        below and queue a load of what is found into the following blocks (copy-in). True if a
        load was queued (the sequence waits for it)."""
        bs = self.block_size
        tokens = seq.token_ids
        max_blocks = (len(tokens) - 1) // bs
        swap = self.swapped.pop(seq, None)
        host_ids = self.host_index.match(tokens[first * bs :], max_blocks - first, extra_key, parent) if first < max_blocks else []
        for hid in host_ids:
            self.host_pool.ref(hid)
        if host_ids:
            parent = self.host_pool.blocks[host_ids[-1]].hash
            self.counters["kv_copy_in_runs"] += 1
        disk: list[tuple[int, tuple[int, ...], int]] = []
        if self.disk is not None:
            for i in range(first + len(host_ids), max_blocks):
                if self.host_pool.num_free == 0:
                    self._reclaim()  # staging blocks pinned by copies in flight come free
                if self.host_pool.num_free == 0:  # a chain longer than the host tier: recompute the rest
                    break
                block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
                key = hash_block(parent, block_tokens, extra_key)
                if key not in self.disk:
                    break
                self.disk.touch(key)
                disk.append((key, block_tokens, self.host_pool.take()))
                parent = key
        end = first + len(host_ids) + len(disk)
        if swap is not None and swap.block_index != end:  # the chain before it is gone: recompute
            self.host_pool.unref(swap.host_id)
            swap = None
        if not host_ids and not disk and swap is None:
            return False
        dev_ids = seq.block_table[first : end + (1 if swap is not None else 0)]
        for bid in dev_ids:
            self.device_pool.ref(bid)
        load = Load(seq, first, list(dev_ids), host_ids, disk, swap)
        self._queued.append(load)
        self.loads[seq] = load
        return True

    def attach_in_place(self, seq: Sequence, first: int, parent: int, extra_key: bytes) -> tuple[list[int], int]:
        """Before `seq` gets its own device blocks (its first `first` blocks are device prefix hits,
        the last with chain hash `parent`): if the chain continues in the host tier and the cost
        model (or the option) says to read that run in place, the table entries from `first` on,
        referenced: the host blocks as HOST_BLOCK ids, then alternately device and host hits (a
        session read in place keeps its old turns below and its newer ones on the device, so the
        next turn finds both). Deciding before any device block is taken means nothing is evicted
        for blocks that stay below. Returns (entries, chain hash of the last)."""
        if self.read_in_place == "never":
            return [], parent
        assert self.device_index is not None
        bs, tokens = self.block_size, seq.token_ids
        max_blocks = (len(tokens) - 1) // bs
        if first >= max_blocks:
            return [], parent
        run = self.host_index.match(tokens[first * bs :], max_blocks - first, extra_key, parent)
        if not run or not self._reads_in_place(seq, len(run)):
            return [], parent
        entries: list[int] = []
        on_host = True
        while run:
            pool = self.host_pool if on_host else self.device_pool
            for bid in run:
                pool.ref(bid)
                entries.append(bid | HOST_BLOCK if on_host else bid)
            parent = pool.blocks[run[-1]].hash
            if on_host:
                self.counters["kv_host_hit_blocks"] += len(run)
                self.counters["kv_read_in_place_blocks"] += len(run)
            i = first + len(entries)
            if i >= max_blocks:
                break
            on_host = not on_host
            index = self.host_index if on_host else self.device_index
            run = index.match(tokens[i * bs :], max_blocks - i, extra_key, parent)
        self.counters["kv_read_in_place_runs"] += 1
        return entries, parent

    def _reads_in_place(self, seq: Sequence, num_blocks: int) -> bool:
        if self.read_in_place != "auto":
            return self.read_in_place == "always"
        assert self.cost is not None
        remaining = max(0, seq.request.max_tokens - seq.num_output_tokens)  # decode steps still to come
        return self.cost.read_in_place_pays(num_blocks, remaining)

    def plan_document_load(self, seq: Sequence, key: int, tokens: tuple[int, ...]) -> bool:
        """`seq` is the job computing document `key` and was just given its device blocks; if the
        document is in the host tier, or whole on disk, queue a load of it into those blocks
        instead. True if a load was queued (the job completes when it is done)."""
        self.drop_swap(seq)
        doc = Document(key, tuple(tokens), [], len(tokens), seq.pos_base)
        n = len(seq.block_table)
        host_ids: list[int] = []
        disk: list[tuple[int, tuple[int, ...], int]] = []
        hit = self.host_docs.lookup(key, tokens)
        if hit is not None:
            host_ids = list(hit.blocks)
            for hid in host_ids:
                self.host_pool.ref(hid)
        elif self.disk is not None:
            keys = [document_block_key(key, i) for i in range(n)]
            if not all(k in self.disk for k in keys):
                return False
            if self.host_pool.num_free < n:
                self._reclaim()
            if self.host_pool.num_free < n:  # a document larger than the free host tier: compute it
                return False
            bs = self.block_size
            for i, k in enumerate(keys):
                self.disk.touch(k)
                disk.append((k, doc.token_ids[i * bs : (i + 1) * bs], self.host_pool.take()))
        else:
            return False
        dev_ids = list(seq.block_table)
        for bid in dev_ids:
            self.device_pool.ref(bid)
        load = Load(seq, 0, dev_ids, host_ids, disk, None, document=doc)
        self._queued.append(load)
        self.loads[seq] = load
        return True

    def _load_job(self, load: Load):
        disk, ns = self.disk, (self.disk.namespace if self.disk is not None else 0)
        host_kv, device_kv, transfer = self.host_kv, self.device_kv, self.transfer

        def run() -> int:
            """Returns how many disk hits were read intact; loads the blocks up to the first bad one."""
            views = byte_views(host_kv)
            good = 0
            for key, tokens, hid in load.disk:
                payload = disk.read(key, ns, tokens)
                if payload is None:
                    break
                set_block_payload(views, hid, payload)
                good += 1
            src = load.host_ids + [hid for _, _, hid in load.disk[:good]]
            if good == len(load.disk) and load.swap is not None:
                src.append(load.swap.host_id)
            transfer.host_to_device(host_kv, src, device_kv, load.dev_ids[: len(src)])
            return good

        return run

    def _reclaim(self) -> None:
        """Every host block is pinned, most likely by copies in flight (a schedule that evicts
        more blocks than the host tier holds): submit what is queued and wait for the offloads
        and disk writes, whose blocks are then free (and still cached) again."""
        t = time.perf_counter()
        self._wait_offloads()
        self._release_transfers()
        self.counters["kv_transfer_blocked_s"] += time.perf_counter() - t

    def poll(self) -> list[Sequence]:
        """Release what finished transfers pinned; returns the sequences whose loads are done
        (their computed counts now include what was loaded)."""
        self._release_transfers()
        done = [seq for seq, load in self.loads.items() if load.ticket is not None and load.ticket.done()]
        for seq in done:
            self._finish_load(self.loads.pop(seq))
        return done

    def _release_transfers(self) -> None:
        if self._offload_jobs:
            still = []
            for ticket, pins in self._offload_jobs:
                if ticket.done():
                    for hid in pins:
                        self.host_pool.unref(hid)
                else:
                    still.append((ticket, pins))
            self._offload_jobs = still
        if self._disk_jobs:
            still_disk = []
            for ticket, pins, keys in self._disk_jobs:
                if not ticket.done():
                    still_disk.append((ticket, pins, keys))
                    continue
                self._finish_disk_write(ticket, pins, keys)
            self._disk_jobs = still_disk

    def _finish_disk_write(self, ticket: Ticket, pins: list[int], keys: list[int]) -> None:
        try:
            self.counters["kv_bytes_host_to_disk"] += ticket.wait()
        except OSError:  # a full or broken disk loses those entries, nothing else
            for key in keys:
                self.disk.forget(key)
        for hid in pins:
            self.host_pool.unref(hid)

    def _finish_load(self, load: Load) -> None:
        if load.document is not None:
            self._finish_document_load(load)
            return
        good = load.ticket.wait()
        seq, bs, bpb = load.seq, self.block_size, self.bytes_per_block
        for key, tokens, hid in load.disk[:good]:  # a disk hit read back is a host entry again
            self.host_index.insert(self.host_pool.blocks[hid], key, tokens)
        for key, _, _ in load.disk[good:good + 1]:
            self.disk.forget(key)
            self.counters["kv_disk_bad_entries"] += 1
        for hid in load.host_ids + [hid for _, _, hid in load.disk]:
            self.host_pool.unref(hid)
        for bid in load.dev_ids:
            self.device_pool.unref(bid)
        full = len(load.host_ids) + good
        loaded = full
        seq.num_computed_tokens = (load.first + full) * bs
        if load.swap is not None:
            if good == len(load.disk):
                seq.num_computed_tokens = load.swap.num_tokens
                loaded += 1
                self.counters["kv_swap_ins"] += 1
            self.host_pool.unref(load.swap.host_id)
        self.counters["kv_host_hit_blocks"] += len(load.host_ids)
        self.counters["kv_disk_hit_blocks"] += good
        self.counters["kv_bytes_disk_to_host"] += good * bpb
        self.counters["kv_bytes_host_to_device"] += loaded * bpb

    def _finish_document_load(self, load: Load) -> None:
        """A document is whole or a miss: with every block loaded the job's KV is complete;
        otherwise (a disk block short, corrupt or gone) it computes the document from scratch."""
        good = load.ticket.wait()
        doc, seq, bpb = load.document, load.seq, self.bytes_per_block
        whole = good == len(load.disk)
        staging = [hid for _, _, hid in load.disk]
        if load.disk and whole:  # read back from disk: a host entry again
            self.host_docs.insert(doc.key, doc.token_ids, staging, doc.pos_base)
        for key, _, _ in load.disk[good:good + 1]:
            self.disk.forget(key)
            self.counters["kv_disk_bad_entries"] += 1
        for hid in reversed(load.host_ids + staging):
            self.host_pool.unref(hid)
        for bid in load.dev_ids:
            self.device_pool.unref(bid)
        self.counters["kv_bytes_disk_to_host"] += good * bpb
        if not whole:
            seq.num_computed_tokens = 0
            return
        seq.num_computed_tokens = doc.length
        self.counters["kv_host_document_hits" if load.host_ids else "kv_disk_document_hits"] += 1
        self.counters["kv_bytes_host_to_device"] += len(load.dev_ids) * bpb

    def wait(self, seq: Sequence) -> None:
        """Block until `seq`'s load is done (then `poll` reports it)."""
        load = self.loads[seq]
        if load.ticket is None:
            self.flush()
        t = time.perf_counter()
        load.ticket.wait()
        self.counters["kv_transfer_blocked_s"] += time.perf_counter() - t

    def cancel(self, seq: Sequence) -> None:
        """`seq` ends while its load is in flight: wait for the copy (its target blocks must not
        be reused under it), then give everything back."""
        if seq in self.loads:
            self.wait(seq)
            self._finish_load(self.loads.pop(seq))
        self.drop_swap(seq)

    # ---- swap ------------------------------------------------------------------------------
    def swap_out(self, seq: Sequence) -> bool:
        """`seq` is being preempted (its blocks are about to be freed): keep its partial last
        block in a host swap slot if the cost model says copying it out and back beats
        recomputing the sequence. Its full blocks are hashed and stay in the prefix cache."""
        computed = seq.num_computed_tokens
        index, partial = divmod(computed, self.block_size)
        if partial == 0:
            return False
        assert self.cost is not None
        if not self.cost.swap_pays(computed, index + 1):
            self.counters["kv_preempt_recompute"] += 1
            return False
        if self.host_pool.num_free == 0:
            return False
        hid = self.host_pool.take()  # the swap slot's reference
        self.host_pool.ref(hid)  # and the copy's
        self._offloads.append((seq.block_table[index], hid))
        self.swapped[seq] = Swap(hid, computed, index)
        self.counters["kv_swap_outs"] += 1
        return True

    def drop_swap(self, seq: Sequence) -> None:
        swap = self.swapped.pop(seq, None)
        if swap is not None:
            self.host_pool.unref(swap.host_id)

    # ---- lifecycle -------------------------------------------------------------------------
    def reset(self, disk_namespace: int | None = None) -> None:
        """After a weight update: forget every host entry (pinned blocks stay valid for their
        holders) and switch the disk tier to the new weights' namespace."""
        self.host_index.reset()
        self.host_docs.reset()
        if self.disk is not None and disk_namespace is not None:
            self.disk.set_namespace(disk_namespace)

    def _wait_offloads(self) -> None:
        """Submit what is queued and wait for every offload and disk write (a failed disk write
        is a miss later, not an error here)."""
        self.flush()
        for ticket, _ in self._offload_jobs:
            ticket.wait()
        for ticket, _, _ in self._disk_jobs:
            try:
                ticket.wait()
            except OSError:
                pass

    def drain(self) -> None:
        """Wait for every transfer and release what they pinned (tests; shutdown)."""
        self._wait_offloads()
        for load in self.loads.values():
            load.ticket.wait()
        self.poll()

    def device_pins(self) -> list[list[int]]:
        """Device blocks held by loads in flight (holders beside sequences, for invariant checks)."""
        return [load.dev_ids for load in self.loads.values()]

    def check(self, table_refs: list[int] | None = None) -> None:
        """Every host block's ref count equals its holders: transfers in flight or queued, swap
        slots, loads, and the sequences' tables that read it in place (`table_refs`, per host
        block); the host index points only at blocks that hold what it says."""
        refs = list(table_refs) if table_refs is not None else [0] * len(self.host_pool)
        for _, hid in self._offloads:
            refs[hid] += 1
        for _, _, hid, _ in self._to_disk:
            refs[hid] += 1
        for _, pins in self._offload_jobs:
            for hid in pins:
                refs[hid] += 1
        for _, pins, _ in self._disk_jobs:
            for hid in pins:
                refs[hid] += 1
        for swap in self.swapped.values():
            refs[swap.host_id] += 1
        for load in self.loads.values():
            for hid in load.host_ids + [hid for _, _, hid in load.disk]:
                refs[hid] += 1
            if load.swap is not None:
                refs[load.swap.host_id] += 1
        for block, r in zip(self.host_pool.blocks, refs):
            assert block.ref_count == r, f"host block {block.block_id}: ref_count {block.ref_count} but {r} holders"
            assert (block.block_id in self.host_pool.free) == (r == 0), f"host block {block.block_id}: free-list membership wrong"
        self.host_index.check()
        # transfers pin a host document block by block (a disk write only for the blocks not on
        # disk yet), so a host entry may be partly pinned, unlike a device one
        self.host_docs.check(whole_pins=False)

    def unfenced_offloads(self) -> int:
        """Offload jobs whose copies are not known finished (0 right after `before_write` on CPU)."""
        return sum(1 for t, _ in self._offload_jobs if not t.future.done())

    def stats(self) -> dict[str, float]:
        out = dict(self.counters)
        out["kv_host_blocks_total"] = len(self.host_pool)
        out["kv_host_blocks_free"] = self.host_pool.num_free
        if self.disk is not None:
            out["kv_disk_entries"] = len(self.disk.entries)
            out["kv_disk_bytes"] = self.disk.used_bytes
        if self.cost is not None:
            out["kv_copy_bandwidth_gbps"] = self.cost.copy_bytes_per_s / 1e9
            out["kv_compute_tflops"] = self.cost.flops_per_s / 1e12
        return out

