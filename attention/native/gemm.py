"""Linear layers on CPU through the native kernels. Every bf16 linear layer (decode at any batch,
prefill chunks) takes a native bf16 GEMM: on CPUs with AVX512-BF16 the GEMM on weights packed once
for the dot instruction, on AVX2 CPUs without it the widening GEMM that reads the weight in place.
A small-batch kernel streams the weight once in its own layout for 1..4 rows of fp32 (or of bf16
with the native bf16 GEMMs off). Anything else, and anything autograd must see, is `F.linear`.

Owns the packed weight copies (kept on the weight tensor by `derived`, which other modules use for
their own copies derived from a weight; dropped by `drop_packed`) and the
Python side of `csrc/packed_gemm.c`, `csrc/w16_gemm.c` and `csrc/small_m_linear.c`. Which path a call may take is
read from `kernels()`, decided once per process; nothing here looks at the environment.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

from cuttle.attention.native import hugepages, invariance, kernels, unrecorded
from cuttle.attention.native.build import DTYPE_CODE

# Up to this many rows the weight-streaming kernel reads the weight in its own layout (fp32, or
# bf16 with the packed GEMM switched off); above it torch's GEMM reuses weight tiles across rows.
SMALL_M_MAX_ROWS = 4

# The packed copy of a weight lives on the weight tensor itself, so it is freed with it. It is
# keyed by the tensor's version counter and storage: every in-place write through the tensor
# (`copy_`, also on a slice, as the loader and `update_weights` do) bumps the counter, so the next
# call repacks. Writes through `.data` bypass the counter; `drop_packed(model)` forgets all
# packed copies explicitly (the engine calls it after a weight update).
_PACKED_ATTR = "_cuttle_packed"
T = TypeVar("T")


def derived(t: torch.Tensor, attr: str, make: Callable[[torch.Tensor], T]) -> T:
    """`make(t)`, kept on `t` under `attr` (a `_cuttle_` name, which `drop_packed` sweeps) and
    made again after an in-place write through `t` (its version counter) or a move (its address)."""
    key = (t._version, t.data_ptr())
    hit = getattr(t, attr, None)
    if hit is not None and hit[0] == key:
        return hit[1]
    value = make(t)
    setattr(t, attr, (key, value))
    return value


def _pack(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    # packed once and cached on the weight: inside a kernel-graph capture the pack is done but not
    # recorded, so a replay reads the packed copy instead of repacking it every step
    real = unrecorded().lib
    # in huge pages, as the weights it replaces (hugepages.py: a decode step streams all of it)
    packed = hugepages.empty(real.packed_weight_numel(n, k), torch.bfloat16)
    real.pack_weight_bf16(weight.data_ptr(), n, k, packed.data_ptr())
    return packed


def _packed(weight: torch.Tensor) -> torch.Tensor:
    return derived(weight, _PACKED_ATTR, _pack)


def _bias_f32(bias: torch.Tensor) -> torch.Tensor:
    return derived(bias, _PACKED_ATTR, lambda b: b.float().contiguous())


def drop_packed(module: torch.nn.Module | list[torch.Tensor]) -> None:
    """Forget every packed or derived weight copy held by `module`'s parameters, or by the given
    tensors (remade on next use): this module's and the expert kernels' `_PACKED_ATTR`, and any
    other attribute a caller keeps on a parameter under the `_cuttle_` prefix (NSA's per-head phi
    weights)."""
    for p in module.parameters() if isinstance(module, torch.nn.Module) else module:
        for attr in [a for a in vars(p) if a.startswith("_cuttle_")]:
            delattr(p, attr)


def prepack(weights: list[torch.Tensor]) -> int:
    """Pack every weight the packed GEMM will take (bf16, contiguous, CPU) now rather than on its
    first call, so the first request does not pay for it (~1-4 s for a 0.6B model). Returns how
    many were packed. The engine calls it at model load, which is where the kernel set is chosen."""
    ks = kernels()
    if ks.lib is None or not ks.packed_gemm:
        return 0
    n = 0
    for w in weights:
        if w.dim() == 2 and w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.is_contiguous():
            _packed(w)
            n += 1
    return n


def _torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear for the shapes the kernels leave to torch. The kernels take fp32 rows against a
    bf16 weight (the sigmoid routers ask for that product); torch does not mix dtypes, so the
    weight is widened, which is exact."""
    if x.dtype == torch.float32 and weight.dtype == torch.bfloat16:
        weight = weight.float()
        bias = bias.float() if bias is not None else None
    return torch.nn.functional.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear on CPU through the native kernels where they apply: for a bf16 weight at any row
    count the packed GEMM (AVX512-BF16; measured on the 0.6B model: it streams the weight faster
    than the streaming kernel even at one row, 51-59 vs 76-80 ms a decode step) or the AVX2
    widening GEMM (3-4x torch's bf16 GEMM there, and one sequential weight stream at a few rows);
    the weight-streaming kernel for 1..SMALL_M_MAX_ROWS rows otherwise (for every row count when
    the batch-invariant switch is on: `invariance`); else torch."""
    ks = kernels()
    lib = ks.lib
    if (
        # shapes that do not fit go to F.linear, which raises the usual error (the kernels would
        # read past the tensors)
        lib is None or x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.shape[1] == 0 or x.device.type != "cpu"
        or (bias is not None and bias.shape != (weight.shape[0],))
        or x.dtype not in DTYPE_CODE or weight.dtype not in DTYPE_CODE or not weight.is_contiguous()
        or x.stride(-1) != 1 or (bias is not None and (bias.dtype != weight.dtype or not bias.is_contiguous()))
        or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    ):
        return torch.nn.functional.linear(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    if x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and m > 0 and ks.packed_gemm:
        y = torch.empty(m, n, dtype=x.dtype)
        rc = lib.packed_gemm_bf16(
            x.data_ptr(), x.stride(0), _packed(weight).data_ptr(),
            _bias_f32(bias).data_ptr() if bias is not None else None, y.data_ptr(), DTYPE_CODE[y.dtype], n, m, n, k,
        )
        if rc != 0:
            raise RuntimeError("packed_gemm_bf16: built without AVX512-BF16")
        return y
    if weight.dtype == torch.bfloat16 and m > 0 and ks.w16_gemm:
        y = torch.empty(m, n, dtype=x.dtype)
        rc = lib.w16_linear(
            x.data_ptr(), DTYPE_CODE[x.dtype], x.stride(0), weight.data_ptr(),
            bias.data_ptr() if bias is not None else None, y.data_ptr(), DTYPE_CODE[y.dtype], m, n, k, int(invariance.on()),
        )
        if rc != 0:
            raise MemoryError("w16_linear: allocation failed") if rc == -1 else RuntimeError("w16_linear: built without AVX2+FMA")
        return y
    if m > SMALL_M_MAX_ROWS and not invariance.on():
        # (batch-invariant calls stay on the streaming kernel at every row count: it sums each row
        # in one order, torch's GEMM blocks by the row count)
        return _torch_linear(x, weight, bias)
    y = torch.empty(m, n, dtype=x.dtype)
    rc = lib.small_m_linear(
        x.data_ptr(), DTYPE_CODE[x.dtype], x.stride(0), weight.data_ptr(), DTYPE_CODE[weight.dtype],
        bias.data_ptr() if bias is not None else None, y.data_ptr(), DTYPE_CODE[y.dtype], m, n, k,
    )
    if rc != 0:
        raise MemoryError("small_m_linear: allocation failed")
    return y
