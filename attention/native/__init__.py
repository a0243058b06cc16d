"""cuttle's CPU kernel library: the native kernels that are not attention-specific (GEMMs,
norms, RoPE, SiLU, argmax) and the one build of the C library all native kernels live in.

Modules: `build` (compile `attention/csrc/*.c` with the host cc, load with ctypes), `gemm`
(linear layers: packed bf16 GEMM, small-row streaming kernel), `fused` (RMSNorm, residual add +
RMSNorm, q/k norm + RoPE, silu * up), `rows` (gather / scatter rows: embedding, RoPE tables, K/V
writes; bf16 -> fp32), `argmax` (the sampler's greedy pick). Each kernel has the torch code it is
tested against as its fallback. `graph` records a step's kernel calls and replays them.

This package owns the choice of kernels: `kernels()` returns the `KernelSet` selected once per
process (library present? packed GEMM on? which summation order matches torch?), logged in one
line when it is made (at model load: the runner's prepack is the first caller); the kernels
consult it on every call instead of re-reading the environment. It imports only torch and
`cuttle.attention.rope`: the engine, the attention backends and `cuttle.moe` may all use it.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass

import torch

from cuttle.attention.native import build

logger = logging.getLogger(__name__)

# Block-table flag of a host-pool block (read in place; csrc/host_pool.h): block ids of either pool
# stay below it. Defined here so that the kernels' bindings need nothing outside this package;
# `cuttle.attention.metadata` re-exports it.
HOST_BLOCK = 1 << 30


@dataclass(frozen=True, slots=True)
class KernelSet:
    """What the kernels of this process run on; chosen once by `select`."""

    lib: ctypes.CDLL | None  # the native library; None: every op takes its torch path
    packed_gemm: bool  # bf16 linear layers take the packed GEMM (library built with AVX512-BF16, CUTTLE_PACKED_GEMM != "0")
    vec_lanes: int  # fp32 lanes of torch's vectorized elementwise loops (silu's scalar tails follow them)
    sum_lanes: int  # lanes of torch's sum kernel: the order of RMSNorm's sum of squares
    norms_exact: bool  # that order was found, so the fused norms are bit-identical to torch's
    moe_experts: bool = False  # routed experts take csrc/moe_experts.c (library loaded, CUTTLE_MOE_NATIVE != "0")
    # bf16 linear layers take csrc/w16_gemm.c: a CPU without AVX512-BF16, library built with AVX2 + FMA,
    # CUTTLE_PACKED_GEMM != "0" (the one switch for the native bf16 GEMMs)
    w16_gemm: bool = False
    describe: str = ""  # the logged line


_current: KernelSet | None = None
_select_lock = threading.Lock()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def select() -> KernelSet:
    """Choose the kernels from the library and the environment, make it the process's set, and
    log it (one line). `kernels()` runs it once; call it again only to re-read a changed
    environment (tests)."""
    with _select_lock:
        return _select()


# (thread, kernel set) while `graph.capture` records that thread's kernel calls, else None
_recording: tuple[int, KernelSet] | None = None


def _set_recording(thread: int | None, ks: KernelSet | None) -> None:
    global _recording
    _recording = (thread, ks) if thread is not None and ks is not None else None


def kernels() -> KernelSet:
    """The process's kernel set (selected on first use); inside a kernel-graph capture, on the
    capturing thread, the same set with a recording library (`graph.capture`)."""
    rec = _recording
    if rec is not None and rec[0] == threading.get_ident():
        return rec[1]
    return unrecorded()


def unrecorded() -> KernelSet:
    """The process's kernel set, never the recording one: for work done once and cached past the
    call (a weight's packed copy), which a kernel graph captured around that first call must not
    redo on every replay."""
    ks = _current
    if ks is None:
        with _select_lock:
            ks = _current if _current is not None else _select()
    return ks


def _select() -> KernelSet:
    global _current
    lib = build.load()
    env_off = os.environ.get("CUTTLE_PACKED_GEMM", "1") == "0"
    moe_native = lib is not None and os.environ.get("CUTTLE_MOE_NATIVE", "1") != "0"
    has_bf16_dot = lib is not None and bool(lib.packed_gemm_available())
    packed = has_bf16_dot and not env_off
    w16 = lib is not None and not has_bf16_dot and not env_off and bool(lib.w16_gemm_available())
    torch_isa = torch.backends.cpu.get_cpu_capability()
    vec_lanes = 16 if torch_isa == "AVX512" else 8
    sum_lanes, exact = 8, False
    if lib is not None:
        from cuttle.attention.native.fused import probe_sum_lanes  # fused imports this package: import here

        found = probe_sum_lanes(lib)
        sum_lanes, exact = (found, True) if found is not None else (8, False)
    flags = _cpu_flags()
    isa = "+".join(n for n, f in (("AVX512-BF16", "avx512_bf16"), ("AMX", "amx_bf16")) if f in flags) or "no AVX512-BF16/AMX"
    if lib is None:
        off = "CUTTLE_CPU_KERNELS=0" if os.environ.get("CUTTLE_CPU_KERNELS", "1") == "0" else "library unavailable"
        what = f"torch only ({off})"
    else:
        if packed:
            gemm = "bf16 packed GEMM, fp32 <= 4 rows streaming"
        elif w16:
            gemm = "bf16 AVX2 widening GEMM (no AVX512-BF16), fp32 <= 4 rows streaming"
        else:
            off = "CUTTLE_PACKED_GEMM=0" if env_off else "no AVX512-BF16 or AVX2+FMA"
            gemm = f"<= 4 rows streaming, else torch (native bf16 GEMM off: {off})"
        norms = f"bit-exact (sum lanes {sum_lanes})" if exact else "within an ulp of torch"
        moe = "native" if moe_native else "torch (CUTTLE_MOE_NATIVE=0)"
        what = f"native; linear: {gemm}; fused norms: {norms}; argmax: native; moe experts: {moe}"
    describe = f"CPU kernels: {what} [CPU {isa}, torch {torch_isa}]"
    _current = KernelSet(lib, packed, vec_lanes, sum_lanes, exact, moe_native, w16_gemm=w16, describe=describe)
    logger.info("%s", describe)
    return _current


def available() -> bool:
    """Whether the native library is loaded in this process's kernel set."""
    return kernels().lib is not None


def supports_rows(q: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the native attention kernels (dense, NSA, top-k) take these tensors: CPU tensors
    in fp32/bf16 with dense head rows and contiguous caches."""
    codes = build.DTYPE_CODE
    return (
        q.device.type == "cpu" and k_cache.device.type == "cpu"
        and q.dtype in codes and k_cache.dtype in codes and out.dtype in codes
        and q.stride(-1) == 1 and q.stride(-2) == q.shape[-1] and out.is_contiguous() and k_cache.is_contiguous()
    )
