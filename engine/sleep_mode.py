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
- Level 2 (vLLM: the weights discarded, to be reloaded by the trainer) is refused: the CPU
  engine holds some weights only in derived forms (packed experts, huge-page copies) that an
  update could not rebuild from nothing.

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

SLEEP_LEVELS = (1,)
WAKE_TAGS = ("weights", "kv_cache")


class EngineAsleepError(RuntimeError):
    """A request (or session, or weight update) reached an engine that is asleep: the server's 503."""


@dataclass
class Slept:
    """What a sleeping engine has given back (and so what waking must restore)."""

    kv: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (tensor, its storage bytes)
    weights: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = field(default_factory=list)  # (storage, its host copy)

    @property
    def asleep(self) -> bool:
        return bool(self.kv or self.weights)


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
