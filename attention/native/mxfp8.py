"""MXFP8 weights on CPU: the Python side of `csrc/mxfp8_gemm.c` (GEMM and dequantization reading
E4M3 bytes + E8M0 block scales as stored, decoded in registers; shared decode in `csrc/mxfp8.h`).

A weight is the pair `cuttle.moe.mxfp8.quantize_mxfp8` returns: data `float8_e4m3fn [N, K]` and
scales `float8_e8m0fnu [N, K/32]` (blocks of 32 along K, unpadded, row-major). K must be a
multiple of 32: a weight whose reduction dim is not is refused here (ValueError naming K), never
padded, since the format has no partial block. The kernels take fp32/bf16 activations and sum in
fp32; the library picks AVX2+FMA+F16C or scalar loops at run time (`set_fast_path` forces the
scalar ones for tests), and, where it was built for AVX512-BF16 + VBMI, a decode loop that takes
bf16 activations as they are (`bf16_dot_available`).

Owns argument checking and the ctypes declarations; never decides whether a model uses MXFP8
(that is `cuttle.engine.models.linear_quant` and `cuttle.moe`), and never imports `cuttle.moe`:
the torch reference lives there and the tests compare against it.
"""
from __future__ import annotations

import ctypes

import torch

from cuttle.attention.native import invariance, kernels
from cuttle.attention.native.build import DTYPE_CODE

__all__ = ["available", "fast_path_available", "bf16_dot_available", "set_bf16_dot", "set_fast_path", "set_placed_loops", "dequantize", "linear",
           "last_linear_path", "check_weight", "check_nan_elements"]

BLOCK = 32
DECODE_BF16_MAX_ROWS = 12  # csrc/mxfp8_gemm.c's DECODE_BF16_MAX_M: bf16 x rows the bf16-dot decode loop takes
_vp, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "mxfp8_fast_path_available": ([], _int),
    "mxfp8_set_fast_path": ([_int], _int),
    "mxfp8_dequantize": ([_vp, _vp, _i64, _i64, _vp, _int], _int),
    "mxfp8_linear": ([_vp, _int, _i64, _vp, _vp, _vp, _vp, _int, _i64, _i64, _i64, _int], _int),
    "mxfp8_bf16_dot_available": ([], _int),
    "mxfp8_last_linear_path": ([], _int),
    "mxfp8_set_bf16_dot": ([_int], _int),
    "mxfp8_set_gfni_decode": ([_int], _int),
    "mxfp8_set_placed": ([_int], _int),
}
_declared: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _declared
    lib = kernels().lib
    if lib is None:
        raise RuntimeError("the native CPU kernel library is not available (no C compiler, or CUTTLE_CPU_KERNELS=0)")
    if _declared is not lib:
        for name, (args, res) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        _declared = lib
    return lib


def available() -> bool:
    """Whether the MXFP8 kernels can run in this process (the native library is loaded)."""
    return kernels().lib is not None


def fast_path_available() -> bool:
    """Whether this CPU has the AVX2 + FMA + F16C the vector loops use."""
    return bool(_lib().mxfp8_fast_path_available())


def set_fast_path(on: bool) -> bool:
    """Force the scalar loops (False) or go back to the CPU's choice (True); returns the path now on."""
    return bool(_lib().mxfp8_set_fast_path(int(on)))


def check_weight(data: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """Validate an MXFP8 weight for the kernels; returns (N, K). Raises ValueError naming the field."""
    if data.dtype != torch.float8_e4m3fn:
        raise ValueError(f"MXFP8 weight data must be float8_e4m3fn, got {data.dtype}")
    if scale.dtype != torch.float8_e8m0fnu:
        raise ValueError(f"MXFP8 weight scale must be float8_e8m0fnu, got {scale.dtype}")
    if data.dim() != 2:
        raise ValueError(f"MXFP8 weight data must be 2-D [N, K], got shape {tuple(data.shape)}")
    N, K = data.shape
    if K % BLOCK != 0:
        raise ValueError(f"MXFP8 weight: K = {K} is not a multiple of the block size {BLOCK} (not padded: refused)")
    if tuple(scale.shape) != (N, K // BLOCK):
        raise ValueError(f"MXFP8 weight scale has shape {tuple(scale.shape)}, expected {(N, K // BLOCK)} for data {(N, K)}")
    if data.device.type != "cpu" or scale.device.type != "cpu" or not data.is_contiguous() or not scale.is_contiguous():
        raise ValueError("MXFP8 weight data and scale must be contiguous CPU tensors")
    return N, K


def check_nan_elements(data: torch.Tensor, scale: torch.Tensor) -> None:
    """Refuse element NaN bytes (0x7F / 0xFF) in blocks whose scale is finite: the GEMM decodes NaN
    only through a block's NaN scale (quantize_mxfp8 writes NaN bytes nowhere else), so such bytes
    would read as 480. One pass over the bytes: callers run it once per weight, not per call."""
    K = data.shape[-1]
    nan_elem = (data.view(torch.uint8).reshape(-1, K // BLOCK, BLOCK) & 0x7F).eq(0x7F).any(-1)
    finite = scale.view(torch.uint8).reshape(nan_elem.shape).ne(0xFF)
    if bool((nan_elem & finite).any()):
        raise ValueError("MXFP8 weight holds E4M3 NaN bytes in blocks with a finite scale; the CPU kernels "
                         "decode NaN only through the block scale (quantize_mxfp8 never writes such bytes)")


def bf16_dot_available() -> bool:
    """Whether the library was built with the decode loop that multiplies bf16 activations by the
    decoded weights with AVX512-BF16's dot instruction (CPUs with AVX512-BF16 and AVX512-VBMI);
    it takes bf16 x at up to 8 rows when K is a multiple of 64 and the fast path is on."""
    return bool(_lib().mxfp8_bf16_dot_available())


def set_bf16_dot(on: bool) -> bool:
    """Let bf16 activations take the bf16-dot decode loop (the default where it is built) or the
    AVX2 one (tests, A/B timing); returns whether the bf16-dot loop is now in use."""
    return bool(_lib().mxfp8_set_bf16_dot(int(on)))


def set_gfni_decode(on: bool) -> bool:
    """Let the bf16-dot decode loop decode E4M3 bytes with GF2P8AFFINEQB where the library is built
    for a CPU with GFNI (the default) or with the table lookups only (tests: both give the same
    bits); returns whether the GFNI decode is now in use (False where it is not built)."""
    return bool(_lib().mxfp8_set_gfni_decode(int(on)))


def set_placed_loops(on: bool) -> bool:
    """Let calls on the AVX2 path take the placed loops (the default; not under the batch-invariant
    switch): `linear` at 1-2 x rows and the routed experts' MXFP8 tile at one token; or the M-row
    loops (tests and A/B timing). Returns whether the placed loops are now in use."""
    return bool(_lib().mxfp8_set_placed(int(on)))


# `last_linear_path()` values
LINEAR_PATHS = {0: "scalar", 1: "avx2", 2: "bf16_dot", 3: "tile", 4: "bf16_tile", 5: "avx2_placed"}


def last_linear_path() -> str:
    """Which loop the process's last `linear` call took (for tests and benchmarks; not thread-safe)."""
    return LINEAR_PATHS.get(_lib().mxfp8_last_linear_path(), "none")


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data [..., K], scale [..., K/32] -> [..., K] in fp32/bf16: each value the correctly rounded
    element * 2^(b-127) (bit-identical to `cuttle.moe.mxfp8.dequantize_mxfp8`)."""
    if dtype not in DTYPE_CODE:
        raise ValueError(f"dequantize: dtype must be float32 or bfloat16, got {dtype}")
    K = data.shape[-1]
    check_weight(data.reshape(-1, K), scale.reshape(-1, scale.shape[-1]) if scale.dim() else scale)
    out = torch.empty(data.shape, dtype=dtype)
    rows = data.numel() // K if K else 0
    rc = _lib().mxfp8_dequantize(data.data_ptr(), scale.data_ptr(), rows, K, out.data_ptr(), DTYPE_CODE[dtype])
    if rc != 0:
        raise ValueError(f"mxfp8_dequantize: K = {K} is not a multiple of {BLOCK}")
    return out


def linear(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) with W = (data, scale) in MXFP8: x [M, K] fp32/bf16 -> y [M, N] in x's
    dtype (or into `out`, [M, N] contiguous fp32/bf16). Sums are fp32; the bias is added in fp32."""
    N, K = check_weight(data, scale)
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"mxfp8 linear: x has shape {tuple(x.shape)}, the weight expects [M, {K}]")
    if x.dtype not in DTYPE_CODE or x.device.type != "cpu":
        raise ValueError(f"mxfp8 linear: x must be a float32/bfloat16 CPU tensor, got {x.dtype} on {x.device}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    M = x.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype)
    elif out.shape != (M, N) or out.dtype not in DTYPE_CODE or not out.is_contiguous():
        raise ValueError(f"mxfp8 linear: out must be a contiguous float32/bfloat16 [{M}, {N}] tensor")
    b = None
    if bias is not None:
        if bias.shape != (N,):
            raise ValueError(f"mxfp8 linear: bias has shape {tuple(bias.shape)}, expected ({N},)")
        b = bias.detach().float().contiguous()
    rc = _lib().mxfp8_linear(
        x.data_ptr(), DTYPE_CODE[x.dtype], x.stride(0), data.data_ptr(), scale.data_ptr(),
        b.data_ptr() if b is not None else None, out.data_ptr(), DTYPE_CODE[out.dtype], M, N, K, int(invariance.on()),
    )
    if rc == -1:
        raise MemoryError("mxfp8_linear: allocation failed")
    if rc != 0:
        raise ValueError(f"mxfp8_linear: K = {K} is not a multiple of {BLOCK}")
    return out
