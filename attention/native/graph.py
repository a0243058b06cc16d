"""Kernel graphs: a step recorded as the sequence of its native kernel calls, replayed without Python.

Why: a batch-1 decode step is ~75 (MoE preset) to ~255 (0.6B dense) native calls, and the Python
around them -- module calls, wrapper checks, output allocation, ctypes argument conversion --
took 2-10 ms of a 9-58 ms step here. Replaying the recorded calls with their arguments converted
once leaves only the kernels and one ctypes call each. This is the CPU counterpart of a CUDA
graph, with the same contract: the replay reads its inputs from, and writes its outputs to, the
very tensors the capture used, so the caller keeps those tensors and refills the inputs in place.

`capture()` runs a piece of code for real while recording, in this thread, every call made
through `kernels().lib`, and refuses (`GraphBreak`) anything a replay would not reproduce:

- a torch op that computes (its work would not be replayed): inside a capture only allocation
  and views may run, checked by a dispatch mode on every aten op (an op must not write any of its
  arguments, and each of its tensor outputs must share storage with an input), and no tensor may
  be made from Python data (`torch.tensor`) or read back into Python (`.item()`);
- a call whose pointer arguments are not all inside tensors the capture handed to some kernel:
  the graph holds a reference to every tensor whose `data_ptr()` was taken during the capture, so
  no address it recorded is freed or reused while it lives.

A replay calls the recorded functions in order and checks each one returns what it returned at
capture (from C, `csrc/graph_replay.c`, one ctypes call for the whole graph, on x86-64 Linux
when every recorded signature fits; else from Python, one ctypes call per kernel); on any
difference it stops and answers False (a kernel refused its input, e.g. an index out of range,
or failed an allocation), and the caller runs the step eagerly, which raises or
takes the other path as usual. A wrapper whose kernel may legitimately answer otherwise registers
a handler for that call (`on_result`): the MoE router's kernel reports near-tied rows, which the
torch router then settles on the graph's own tensors, and the replay goes on. What no check here can see
is a Python scalar that should differ per step but was passed by value at capture; the kernels a
graph runs take none (a decode step's lengths and slots are read from tensors), and the engine
(`cuttle.engine.step_graphs`) compares each new graph's first replay with the eager step bit for
bit before trusting it.
"""
from __future__ import annotations

import bisect
import ctypes
import struct
import threading
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from cuttle.attention import native

__all__ = ["GraphBreak", "KernelGraph", "capture", "on_result", "settle_at_capture"]

_aten = torch.ops.aten
# allocation: the buffers the kernels write (uninitialized, so nothing is computed)
_ALLOCATING = {_aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default}
# ops that alias an input but bring Python data in, or read tensor data out into Python
_REFUSED = {_aten.lift_fresh.default, _aten.lift_fresh_copy.default, _aten._local_scalar_dense.default}


class GraphBreak(RuntimeError):
    """The captured code did something a replay would not reproduce (the message says what)."""


class _ReplayCall(ctypes.Structure):
    """One recorded call as csrc/graph_replay.c runs it (`replay_call` there)."""

    _fields_ = [("fn", ctypes.c_void_p), ("ret", ctypes.c_int32), ("pad", ctypes.c_int32), ("expect", ctypes.c_int64),
                ("ints", ctypes.c_int64 * 32), ("floats", ctypes.c_uint64 * 8)]


# Whether replays may run from C (graph_replay.c); tests and A/B timing turn it off to compare.
C_REPLAY = True

# argument and result types the C replay passes (graph_replay.c: integer-class values and floats)
_INT_ARGS = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int64)
_RESULTS = {None: 0, ctypes.c_int: 1, ctypes.c_int64: 2}


def _c_calls(calls: list[tuple[Any, tuple[Any, ...], Any]]) -> ctypes.Array | None:
    """The calls as graph_replay.c's array, or None when one of them does not fit it."""
    out = (_ReplayCall * len(calls))()
    for c, (fn, args, result) in zip(out, calls):
        ret = _RESULTS.get(fn.restype, -1)
        if ret < 0:
            return None
        ints: list[int] = []
        floats: list[int] = []
        for t, a in zip(fn.argtypes, args):
            if t is ctypes.c_float:
                floats.append(int.from_bytes(struct.pack("<f", a.value), "little"))
            elif t in _INT_ARGS:
                ints.append(0 if a is None else a.value or 0)  # a NULL pointer's value is None
            else:
                return None
        if len(ints) > len(c.ints) or len(floats) > len(c.floats):
            return None
        c.fn = ctypes.cast(fn, ctypes.c_void_p).value
        c.ret, c.expect = ret, 0 if result is None else int(result)
        c.ints[: len(ints)] = ints
        c.floats[: len(floats)] = floats
    return out


class KernelGraph:
    """The native calls of one captured run, with everything they point at kept alive."""

    def __init__(self) -> None:
        self._calls: list[tuple[Any, tuple[Any, ...], Any]] = []  # (function, converted arguments, result)
        self._keep: list[torch.Tensor] = []  # every tensor whose address went into a call
        self._pointers: list[tuple[str, int, int]] = []  # (kernel, argument, address), checked once captured
        self.names: list[str] = []  # the kernels, in call order
        self._handlers: dict[int, Callable[[Any], bool]] = {}  # call index -> what settles another result
        # the calls as graph_replay.c's array, made at the first replay for the list it was made from
        self._c: tuple[list, ctypes.Array | None] | None = None

    def __len__(self) -> int:
        return len(self._calls)

    @property
    def replays_in_c(self) -> bool:
        """Whether `replay` runs the calls from C (graph_replay.c) rather than one ctypes call each."""
        return self._c_array() is not None

    def _c_array(self) -> ctypes.Array | None:
        if not C_REPLAY:
            return None
        if self._c is None or self._c[0] is not self._calls:
            lib = native.unrecorded().lib
            ok = lib is not None and bool(lib.graph_replay_available()) and bool(self._calls)
            self._c = (self._calls, _c_calls(self._calls) if ok else None)
        return self._c[1]

    def replay(self) -> bool:
        """Run the recorded calls in order; False as soon as one returns other than at capture
        (the rest are not run: the caller reruns the step eagerly)."""
        calls = self._c_array()
        if calls is not None:
            run, n, got = native.unrecorded().lib.graph_replay, len(self._calls), ctypes.c_int64()
            i = run(calls, 0, n, ctypes.byref(got))
            while i < n:  # call i answered otherwise: its handler may settle it and go on
                handler = self._handlers.get(i)
                if handler is None or not handler(got.value):
                    return False
                i = run(calls, i + 1, n, ctypes.byref(got))
            return True
        for i, (fn, args, result) in enumerate(self._calls):
            r = fn(*args)
            if r != result:
                handler = self._handlers.get(i)
                if handler is None or not handler(r):
                    return False
        return True

    def _record(self, fn: Any, name: str, args: tuple[Any, ...], result: Any) -> None:
        argtypes = fn.argtypes
        if argtypes is None or len(argtypes) != len(args):
            raise GraphBreak(f"{name}: its C signature is not declared, so its arguments cannot be recorded")
        converted = []
        for i, (t, a) in enumerate(zip(argtypes, args)):
            if a is None:
                converted.append(None)
                continue
            if t is ctypes.c_void_p or (isinstance(t, type) and issubclass(t, ctypes._Pointer)):
                self._pointers.append((name, i, int(a)))
            converted.append(t(a))
        self._calls.append((fn, tuple(converted), result))
        self.names.append(name)

    def _check_pointers(self) -> None:
        """Every recorded address must lie inside a tensor the graph keeps."""
        spans = sorted(
            {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in self._keep}
        )
        starts = [s for s, _ in spans]
        for name, i, p in self._pointers:
            j = bisect.bisect_right(starts, p) - 1
            # the largest span starting at or before p may not be the one holding it: scan back
            while j >= 0 and not (spans[j][0] <= p < spans[j][0] + max(spans[j][1], 1)):
                j -= 1
            if j < 0:
                raise GraphBreak(f"{name}: argument {i} points at memory no tensor of the capture holds")


class _RecordedFn:
    __slots__ = ("_fn", "_name", "_graph")

    def __init__(self, fn: Any, name: str, graph: KernelGraph) -> None:
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_graph", graph)

    def __call__(self, *args: Any) -> Any:
        result = self._fn(*args)
        self._graph._record(self._fn, self._name, args, result)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)

    def __setattr__(self, name: str, value: Any) -> None:  # argtypes / restype declared through the proxy
        setattr(self._fn, name, value)


class _RecordingLib:
    """The kernel library as seen inside a capture: every function call is recorded."""

    def __init__(self, lib: ctypes.CDLL, graph: KernelGraph) -> None:
        self._lib, self._graph = lib, graph

    def __getattr__(self, name: str) -> _RecordedFn:
        return _RecordedFn(getattr(self._lib, name), name, self._graph)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


class _Guard(TorchDispatchMode):
    """Lets allocation and views through; any other torch op breaks the capture."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _ALLOCATING:
            return func(*args, **kwargs)
        if func in _REFUSED or any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
            raise GraphBreak(f"torch op {func} inside a kernel-graph capture (it would not be replayed)")
        out = func(*args, **kwargs)
        outs = _tensors(out)
        storages = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        if not outs or any(t.untyped_storage().data_ptr() not in storages for t in outs):
            raise GraphBreak(f"torch op {func} computes inside a kernel-graph capture (it would not be replayed)")
        return out


_capture_lock = threading.Lock()
_active: tuple[int, KernelGraph] | None = None  # (thread, graph) of the capture in progress


def on_result(handler: Callable[[Any], bool]) -> None:
    """Inside a capture, on its thread: when a replay sees the kernel call just recorded return
    something other than it did at capture, it calls `handler(result)` instead of stopping; the
    handler settles that case on the graph's own tensors (torch ops are fine there: a replay runs
    no guard) and answers whether the replay may go on. Outside a capture it does nothing."""
    active = _active
    if active is None or active[0] != threading.get_ident():
        return
    graph = active[1]
    if not graph._calls:
        raise RuntimeError("on_result: no kernel call has been recorded yet")
    graph._handlers[len(graph._calls) - 1] = handler


def settle_at_capture(fix: Callable[[], None], result: Any) -> bool:
    """Inside a capture, on its thread: run `fix()` unguarded (its torch ops compute, and are not
    recorded) and count the kernel call just recorded as having returned `result`. For a call with
    an `on_result` handler whose capture-time result needs settling: the capture settles its own
    case with `fix`, and every replay whose call returns other than `result` runs the handler (the
    MoE router: a capture that met a near-tie settles it now and records "no tie", so a replay
    with ties settles them, one without goes on). Returns False, doing nothing, outside a capture."""
    active = _active
    if active is None or active[0] != threading.get_ident():
        return False
    graph = active[1]
    if not graph._calls:
        raise RuntimeError("settle_at_capture: no kernel call has been recorded yet")
    with _disable_current_modes():  # the capture's _Guard
        fix()
    fn, args, _ = graph._calls[-1]
    graph._calls[-1] = (fn, args, result)
    return True


@contextmanager
def capture() -> Iterator[KernelGraph]:
    """Run the body for real while recording its native calls into the yielded graph (this thread
    only; one capture at a time). Raises `GraphBreak` (from the body, or on exit) when the body
    cannot be replayed; the body's effects up to then have happened as in an eager run."""
    ks = native.kernels()
    if ks.lib is None:
        raise GraphBreak("the native kernel library is not loaded")
    graph = KernelGraph()
    keep = graph._keep
    real_data_ptr: Callable[[torch.Tensor], int] = torch.Tensor.data_ptr
    me = threading.get_ident()

    def data_ptr(t: torch.Tensor) -> int:
        if threading.get_ident() == me:
            keep.append(t)
        return real_data_ptr(t)

    global _active
    with _capture_lock:
        torch.Tensor.data_ptr = data_ptr  # type: ignore[method-assign]
        native._set_recording(me, replace(ks, lib=_RecordingLib(ks.lib, graph)))  # type: ignore[arg-type]
        _active = (me, graph)
        try:
            with _Guard():
                yield graph
        finally:
            _active = None
            native._set_recording(None, None)
            torch.Tensor.data_ptr = real_data_ptr  # type: ignore[method-assign]
    graph._check_pointers()
    graph._pointers.clear()
