"""One `LLMEngine` stepping on its own thread while asyncio callers submit and stream.

The engine is single-threaded by design; this module is the only bridge. Callers' commands
(add, calls) go through a queue that the engine thread drains before every step; aborts go
through their own queue, drained before every step too, including the steps of a weight update
that finishes the requests in flight, so an abort frees a request's blocks within one step.
Outputs return to each caller's asyncio queue through `call_soon_threadsafe`. A caller that
leaves (the iterator closed or its task cancelled, even while its request is being added)
aborts its request; one that reads to the final output queues nothing. A failed step fails the
requests in flight, frees their blocks, and the loop keeps serving new requests; a request the
engine failed alone (its `RequestOutput.error`) raises `RequestFailedError` in its caller only.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from cuttle.engine.llm_engine import LLMEngine
from cuttle.engine.lora import LoRARequest
from cuttle.engine.outputs import RequestOutput
from cuttle.engine.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger("cuttle.engine")

# how often a stalled loop (requests waiting on blocks that sessions pin) re-tries a step when no
# command arrives: it used to step flat out, a core busy for nothing beside the agents' tools
STALL_POLL_S = 0.05
GRAMMAR_WORKERS = 2  # grammar compiles run side by side (each is one thread inside xgrammar)


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """What a request carries besides its prompt and sampling params, as `LLMEngine.add_request`
    takes it: the cache salt, the priority and the LoRA adapter (engine/lora.py)."""

    cache_salt: str | None = None
    priority: int = 0
    lora_request: LoRARequest | str | None = None


class QueueFullError(RuntimeError):
    """Admission refused: too many requests in flight."""


class EngineDeadError(RuntimeError):
    pass


class RequestFailedError(RuntimeError):
    """The engine ended this one request because processing it raised (the batch went on)."""


class RequestStream:
    """The outputs of one admitted request (`AsyncEngine.add`), as an async iterator.

    Ends after the final output, which it hands out having already let go of the request, so a
    caller that stops there aborts nothing. Closing it earlier, a cancelled read, or dropping it
    aborts the request (the engine frees its KV before its next step).
    """

    __slots__ = ("_owner", "request_id", "_queue", "_done")

    def __init__(self, owner: AsyncEngine, request_id: str, queue_: asyncio.Queue):
        self._owner, self.request_id, self._queue, self._done = owner, request_id, queue_, False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled: the caller is gone
            self.close()
            raise
        if isinstance(item, BaseException):  # a failed step, or shutdown: the engine already ended it
            self._release()
            raise item
        if item.finished:
            self._release()
            if item.error is not None:
                raise RequestFailedError(item.error)
        return item

    def close(self) -> None:
        """Abort the request unless it has finished (idempotent)."""
        if not self._done:
            self._release()
            self._owner.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()

    def _release(self) -> None:
        self._done = True
        self._owner._streams.pop(self.request_id, None)

    def __del__(self) -> None:
        if not self._done:
            self.close()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_pending: int = 512):
        self.engine = engine
        self.max_pending = max_pending
        self._cmds: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats_snapshot: dict[str, Any] = engine.stats()
        self._lock = threading.Lock()
        # the last step ran nothing while requests wait on blocks that only a command (a session
        # closed, an abort) can free: the loop then waits for commands instead of stepping flat out
        self._stalled = False
        self._closing = False  # begin_shutdown: new requests are refused
        # grammar compiles get their own workers: a few slow schemas (seconds each on a large
        # vocabulary, and xgrammar cannot be interrupted) then queue behind each other, never in
        # front of the default executor's other work (a long prompt's infilling tokenization)
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(max_workers=GRAMMAR_WORKERS, thread_name_prefix="cuttle-grammar")

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
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def begin_shutdown(self, grace: float) -> None:
        """The server's first shutdown signal: refuse new requests from now on (503) and give the
        ones in flight `grace` seconds to finish; then each still running ends with an error
        saying so (an SSE error event, or a 503), its KV freed. Without this the engine went on
        decoding for the server's whole drain and the connections were then cut mid-body."""
        self._closing = True

        def cut() -> None:
            self._cmds.put(self._end_all_for_shutdown)

        if grace <= 0:
            cut()
        else:
            timer = threading.Timer(grace, cut)
            timer.daemon = True
            timer.start()

    def _end_all_for_shutdown(self) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
            self._deliver(rid, EngineDeadError("the server is shutting down: the request was ended after the shutdown grace "
                                               "period (--shutdown-timeout)"))
        self.stats_snapshot = self.engine.stats()

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
    async def add(
        self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams, cache_salt: str | None = None,
        priority: int = 0, lora_request: LoRARequest | str | None = None,
    ) -> RequestStream:
        """Admit a request and return its stream of outputs once the engine has accepted it
        (raises what `add_request` raised, or QueueFullError). `prompt` is anything `add_request`
        takes (a dict: squid documents). Read the stream to its final output, or `aclose()` it to
        abort; a stream dropped unread aborts too. The stream carries what `params.output_kind`
        says: DELTA for a streamed response (O(L) in all), FINAL_ONLY for one output at the end."""
        # a FINAL_ONLY request is not detokenized step by step (its text is decoded once at the end)
        per_step = params.output_kind != RequestOutputKind.FINAL_ONLY
        await self._compile_grammar(params)
        return await self._admit(request_id, lambda: self.engine.add_request(request_id, prompt, params, stream=per_step,
                                                                            cache_salt=cache_salt, priority=priority,
                                                                            lora_request=lora_request))

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar on a worker thread before it is admitted: a schema can
        take 10s-100s of ms to compile (the first one also builds the vocabulary's tables), which
        on the engine thread would stall every running request's decoding. The compiled grammar
        is cached, so `add_request` finds it there; a spec that does not compile raises here
        exactly what `add_request` would."""
        if params.structured_outputs is not None:
            await asyncio.get_running_loop().run_in_executor(self._grammar_pool, self.engine.controls.compile,
                                                             params.structured_outputs)

    async def _admit(self, request_id: str, add: Callable[[], Any]) -> RequestStream:
        if self._thread is None:
            raise EngineDeadError("engine loop is not running")
        if self._closing:
            raise EngineDeadError("the server is shutting down")
        with self._lock:
            if len(self._streams) >= self.max_pending:
                raise QueueFullError(f"{len(self._streams)} requests in flight (limit {self.max_pending})")
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            loop = asyncio.get_running_loop()
            queue_: asyncio.Queue = asyncio.Queue()
            self._streams[request_id] = (loop, queue_)
        try:
            await self._call(add)
        except asyncio.CancelledError:
            # the caller left while the add was queued: it is skipped if it had not started, else
            # it runs, so abort right behind it (on the same queue: the abort queue may be drained
            # before the add runs)
            self._streams.pop(request_id, None)
            self._cmds.put(lambda: self.engine.abort_request(request_id))
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return RequestStream(self, request_id, queue_)

    # ---- agent sessions (engine/session.py), each call run on the engine thread -------------
    async def open_session(self, prompt: str | list[int]) -> str:
        return await self._call(lambda: self.engine.open_session(prompt))

    async def fork_session(self, session_id: str, n: int) -> list[str]:
        return await self._call(lambda: self.engine.fork_session(session_id, n))

    async def append_to_session(self, session_id: str, token_ids: list[int]) -> None:
        await self._call(lambda: self.engine.append_to_session(session_id, token_ids))

    async def session_token_ids(self, session_id: str) -> list[int]:
        return await self._call(lambda: self.engine.session_token_ids(session_id))

    async def close_session(self, session_id: str) -> None:
        """Release the session; a turn in flight ends with finish_reason "abort" in its stream."""
        def run() -> None:
            out = self.engine.close_session(session_id)
            if out is not None:
                self._deliver(out.request_id, out)
        await self._call(run)

    # beam search's sessions (`LLMEngine.open_beams` / `fork_beams` / `close_beams`), each one
    # command; they change the caller's lists in place on the engine thread, so a caller cancelled
    # while one ran still finds its sessions there, and its `close_beams` runs after it
    async def open_beams(self, prompts: list[list[int]], live: list[list[str]], lora_request: str | None = None) -> None:
        await self._call(lambda: self.engine.open_beams(prompts, live, lora_request))

    async def fork_beams(self, session_ids: list[str], origins: list[tuple[int, int]]) -> None:
        await self._call(lambda: self.engine.fork_beams(session_ids, origins))

    async def close_beams(self, live: list[list[str]]) -> None:
        await self._call(lambda: self.engine.close_beams(live))

    async def session_turn(self, request_id: str, session_ids: str | list[str], params: SamplingParams,
                           priority: int = 0) -> RequestStream:
        """One turn of the session(s), streamed like `add` (output `i` is `session_ids[i]`'s); the
        sampled ids join the session when the turn ends; closing the stream early aborts the turn
        and leaves the session as it was."""
        sids = [session_ids] if isinstance(session_ids, str) else list(session_ids)
        per_step = params.output_kind != RequestOutputKind.FINAL_ONLY
        await self._compile_grammar(params)
        return await self._admit(request_id, lambda: self.engine.add_session_turn(request_id, sids, params, stream=per_step,
                                                                                 priority=priority))

    async def generate(
        self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams, cache_salt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yields a RequestOutput per step with progress (per `params.output_kind`), the last one
        `finished`. Leaving the iterator early (client gone) aborts the request."""
        stream = await self.add(request_id, prompt, params, cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        self._aborts.put(request_id)
        if self._paused.is_set() or self._stalled:
            self._cmds.put(lambda: None)  # a paused or stalled loop sleeps on the command queue

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between steps (stats, weight updates, cache resets)."""
        return await self._call(fn)

    async def _call(self, fn: Callable[[], Any]) -> Any:
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            # a caller that left (timeout, disconnect) cancelled the future while this waited:
            # skip the command (an add's queued abort then finds nothing). Once running, the
            # future can no longer be cancelled, so setting its result cannot fail.
            if not fut.set_running_or_notify_cancel():
                return
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
            try:  # block for work only when there is nothing to step (or nothing a step can do)
                if idle:
                    cmd = self._cmds.get(timeout=0.5)
                elif self._stalled:  # a command wakes it at once; the timeout re-checks the pins
                    cmd = self._cmds.get(timeout=STALL_POLL_S)
                else:
                    cmd = self._cmds.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                try:
                    cmd()
                except Exception:  # noqa: BLE001 - a failed command must not end the thread every caller waits on
                    log.exception("engine command failed")
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            self._run_aborts()
            if self._paused.is_set() or not engine.has_unfinished_requests():
                self.stats_snapshot = engine.stats()
                continue
            self._step_and_deliver()
            self.stats_snapshot = engine.stats()
        for rid in list(engine.requests):
            engine.abort_request(rid)
            self._deliver(rid, EngineDeadError("engine shut down"))

    def _run_aborts(self) -> None:
        aborts = self._aborts
        while not aborts.empty():  # this thread is the only consumer
            self.engine.abort_request(aborts.get())

    def _step_and_deliver(self) -> bool:
        """One engine step, outputs routed to their callers. A failed step fails the requests in
        flight (their blocks are freed) and returns False; the engine itself keeps serving."""
        engine = self.engine
        steps = engine.counters["steps"]
        try:
            outputs = engine.step()
            self._stalled = engine.stalled(steps)
        except Exception as e:  # noqa: BLE001 - one bad step must not take the server down
            self._stalled = False
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
        return await self._between_steps(lambda: self.engine.update_weights(named_tensors, "abort"), in_flight)

    async def reload_weights(self, path: str | None = None, in_flight: str = "finish") -> int:
        """`LLMEngine.reload_weights` between two steps, the requests in flight treated as by
        `update_weights`; returns the new weight version."""
        return await self._between_steps(lambda: self.engine.reload_weights(path, "abort"), in_flight)

    async def _between_steps(self, load: Callable[[], list[RequestOutput]], in_flight: str) -> int:
        """Run a weight load on the engine thread between steps: after the requests in flight
        finish (streamed as usual) or, with "abort", delivering the aborted ones' final outputs."""
        if in_flight not in ("abort", "finish"):
            raise ValueError(f"in_flight must be 'abort' or 'finish', got {in_flight!r}")
        if self._thread is None:
            raise EngineDeadError("engine loop is not running")

        def run() -> int:
            if in_flight == "finish":
                self._drain()
            for out in load():
                self._deliver(out.request_id, out)
            self.stats_snapshot = self.engine.stats()
            return self.engine.weight_version

        return await self._call(run)

    async def update_lora(self, name: str, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any],
                          in_flight: str = "finish") -> int:
        """`LLMEngine.update_lora` between two steps (LoRA training's weight sync); returns the new
        weight version. The requests in flight finish under the adapter they started with
        ("finish"), or end now with finish_reason "abort"."""
        if self._thread is None:
            raise EngineDeadError("engine loop is not running")
        tensors = list(named_tensors)

        def run() -> int:
            for out in self.engine.update_lora(name, tensors, config, in_flight):
                self._deliver(out.request_id, out)
            self.stats_snapshot = self.engine.stats()
            return self.engine.weight_version

        return await self._call(run)

    def _drain(self) -> None:
        """Engine thread only: step until every request in flight has finished, delivering outputs.
        A request that cannot get blocks beside the session pins would keep it stepping forever,
        and the command that could close a session waits behind it: that raises instead (the
        update is refused, as LLMEngine.update_weights refuses it)."""
        engine = self.engine
        stalls = 0
        while engine.has_unfinished_requests():
            self._run_aborts()  # callers that leave during the drain still free their KV at once
            if not engine.has_unfinished_requests() or not self._step_and_deliver():
                return
            stalls = stalls + 1 if self._stalled else 0
            if stalls > 1:
                raise RuntimeError(f"{engine.stall_message()}; the weights were not updated")
