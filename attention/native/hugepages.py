"""Host memory for the weights the CPU kernels stream: large tensors in transparent huge pages.

Owns where a big CPU weight lives, nothing about its values. At batch-1 decode every step reads
every weight once from memory; with 4 KiB pages each 4 KiB of a stream costs a TLB miss and a
page walk, and the hardware prefetchers stop at page boundaries. On Linux a private anonymous
mapping advised with MADV_HUGEPAGE is backed by 2 MiB pages when the kernel allows it
(/sys/kernel/mm/transparent_hugepage/enabled set to `madvise` or `always`); torch's CPU allocator
(glibc malloc) does not ask for that. Measured on a 2-core AVX2 EPYC (madvise mode): the
[151936, 512] bf16 lm_head at one row 4.62 -> 4.40 ms through `gemm.linear`, one MoE-small layer's
experts from memory ~97 -> ~91 us (C harness).

`empty` allocates such a tensor (an mmap that the tensor keeps alive; freed with it), `backed`
moves an existing tensor's values into one (a copy, bit for bit), `back_module` does that for a
module's parameters and buffers in place (`param.data` is swapped, so ties between names and the
Parameter objects are kept). Tensors under `MIN_BYTES`, non-CPU tensors, machines without THP and
`CUTTLE_HUGEPAGES=0` keep plain torch memory: this is only ever a speed choice.
"""
from __future__ import annotations

import mmap
import os
import sys
import weakref

import torch
from torch import nn

MIN_BYTES = 2 << 20  # one huge page: below it there is nothing to gain
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"

# data_ptr -> (byte length, the mapping): which storages are ours, so moving is idempotent. A
# dead weakref means the tensor was freed (its address may be reused by anything).
_ours: dict[int, tuple[int, weakref.ref]] = {}


def available() -> bool:
    """Whether `empty` hands out THP-advised memory here (Linux, THP not `never`, not switched off)."""
    if os.environ.get("CUTTLE_HUGEPAGES", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def empty(shape: tuple[int, ...] | torch.Size | int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor; in MADV_HUGEPAGE memory when it is at least
    MIN_BYTES and `available()`, else plain `torch.empty`."""
    size = torch.Size([shape] if isinstance(shape, int) else shape)
    nbytes = size.numel() * torch.empty((), dtype=dtype).element_size()
    if nbytes < MIN_BYTES or not available():
        return torch.empty(size, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)  # before the first touch, so the pages come as huge pages
    t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(size)  # holds `buf`
    _ours[t.data_ptr()] = (nbytes, weakref.ref(buf))
    return t


def is_backed(t: torch.Tensor) -> bool:
    """Whether t's storage is one `empty` allocated (and still alive)."""
    if t.device.type != "cpu":
        return False
    entry = _ours.get(t.untyped_storage().data_ptr())
    if entry is None:
        return False
    if entry[1]() is None:
        del _ours[t.untyped_storage().data_ptr()]
        return False
    return True


def backed(t: torch.Tensor) -> torch.Tensor:
    """t itself when it stays where it is (small, not CPU, already ours, THP unavailable, or a view
    of a larger storage); else a contiguous copy in MADV_HUGEPAGE memory, equal bit for bit."""
    if (t.device.type != "cpu" or t.untyped_storage().nbytes() < MIN_BYTES or not available() or is_backed(t)
            or not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
        return t
    out = empty(t.shape, t.dtype)
    out.copy_(t)
    return out


def back_module(module: nn.Module) -> int:
    """Move module's large CPU parameters and buffers into huge-page memory in place (values,
    dtypes, Parameter objects and ties unchanged); returns the bytes moved."""
    moved = 0
    done: dict[int, torch.Tensor] = {}  # id of a buffer already moved -> its new tensor (shared buffers)
    with torch.no_grad():
        for mod in module.modules():
            for name, p in mod._parameters.items():
                if p is None or id(p) in done:
                    continue
                done[id(p)] = p
                old = p.data  # a new alias object on every access: compare with this one
                new = backed(old)
                if new is not old:
                    moved += new.numel() * new.element_size()
                    p.data = new  # every name holding this Parameter sees the new storage
            for name, b in list(mod._buffers.items()):
                if b is None:
                    continue
                if id(b) not in done:
                    new = backed(b)
                    if new is not b:
                        moved += new.numel() * new.element_size()
                    done[id(b)] = new
                mod._buffers[name] = done[id(b)]
    return moved
