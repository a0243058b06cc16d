"""Native CPU kernels: build on first use, load with ctypes, call on torch tensors.

The kernels: paged decode attention (K/V read in place from the paged cache), a bf16 GEMM on
weights packed once for the dot instruction (every bf16 linear layer: decode at any batch,
prefill chunks), a small-batch linear layer that streams its weight once (1..4 rows of fp32, or
of bf16 with the packed GEMM off), and a row-wise argmax for the sampler's greedy pick. Each has a
torch path it is tested against and that runs wherever the library is absent.

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
        lib.paged_decode_set_fast_path.argtypes = [ctypes.c_int]
        lib.paged_decode_set_fast_path.restype = None
        lib.paged_decode_last_call_fast.restype = ctypes.c_int
        f = lib.small_m_linear
        f.argtypes = [vp, ctypes.c_int, i64, vp, ctypes.c_int, vp, vp, ctypes.c_int, i64, i64, i64]
        f.restype = ctypes.c_int
        lib.packed_gemm_available.restype = ctypes.c_int
        lib.packed_weight_numel.argtypes = [i64, i64]
        lib.packed_weight_numel.restype = i64
        lib.pack_weight_bf16.argtypes = [vp, i64, i64, vp]
        lib.pack_weight_bf16.restype = None
        lib.argmax_rows_f32.argtypes = [vp, i64, i64, i64, vp]
        lib.argmax_rows_f32.restype = None
        f = lib.packed_gemm_bf16
        f.argtypes = [vp, i64, vp, vp, vp, ctypes.c_int, i64, i64, i64, i64]
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


# Up to this many rows the weight-streaming kernel reads the weight in its own layout (fp32, or
# bf16 with the packed GEMM switched off); above it torch's GEMM reuses weight tiles across rows.
SMALL_M_MAX_ROWS = 4

# The packed copy of a weight lives on the weight tensor itself, so it is freed with it. It is
# keyed by the tensor's version counter and storage: every in-place write through the tensor
# (`copy_`, also on a slice, as the loader and `update_weights` do) bumps the counter, so the next
# call repacks. Writes through `.data` bypass the counter; `drop_packed(model)` forgets all
# packed copies explicitly (the engine calls it after a weight update).
_PACKED_ATTR = "_cuttle_packed"


def _packed(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    key = (weight._version, weight.data_ptr())
    hit = getattr(weight, _PACKED_ATTR, None)
    if hit is not None and hit[0] == key:
        return hit[1]
    n, k = weight.shape
    packed = torch.empty(lib.packed_weight_numel(n, k), dtype=torch.bfloat16)
    lib.pack_weight_bf16(weight.data_ptr(), n, k, packed.data_ptr())
    setattr(weight, _PACKED_ATTR, (key, packed))
    return packed


def _bias_f32(bias: torch.Tensor) -> torch.Tensor:
    key = (bias._version, bias.data_ptr())
    hit = getattr(bias, _PACKED_ATTR, None)
    if hit is not None and hit[0] == key:
        return hit[1]
    b = bias.float().contiguous()
    setattr(bias, _PACKED_ATTR, (key, b))
    return b


def drop_packed(module: torch.nn.Module) -> None:
    """Forget every packed weight copy held by `module`'s parameters (repacked on next use)."""
    for p in module.parameters():
        if hasattr(p, _PACKED_ATTR):
            delattr(p, _PACKED_ATTR)


def prepack(weights: list[torch.Tensor]) -> int:
    """Pack every weight the packed GEMM will take (bf16, contiguous, CPU) now rather than on its
    first call, so the first request does not pay for it (~1-4 s for a 0.6B model). Returns how
    many were packed."""
    lib = _lib if _tried else load()
    if lib is None or not packed_gemm_enabled():
        return 0
    n = 0
    for w in weights:
        if w.dim() == 2 and w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.is_contiguous():
            _packed(lib, w)
            n += 1
    return n


_packed_on: bool | None = None  # read once: an environ lookup on every call was ~1% of a decode step


def packed_gemm_enabled() -> bool:
    """Whether bf16 linear layers take the packed GEMM: the library is here, built with
    AVX512-BF16, and `CUTTLE_PACKED_GEMM` is not "0" (read at first use)."""
    global _packed_on
    if _packed_on is None:
        lib = _lib if _tried else load()
        _packed_on = lib is not None and os.environ.get("CUTTLE_PACKED_GEMM", "1") != "0" and bool(lib.packed_gemm_available())
    return _packed_on


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear on CPU through the native kernels where they apply: the packed GEMM for bf16 at
    any row count (measured on the 0.6B model: it streams the weight faster than the streaming
    kernel even at one row, 51-59 vs 76-80 ms a decode step), the weight-streaming kernel for
    1..SMALL_M_MAX_ROWS rows otherwise; else torch."""
    lib = _lib if _tried else load()
    if (
        # shapes that do not fit go to F.linear, which raises the usual error (the kernels would
        # read past the tensors)
        lib is None or x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.device.type != "cpu"
        or (bias is not None and bias.shape != (weight.shape[0],))
        or x.dtype not in _DTYPE_CODE or weight.dtype not in _DTYPE_CODE or not weight.is_contiguous()
        or x.stride(-1) != 1 or (bias is not None and (bias.dtype != weight.dtype or not bias.is_contiguous()))
        or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    ):
        return torch.nn.functional.linear(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    if x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and m > 0 and packed_gemm_enabled():
        y = torch.empty(m, n, dtype=x.dtype)
        rc = lib.packed_gemm_bf16(
            x.data_ptr(), x.stride(0), _packed(lib, weight).data_ptr(),
            _bias_f32(bias).data_ptr() if bias is not None else None, y.data_ptr(), _DTYPE_CODE[y.dtype], n, m, n, k,
        )
        if rc != 0:
            raise RuntimeError("packed_gemm_bf16: built without AVX512-BF16")
        return y
    if m > SMALL_M_MAX_ROWS:
        return torch.nn.functional.linear(x, weight, bias)
    y = torch.empty(m, n, dtype=x.dtype)
    rc = lib.small_m_linear(
        x.data_ptr(), _DTYPE_CODE[x.dtype], x.stride(0), weight.data_ptr(), _DTYPE_CODE[weight.dtype],
        bias.data_ptr() if bias is not None else None, y.data_ptr(), _DTYPE_CODE[y.dtype], m, n, k,
    )
    if rc != 0:
        raise MemoryError("small_m_linear: allocation failed")
    return y


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for a 2-D CPU fp32 tensor with unit column stride (first index of
    the maximum; NaN counts as the maximum), natively where the library is present."""
    lib = _lib if _tried else load()
    if lib is None or x.dim() != 2 or x.device.type != "cpu" or x.dtype != torch.float32 or x.stride(-1) != 1 or x.shape[1] == 0:
        return torch.argmax(x, dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows_f32(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out
