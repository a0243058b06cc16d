"""Moving KV blocks between pools, off the step's critical path.

Owns the copy worker: one thread that runs every transfer job in submission order (FIFO), so a
job that writes a block always runs after an earlier job that reads it — the tier relies on this
ordering instead of per-block locks. On CUDA the jobs issue their copies on a side stream
(device <-> pinned host through a staging buffer, then the host side scattered by the worker), so
the compute stream waits on an event, not the host; on CPU the worker copies with numpy slices,
which release the GIL and stay off torch's OpenMP pool (a second thread starting OpenMP regions
slows every kernel of the stepping thread: docs/architecture.md, "one thread does all the OpenMP
work"). Never decides *what* to move: `engine/kv/tiers.py` does.
"""
from __future__ import annotations

import ctypes

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from cuttle.engine.kv.storage import KVStorage


def byte_views(storage: KVStorage) -> list[np.ndarray]:
    """uint8 views over the pool's memory, the KV tensor's ([layers, 2, blocks, block_size,
    kv_heads, head_dim * itemsize]) then each companion's, blocks on dimension 2 of each (numpy has
    no bf16; bytes are all a copy needs). CPU tensors only. Made from the address, not with
    `Tensor.numpy()`, which marks the storage as never resizable for good: sleep mode
    (engine/sleep_mode.py) frees the pool by resizing its storage. So a view must not outlive the
    call that made it (none is kept)."""
    out = []
    for t in storage.tensors:
        b = t.view(torch.uint8)
        assert b.is_contiguous() and b.device.type == "cpu"
        buf = (ctypes.c_uint8 * b.numel()).from_address(b.data_ptr())
        out.append(np.frombuffer(buf, dtype=np.uint8).reshape(b.shape))
    return out


def block_payload(views: list[np.ndarray], block: int) -> np.ndarray:
    """One block's bytes, KV then companions, as one flat array (a disk entry's payload)."""
    return np.concatenate([np.ascontiguousarray(v[:, :, block]).reshape(-1) for v in views])


def set_block_payload(views: list[np.ndarray], block: int, payload: bytes) -> None:
    """The inverse of block_payload: `payload` (as it wrote it) into block `block` of each view."""
    flat, at = np.frombuffer(payload, dtype=np.uint8), 0
    for v in views:
        dst = v[:, :, block]
        dst[...] = flat[at : at + dst.size].reshape(dst.shape)
        at += dst.size


def copy_runs(dst: np.ndarray, dst_ids: list[int], src: np.ndarray, src_ids: list[int]) -> None:
    """dst[:, :, dst_ids[i]] = src[:, :, src_ids[i]], one slice copy per run of consecutive ids on
    both sides (numpy's fancy-index assignment measured ~0.5 GB/s here, slices 3-5 GB/s)."""
    i, n = 0, len(dst_ids)
    while i < n:
        j = i + 1
        while j < n and dst_ids[j] == dst_ids[j - 1] + 1 and src_ids[j] == src_ids[j - 1] + 1:
            j += 1
        d0, s0, k = dst_ids[i], src_ids[i], j - i
        dst[:, :, d0 : d0 + k] = src[:, :, s0 : s0 + k]
        i = j


class Ticket:
    """One submitted job: poll with `done`, block with `wait` (returns the job's result)."""

    __slots__ = ("future",)

    def __init__(self, future: Future):
        self.future = future

    def done(self) -> bool:
        if not self.future.done():
            return False
        event = self.future.result()[1]
        return event is None or event.query()

    def wait(self) -> Any:
        result, event = self.future.result()
        if event is not None:
            event.synchronize()
        return result

    def order_before_compute(self) -> None:
        """Make the compute stream wait for this job's copies (CUDA: an event wait, the host does
        not block once the job is issued; CPU: the copy itself is waited for)."""
        result, event = self.future.result()
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


class TransferEngine:
    def __init__(self, device: torch.device, slowdown_s: float = 0.0):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cuttle-kv-copy")
        # tests widen race windows with this (every job sleeps first); 0 in the engine
        self.slowdown_s = slowdown_s

    def submit(self, job: Callable[[], Any]) -> Ticket:
        """Run `job` on the copy worker after every job submitted before it. On CUDA it runs
        under the side stream, ordered after the compute stream's work issued so far (the KV a
        job reads may still be being written by the last forward)."""
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))

        def run() -> tuple[Any, Any]:
            if self.slowdown_s:
                time.sleep(self.slowdown_s)
            if not self.cuda:
                return job(), None
            assert self.stream is not None
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                result = job()
                done = torch.cuda.Event()
                done.record(self.stream)
            return result, done

        return Ticket(self._worker.submit(run))

    # ---- the copies (run on the worker) ----------------------------------------------------
    def device_to_host(self, src: KVStorage, src_ids: list[int], dst: KVStorage, dst_ids: list[int]) -> None:
        if not self.cuda:
            for d, s in zip(byte_views(dst), byte_views(src)):
                copy_runs(d, dst_ids, s, src_ids)
            return
        # gather on the device, one DMA into pinned staging, then scatter on the host: the
        # scatter needs the DMA finished, which this worker waits for (the step does not)
        index = torch.tensor(src_ids, device=src.device)
        pinned = []
        for t in src.tensors:
            staged = t[:, :, index]
            pinned.append(torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True))
            pinned[-1].copy_(staged, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        for d, p in zip(byte_views(dst), pinned):
            copy_runs(d, dst_ids, p.view(torch.uint8).numpy(), list(range(len(dst_ids))))

    def host_to_device(self, src: KVStorage, src_ids: list[int], dst: KVStorage, dst_ids: list[int]) -> None:
        if not self.cuda:
            for d, s in zip(byte_views(dst), byte_views(src)):
                copy_runs(d, dst_ids, s, src_ids)
            return
        index = torch.tensor(dst_ids, device=dst.device)
        pinned = []
        for s_view, s_tensor, d_tensor in zip(byte_views(src), src.tensors, dst.tensors):
            shape = list(s_tensor.shape)
            shape[2] = len(src_ids)
            pinned.append(torch.empty(shape, dtype=s_tensor.dtype, pin_memory=True))
            copy_runs(pinned[-1].view(torch.uint8).numpy(), list(range(len(src_ids))), s_view, src_ids)
            d_tensor[:, :, index] = pinned[-1].to(dst.device, non_blocking=True)
        # `pinned` is freed when this returns: the DMA must have read it by then
        torch.cuda.current_stream().synchronize()

    def shutdown(self) -> None:
        self._worker.shutdown(wait=True)
