"""Native CPU kernels: build on first use, load with ctypes, call on torch tensors.

The kernels: paged decode attention (K/V read in place from the paged cache) and a small-batch
linear layer that streams its weight once (the decode-time projections and lm_head at batch
1..8). Each has a torch path it is tested against and that runs wherever the library is absent.

Owns the C sources under `attention/csrc/`: compiles them with the host C compiler
(`-O3 -march=native -fopenmp`) into a per-user cache keyed by the source, the flags and the CPU,
and loads the result. No torch headers are involved, so a build takes about a second, and a
machine without a compiler (or with `CUTTLE_CPU_KERNELS=0`) simply gets `None` and the torch
path. ctypes releases the GIL during a call; the kernels parallelise with the process's OpenMP
runtime (torch's libgomp, already loaded), so they share torch's threads instead of adding more.
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

import torch

logger = logging.getLogger(__name__)

_SRC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
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


def _build() -> str:
    sources = sorted(os.path.join(_SRC_DIR, f) for f in os.listdir(_SRC_DIR) if f.endswith(".c"))
    headers = sorted(os.path.join(_SRC_DIR, f) for f in os.listdir(_SRC_DIR) if f.endswith(".h"))
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
            raise RuntimeError(f"{cc} failed on {_SRC_DIR}:\n{r.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent builder sees the whole file or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


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
            lib = ctypes.CDLL(_build())
        except (OSError, RuntimeError) as e:
            logger.warning("native CPU attention kernels unavailable, using the torch path: %s", e)
            return None
        f = lib.paged_decode_attention
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        f.argtypes = [vp, ctypes.c_int, i64, vp, vp, ctypes.c_int, vp, ctypes.c_int, i64, vp, vp, i64, vp,
                      i64, i64, i64, i64, i64, i64, ctypes.c_float, i64]
        f.restype = ctypes.c_int
        f = lib.small_m_linear
        f.argtypes = [vp, ctypes.c_int, i64, vp, ctypes.c_int, vp, vp, ctypes.c_int, i64, i64, i64]
        f.restype = ctypes.c_int
        _lib = lib
        return _lib


def supports(q: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the native decode kernel takes these tensors (CPU, fp32/bf16, dense rows)."""
    return (
        q.device.type == "cpu" and k_cache.device.type == "cpu"
        and q.dtype in _DTYPE_CODE and k_cache.dtype in _DTYPE_CODE and out.dtype in _DTYPE_CODE
        and q.stride(-1) == 1 and q.stride(-2) == q.shape[-1] and out.is_contiguous() and k_cache.is_contiguous()
    )


def paged_decode_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [T, Hq, D], written at the decode rows
    rows: torch.Tensor,  # [Bd] int64 row of each decode sequence
    tables: torch.Tensor,  # [Bd, nb] int32 block ids
    seq_lens: torch.Tensor,  # [Bd] int32
    max_seq_len: int,
    scale: float,
) -> None:
    lib = load()
    assert lib is not None, "call load() first"
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    # Few sequences: split each one's heads so every thread has work; many: whole sequences per
    # item, so each token's K/V row (all heads) is read as one contiguous run.
    threads = torch.get_num_threads()
    head_chunks = min(num_kv_heads, max(1, -(-2 * threads // rows.shape[0])))
    rc = lib.paged_decode_attention(
        q.data_ptr(), _DTYPE_CODE[q.dtype], q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        _DTYPE_CODE[k_cache.dtype], out.data_ptr(), _DTYPE_CODE[out.dtype], out.stride(0), rows.data_ptr(),
        tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(), rows.shape[0], num_kv_heads, group, head_dim,
        block_size, max_seq_len, scale, head_chunks,
    )
    if rc != 0:
        raise MemoryError("paged_decode_attention: scratch allocation failed")


# Above this many rows the GEMM library reuses each weight tile across rows better than streaming
# does (measured here: the kernel wins at 1 and 4 rows, loses at 8).
SMALL_M_MAX_ROWS = 4


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the weight-streaming kernel for a few rows of a CPU fp32/bf16 input."""
    lib = _lib if _tried else load()
    if (
        lib is None or x.dim() != 2 or x.shape[0] > SMALL_M_MAX_ROWS or x.device.type != "cpu"
        or x.dtype not in _DTYPE_CODE or weight.dtype not in _DTYPE_CODE or not weight.is_contiguous()
        or x.stride(-1) != 1 or (bias is not None and (bias.dtype != weight.dtype or not bias.is_contiguous()))
        or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    ):
        return torch.nn.functional.linear(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    rc = lib.small_m_linear(
        x.data_ptr(), _DTYPE_CODE[x.dtype], x.stride(0), weight.data_ptr(), _DTYPE_CODE[weight.dtype],
        bias.data_ptr() if bias is not None else None, y.data_ptr(), _DTYPE_CODE[y.dtype], m, n, k,
    )
    if rc != 0:
        raise MemoryError("small_m_linear: allocation failed")
    return y
