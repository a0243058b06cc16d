"""The CPU kernel library: compile the C sources under `attention/csrc/`, load them with ctypes.

Owns the one build of the native kernels (paged decode attention, GEMMs, fused norms / RoPE /
SiLU, argmax, the sampler's token mask, ...): the host C compiler (`-O3 -march=native -fopenmp`) builds every source into one
shared library in a per-user cache keyed by the sources, the flags and the CPU, and `load`
declares the C signatures. No torch headers are involved, so a build takes about a second, and a
machine without a compiler (or with `CUTTLE_CPU_KERNELS=0`) simply gets `None` and the torch
paths. ctypes releases the GIL during a call; the kernels parallelise with the process's OpenMP
runtime (torch's libgomp, already loaded), so they share torch's threads instead of adding more.
Must never decide which kernel a call takes: that is `cuttle.attention.native.kernels()`.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

SRC_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
# the element type code every kernel takes beside a pointer (csrc/dtypes.h)
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}

_vp, _i64, _int, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# name -> (argument types, result type) of the library's functions, declared at load
# (`paged_attention_rows` is declared by its binding, `cuttle.attention.native_attention`)
SIGNATURES: dict[str, tuple[list, type | None]] = {
    "graph_replay_available": ([], _int),
    "graph_replay": ([_vp, _i64, _i64, _vp], _i64),
    "paged_decode_set_fast_path": ([_int], None),
    "paged_decode_set_row_major": ([_int], None),
    "paged_decode_set_prefetch": ([_int], None),
    "paged_decode_last_call_fast": ([], _int),
    "sparse_attend_set_prefetch": ([_int], None),
    "small_m_linear": ([_vp, _int, _i64, _vp, _int, _vp, _vp, _int, _i64, _i64, _i64], _int),
    "packed_gemm_available": ([], _int),
    "w16_gemm_available": ([], _int),
    "w16_linear": ([_vp, _int, _i64, _vp, _vp, _vp, _int, _i64, _i64, _i64, _int], _int),
    "packed_weight_numel": ([_i64, _i64], _i64),
    "pack_weight_bf16": ([_vp, _i64, _i64, _vp], None),
    "packed_gemm_bf16": ([_vp, _i64, _vp, _vp, _vp, _int, _i64, _i64, _i64, _i64], _int),
    "argmax_rows_f32": ([_vp, _i64, _i64, _i64, _vp], None),
    "argmax_rows_f32_if": ([_vp, _vp, _i64, _i64, _i64, _vp], None),
    "apply_token_bitmask_f32": ([_vp, _i64, _i64, _vp, _i64, _vp, _i64], None),
    "fused_rms_norm": ([_vp, _i64, _vp, _i64, _vp, _vp, _vp, _int, _i64, _i64, _float, _int], _int),
    "fused_qk_norm_rope": ([_vp, _int, _i64, _i64, _i64, _i64, _i64, _i64, _vp, _vp, _float, _vp, _vp, _i64, _int], _int),
    "fused_silu_mul": ([_vp, _i64, _vp, _int, _i64, _i64, _int, _int], _int),
    "fused_sigmoid": ([_vp, _vp, _int, _i64], _int),
    "fused_sink_scale": ([_vp, _int, _vp, _vp, _i64, _i64, _i64], _int),
    "fused_rms_norm_inplace": ([_vp, _i64, _vp, _int, _i64, _i64, ctypes.c_float, _int], _int),
    "fused_layer_norm": ([_vp, _i64, _vp, _vp, _vp, _int, _i64, _i64, ctypes.c_float], _int),
    "fused_gelu_tanh": ([_vp, _i64, _vp, _int, _i64, _i64], _int),
    "fused_mla_qkv": ([_vp, _i64, _vp, _i64, _vp, _i64, _vp, _vp, _i64, _vp, _vp, _vp, _int, _i64, _i64, _i64, _i64, _i64, _i64,
                       _int, _int], _int),
    "fused_elementwise": ([_vp, _i64, _vp, _i64, _vp, ctypes.c_float, _vp, _int, _i64, _i64, _int], _int),
    "gather_rows": ([_vp, _i64, _i64, _vp, _i64, _vp, _i64, _i64], _int),
    "scatter_rows": ([_vp, _i64, _vp, _i64, _vp, _i64, _i64, _i64], _int),
    "widen_bf16_rows": ([_vp, _i64, _vp, _i64, _i64, _i64], _int),
    "rotate_rows": ([_vp, _int, _i64, _vp, _i64, _i64, _i64, _vp, _vp, _i64], _int),
    "merge_parts": ([_vp, _vp, _vp, _vp, _i64, _i64, _i64, _vp, _int, _vp], _int),
    "lora_add_rows": ([_vp, _int, _i64, _vp, _int, _i64, _vp, _i64, _i64, _i64, _vp, _i64, _vp, _i64], _int),
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> str:
    root = os.environ.get("CUTTLE_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "cuttle", "kernels"
    )
    os.makedirs(root, exist_ok=True)
    return root


def _cpu_signature() -> str:
    # -march=native bakes the CPU's features into the binary: key the cache on them
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def build(src_dir: str = SRC_DIR) -> str:
    """Path of the compiled library, compiling it first if this source/flags/CPU has none yet.
    `src_dir`: another copy of `csrc` (benchmarks/mxfp8_commit_ab.py builds an older commit's)."""
    sources = sorted(os.path.join(src_dir, f) for f in os.listdir(src_dir) if f.endswith(".c"))
    headers = sorted(os.path.join(src_dir, f) for f in os.listdir(src_dir) if f.endswith(".h"))
    digest = hashlib.sha256()
    for src in sources + headers:
        with open(src, "rb") as f:
            digest.update(f.read())
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler on PATH (set CC)")
    digest.update(" ".join([cc, *_FLAGS]).encode() + _cpu_signature().encode())
    out = os.path.join(_cache_dir(), f"cpu_kernels-{digest.hexdigest()[:16]}.so")
    if os.path.isfile(out):
        return out
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out))
    os.close(fd)
    try:
        r = subprocess.run([cc, *_FLAGS, *sources, "-o", tmp, "-lm"], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed on {src_dir}:\n{r.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent builder sees the whole file or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def declare(lib: ctypes.CDLL, names: Iterable[str] = SIGNATURES) -> None:
    """Set argument and result types of `names` (default: every kernel) on a loaded library."""
    for name in names:
        argtypes, restype = SIGNATURES[name]
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype


def load() -> ctypes.CDLL | None:
    """The kernel library, built if needed; None when disabled or unbuildable (logged once)."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("CUTTLE_CPU_KERNELS", "1") == "0":
            return None
        try:
            lib = ctypes.CDLL(build())
        except (OSError, RuntimeError) as e:
            logger.warning("native CPU kernels unavailable, using the torch paths: %s", e)
            return None
        declare(lib)
        _lib = lib
        return _lib
