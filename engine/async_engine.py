"""One `LLMEngine` stepping on its own thread while asyncio callers submit and stream.

The engine is single-threaded by design; this module is the only bridge. Callers' commands
(add, abort) go through a queue that the engine thread drains before every step, so an abort
frees a request's blocks within one step. Outputs return to each caller's asyncio queue through
`call_soon_threadsafe`. A failed step fails the requests in flight, frees their blocks, and the
loop keeps serving new requests.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import torch

from cuttle.engine.llm_engine import LLMEngine
from cuttle.engine.outputs import RequestOutput
from cuttle.engine.sampling_params import SamplingParams

log = logging.getLogger("cuttle.engine")


class QueueFullError(RuntimeError):
    """Admission refused: too many requests in flight."""


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_pending: int = 512):
        self.engine = engine
        self.max_pending = max_pending
        self._cmds: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats_snapshot: dict[str, Any] = engine.stats()
        self._lock = threading.Lock()

    # ---- lifecycle -------------------------------------------------------------------------
    @classmethod
    def launch(cls, build: Callable[[], LLMEngine], max_pending: int = 512) -> "AsyncEngine":
        """Build the engine on the thread that will step it, start stepping, and return once it
        is ready (re-raising what `build` raised). The server uses this rather than handing over
        an engine built on the main thread: every thread that runs OpenMP work gets its own
        libgomp team, and with two teams on a 2-core machine libgomp switches to short spinning
        and its workers sleep between the kernels of a step (measured: a batch-1 decode step
        ~50 ms on the loading thread, 73-109 ms on a second one)."""
        box: dict[str, Any] = {}
        ready = threading.Event()

        def run() -> None:
            try:
                box["self"] = aeng = cls(build(), max_pending)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e
                ready.set()
                return
            ready.set()
            aeng._loop()

        thread = threading.Thread(target=run, name="cuttle-engine", daemon=True)
        thread.start()
        ready.wait()
        if "error" in box:
            raise box["error"]
        aeng = box["self"]
        aeng._thread = thread
        return aeng

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="cuttle-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop after aborting everything in flight (graceful drain is the server's job)."""
        self._stop.set()
        self._cmds.put(lambda: None)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def pause(self) -> None:
        """Stop stepping (commands such as aborts and weight updates still run); requests wait."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()
        self._cmds.put(lambda: None)  # wake the loop

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- the API ---------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yields a RequestOutput per step with progress, the last one `finished`. Leaving the
        iterator early (client gone) aborts the request."""
        if self._thread is None:
            raise EngineDeadError("engine loop is not running")
        with self._lock:
            if len(self._streams) >= self.max_pending:
                raise QueueFullError(f"{len(self._streams)} requests in flight (limit {self.max_pending})")
            loop = asyncio.get_running_loop()
            stream: asyncio.Queue = asyncio.Queue()
            self._streams[request_id] = (loop, stream)
        try:
            await self._call(lambda: self.engine.add_request(request_id, prompt, params, stream=True, cache_salt=cache_salt))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._cmds.put(lambda: self.engine.abort_request(request_id))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between steps (stats, weight updates, cache resets)."""
        return await self._call(fn)

    async def _call(self, fn: Callable[[], Any]) -> Any:
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

        self._cmds.put(run)
        return await asyncio.wrap_future(fut)

    # ---- the engine thread -----------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            idle = self._paused.is_set() or not engine.has_unfinished_requests()
            try:  # block for work only when there is nothing to step
                cmd = self._cmds.get(timeout=0.5) if idle else self._cmds.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                cmd()
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._paused.is_set() or not engine.has_unfinished_requests():
                self.stats_snapshot = engine.stats()
                continue
            self._step_and_deliver()
            self.stats_snapshot = engine.stats()
        for rid in list(engine.requests):
            engine.abort_request(rid)
            self._deliver(rid, EngineDeadError("engine shut down"))

    def _step_and_deliver(self) -> bool:
        """One engine step, outputs routed to their callers. A failed step fails the requests in
        flight (their blocks are freed) and returns False; the engine itself keeps serving."""
        engine = self.engine
        try:
            outputs = engine.step()
        except Exception as e:  # noqa: BLE001 - one bad step must not take the server down
            log.exception("engine step failed; failing the requests in flight")
            for rid in list(engine.requests):
                engine.abort_request(rid)
                self._deliver(rid, RuntimeError(f"engine step failed: {e}"))
            return False
        for out in outputs:
            self._deliver(out.request_id, out)
        return True

    def _deliver(self, request_id: str, item: Any) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            try:
                loop.call_soon_threadsafe(stream.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed
                pass

    # ---- weight sync (RL) ------------------------------------------------------------------
    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], in_flight: str = "abort") -> int:
        """Pause, load new weights, resume; returns the new weight version.

        Runs on the engine thread between steps, so no step ever sees half-updated weights.
        `in_flight="abort"`: unfinished requests end now with finish_reason "abort" (their callers
        get that final output). `in_flight="finish"`: they are stepped to completion under the old
        weights first and streamed as usual. Requests submitted meanwhile wait in the command
        queue and start under the new version.
        """
        if in_flight not in ("abort", "finish"):
            raise ValueError(f"in_flight must be 'abort' or 'finish', got {in_flight!r}")
        if self._thread is None:
            raise EngineDeadError("engine loop is not running")

        def run() -> int:
            if in_flight == "finish":
                self._drain()
            for out in self.engine.update_weights(named_tensors, "abort"):
                self._deliver(out.request_id, out)
            self.stats_snapshot = self.engine.stats()
            return self.engine.weight_version

        return await self._call(run)

    def _drain(self) -> None:
        """Engine thread only: step until every request in flight has finished, delivering outputs."""
        engine = self.engine
        while engine.has_unfinished_requests():
            if not self._step_and_deliver():
                return
