"""Sleep mode (vLLM's `LLM.sleep` / `wake_up` / `is_sleeping`): an idle engine hands back its KV
pool's memory, and on an accelerator its weights' too, while a colocated trainer runs, and takes
them back when woken.

Owns what each level frees and how waking restores it; the engine (llm_engine.py) decides when
(only while nothing runs and no session holds KV) and refuses requests while asleep.

- Level 1: the KV pool (the device pool's K/V and its companions: NSA compressed entries, top-k
  summaries) is freed, its content discarded, so the prefix cache and cached documents are
  forgotten in every tier (the host tier keeps its memory). The weights are kept: on CPU they
  already live in host memory, so nothing moves; on an accelerator each parameter and buffer is
  copied to host memory and its device memory freed, then copied back, bit for bit, on waking.
- Level 2 (vLLM's: the weights discarded too, for a trainer that will send them all again): as
  level 1, and every parameter and buffer of the model is given back, packed copies included
  (packed experts are unpacked first, so each layer is held in its plain form, whose shapes the
  loader writes). Each keeps its shape over a one-element stand-in (`expand`: reads see zeros,
  writes fail), so nothing that holds a Parameter object is rebuilt. Waking the weights gives
  each one fresh zeroed memory, which only `update_weights` fills: until every weight has been
  written (loader.WeightCoverage, counted across calls) the engine refuses requests, so a partial
  sync can never be sampled from. What is not a base weight (RoPE tables, LoRA
  adapters) is kept. (An engine with a draft model cannot sleep at all: its pool would stay
  awake, so enable_sleep_mode is refused there.)

The pool is freed by shrinking its storage to zero bytes: every view of it (the per-layer K/V,
the companions' views the attention backends hold) stays the same tensor object and sees the new
memory after waking, so nothing that holds a view is rebuilt. Raw addresses are another matter:
kernel graphs record them, so the runner's graphs are cleared on both sides. Freed host memory
goes back to the OS (`malloc_trim`: the engine keeps large blocks in glibc's heap,
llm_engine.keep_large_allocations_in_heap, where a plain free would keep it resident).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from cuttle.attention.native import hugepages

SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")


class EngineAsleepError(RuntimeError):
    """A request (or session, or weight update) reached an engine that is asleep: the server's 503."""


@dataclass
class Slept:
    """What a sleeping engine has given back (and so what waking must restore)."""

    kv: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (tensor, its storage bytes)
    weights: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = field(default_factory=list)  # (storage, its host copy)
    discarded: list[Discarded] = field(default_factory=list)  # level 2: the weights given back, values and all

    @property
    def asleep(self) -> bool:
        return bool(self.kv or self.weights or self.discarded)


@dataclass
class Discarded:
    """One model tensor given back by `discard_weights`: where it goes back, and its form."""

    module: torch.nn.Module
    name: str
    parameter: bool  # a Parameter (its `.data` is swapped, the object kept) or a buffer
    shape: torch.Size
    dtype: torch.dtype


def free_storage(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """Shrink each tensor's storage to nothing; returns what `restore_storage` needs."""
    out = []
    for t in tensors:
        s = t.untyped_storage()
        out.append((t, s.nbytes()))
        s.resize_(0)
    release_host_memory()
    return out


def restore_storage(freed: list[tuple[torch.Tensor, int]]) -> None:
    """Give each tensor its storage back, zeroed (a fresh pool, as at start-up)."""
    for t, nbytes in freed:
        t.untyped_storage().resize_(nbytes)
        t.zero_()


def offload_weights(module: torch.nn.Module) -> list[tuple[torch.UntypedStorage, torch.UntypedStorage]]:
    """Copy the storage under every parameter and buffer of `module` to host memory, whole, and
    free it: each storage once, however many tensors view it (a tied weight, slices of one fused
    buffer), so every view sees its own bytes again after `restore_weights`."""
    seen: set[int] = set()
    out = []
    for t in [*module.parameters(), *module.buffers()]:
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        host = torch.UntypedStorage(st.nbytes(), device="cpu")
        host.copy_(st)
        out.append((st, host))
        st.resize_(0)
    release_host_memory()
    return out


def restore_weights(offloaded: list[tuple[torch.UntypedStorage, torch.UntypedStorage]]) -> None:
    """Copy each offloaded storage back into its own (re-grown) memory."""
    for st, host in offloaded:
        st.resize_(host.nbytes())
        st.copy_(host)


def discard_weights(module: torch.nn.Module) -> list[Discarded]:
    """Give back every parameter's and buffer's memory (each tensor once, however many names hold
    it), leaving a stand-in of the same shape and dtype; the caller has dropped derived copies."""
    out: list[Discarded] = []
    seen: set[int] = set()
    with torch.no_grad():
        for mod in module.modules():
            for slots, parameter in ((mod._parameters, True), (mod._buffers, False)):
                for name, t in list(slots.items()):
                    if t is None:
                        continue
                    stand_in = torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape)
                    if parameter:
                        if id(t) in seen:  # a tied Parameter: its object is shared, swapped once
                            continue
                        seen.add(id(t))
                        out.append(Discarded(mod, name, True, t.shape, t.dtype))
                        t.data = stand_in
                    else:
                        out.append(Discarded(mod, name, False, t.shape, t.dtype))
                        slots[name] = stand_in
    release_host_memory()
    return out


def regrow_weights(discarded: list[Discarded], device: torch.device) -> None:
    """Fresh zeroed memory for every discarded tensor (large CPU ones in huge pages, where they
    would be moved anyway); the values come from update_weights."""
    with torch.no_grad():
        for d in discarded:
            fresh = hugepages.empty(d.shape, d.dtype) if device.type == "cpu" else torch.empty(d.shape, dtype=d.dtype, device=device)
            fresh.zero_()
            if d.parameter:
                d.module._parameters[d.name].data = fresh
            else:
                d.module._buffers[d.name] = fresh


def release_host_memory() -> None:
    """Return freed memory to the OS / the driver: glibc's heap (malloc_trim; a no-op elsewhere),
    and CUDA's caching allocator's unused blocks (otherwise still reserved by this process, where a
    colocated trainer in another process cannot have them)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
