"""Python side of `csrc/moe_experts.c`: routed-expert weights packed once, routing and the whole
expert computation of one MoE layer in one native call each.

Owns the packed layout of stacked expert weights: `pack` / `pack_mxfp8` make a `PackedExperts`
(what a layer holds once its plain tensors are dropped: the engine packs at load and after every
weight update), `unpack` inverts it exactly (a permutation, for the torch reference path and for
weight writes), and `experts` / `experts_mxfp8` keep a packed copy on the weight tensor itself
(same attribute as the dense packed GEMM's, so `gemm.drop_packed` forgets it too) for callers that
hold plain tensors. Also the argument checks of the native calls. It knows nothing of routing configs or layers (`cuttle.moe` does):
callers pass plain numbers. Whether experts take these kernels is `kernels()`'s to say (library
loaded, `CUTTLE_MOE_NATIVE` not "0").

Weight formats (the C side's per-call code): `W_F32`, `W_BF16` (panels of 8 gate + 8 up features,
read by the widening fp32 tiles), `W_BF16_DOT` (bf16 in the dense packed GEMM's k-pair order, 64
features a panel, for the AVX512-BF16 dot tiles: what `pack` / `experts` choose for bf16 experts
where the library has them, unless `set_bf16_dot(False)`), `W_MXFP8_DOT` (E4M3 bytes in that
order, each panel turned into exact bf16 weights per call and run on the dot tiles: chosen for
bf16 activations where the library has AVX512-BF16 and VBMI and every scale byte is in the range
where that is exact), and `W_MXFP8`: E4M3 bytes with
E8M0 block scales (the (data, scale) pairs `cuttle.moe.mxfp8` writes), packed into the same panel
order with their scales beside them (`packed_mx_w13` / `packed_mx_w2`) and decoded in registers by
the shared MXFP8 inner loop (`csrc/mxfp8.h`); `experts_mxfp8` runs them.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable

import torch

from cuttle.attention.native import graph, hugepages, invariance, kernels, unrecorded
from cuttle.attention.native.build import DTYPE_CODE
from cuttle.attention.native.gemm import _PACKED_ATTR
from cuttle.attention.native.mxfp8 import check_nan_elements

W_F32, W_BF16, W_MXFP8, W_BF16_DOT, W_MXFP8_DOT = 0, 1, 2, 3, 4
WEIGHT_FORMAT = {torch.float32: W_F32, torch.bfloat16: W_BF16}  # the plain formats of each dtype

_vp, _i64, _int, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES: dict[str, tuple[list, type]] = {
    "moe_packed_w13_numel": ([_i64, _i64, _i64], _i64),
    "moe_packed_w2_numel": ([_i64, _i64, _i64], _i64),
    "moe_pack_w13": ([_vp, _int, _i64, _i64, _i64, _vp], _int),
    "moe_pack_w2": ([_vp, _int, _i64, _i64, _i64, _vp], _int),
    "moe_pack_mx_w13": ([_vp, _vp, _i64, _i64, _i64, _vp, _vp], _int),
    "moe_pack_mx_w2": ([_vp, _vp, _i64, _i64, _i64, _vp, _vp], _int),
    "moe_route": ([_vp, _int, _i64, _i64, _i64, _int, _int, _i64, _i64, _float, _vp, _vp, _vp, _vp], _i64),
    "moe_experts": ([_vp, _int, _i64, _i64, _i64, _vp, _vp, _i64, _vp, _vp, _int, _vp, _vp, _i64, _i64, _vp, _int, _int], _int),
    "moe_experts_ep": ([_vp, _int, _i64, _i64, _i64, _vp, _vp, _i64, _vp, _vp, _int, _vp, _vp, _i64, _i64, _vp, _int, _int,
                        _vp, _vp, _int, _float, _float], _int),
    "moe_dot_available": ([], _int),
    "moe_mx_dot_available": ([], _int),
    "mxfp8_scales_bf16_safe": ([_vp, _i64], _int),
    "moe_pack_mx_dot_w13": ([_vp, _vp, _i64, _i64, _i64, _vp, _vp], _int),
    "moe_pack_mx_dot_w2": ([_vp, _vp, _i64, _i64, _i64, _vp, _vp], _int),
    "moe_dot_w13_numel": ([_i64, _i64, _i64], _i64),
    "moe_dot_w2_numel": ([_i64, _i64, _i64], _i64),
    "moe_pack_dot_w13": ([_vp, _i64, _i64, _i64, _vp], _int),
    "moe_pack_dot_w2": ([_vp, _i64, _i64, _i64, _vp], _int),
}
_declared: set[int] = set()
MAX_EXPERTS = 4096  # moe_route keeps one token's scores on the stack
P13, P2 = 8, 16  # features per w13 / w2 panel (csrc/moe_experts.c); `unpack` reads the layout with them
DOT_PANEL = 64  # features per panel of the W_BF16_DOT layout (32 gate + 32 up for w13)
_dot_wanted = True  # set_bf16_dot's switch


@dataclass(frozen=True, slots=True)
class Epilogue:
    """gpt-oss's expert epilogues (`moe_experts_ep`): biases b13 [E, 2I] (gate then up) and b2
    [E, H] in the activations' dtype (None: none), and `clamp` = (alpha, limit) for its clamped
    SwiGLU (None: silu(gate) * up). Run on the widening formats only: `pack(..., dot=False)`."""

    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    clamp: tuple[float, float] | None = None


@dataclass(slots=True)
class PackedExperts:
    """One layer's routed experts in the kernel's panel layout: w13 [E][ceil(I/P13)][H][2*P13] and w2
    [E][ceil(H/P2)][I][P2] (rows past I or H are zero), in the weights' dtype, or as E4M3 bytes
    with the E8M0 scale panels `s13` / `s2` beside them (`fmt` W_MXFP8), or for W_BF16_DOT
    w13 [E][ceil(I/32)][ceil(H/2)][64][2] (32 gate then the same 32 up rows, k-pairs side by side)
    and w2 [E][ceil(H/64)][ceil(I/2)][64][2]."""

    fmt: int
    E: int
    I: int
    H: int
    w13: torch.Tensor
    w2: torch.Tensor
    s13: torch.Tensor | None = None
    s2: torch.Tensor | None = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w2, self.s13, self.s2) if t is not None)


def _lib(record: bool = True) -> ctypes.CDLL:
    """The kernel library; with record=False never the recording one of a kernel-graph capture
    (weights are packed once and cached, so a replay must not pack them again)."""
    lib = (kernels() if record else unrecorded()).lib
    if lib is None:
        raise RuntimeError("native MoE kernels: the CPU kernel library is not loaded (check available() first)")
    if id(lib) not in _declared:
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        _declared.add(id(lib))
    return lib


def available() -> bool:
    """Whether routed experts take the native kernels in this process (`KernelSet.moe_experts`)."""
    return kernels().moe_experts


def dot_in_use() -> bool:
    """Whether experts packed from now on take the AVX512-BF16 dot layouts (W_BF16_DOT, and
    W_MXFP8_DOT where `mx_format` allows it)."""
    return _dot_wanted and bool(_lib(record=False).moe_dot_available())


def set_bf16_dot(on: bool) -> bool:
    """bf16 experts (and MXFP8 experts on bf16 activations) packed from now on take the AVX512-BF16
    dot tiles (`on`, the default where the library was built with them) or the widening fp32 /
    MXFP8 panel tiles (tests, A/B timing); weights packed before keep their layout and tiles.
    Returns whether the dot tiles are now in use (False on CPUs without AVX512-BF16)."""
    global _dot_wanted
    _dot_wanted = bool(on)
    return dot_in_use()


def plain_format(dtype: torch.dtype) -> int:
    """The format fp32/bf16 experts of `dtype` are packed in now (W_BF16_DOT for bf16 where it runs)."""
    fmt = WEIGHT_FORMAT[dtype]
    return W_BF16_DOT if fmt == W_BF16 and dot_in_use() else fmt


_SCALES_SAFE = -2  # `_cached` key of mx_format's scan (on the scale tensors, which hold no panels)


def mx_format(x_dtype: torch.dtype, *scales: torch.Tensor) -> int:
    """The format MXFP8 experts with these E8M0 `scales` are packed in for activations of `x_dtype`:
    W_MXFP8_DOT for bf16 where the library runs it and every scale byte keeps the scaled weights
    exact in bf16 (mxfp8.h's safe range: real weights' are), W_MXFP8 otherwise."""
    if x_dtype != torch.bfloat16 or not dot_in_use():
        return W_MXFP8
    lib = _lib(record=False)
    if not lib.moe_mx_dot_available():
        return W_MXFP8

    def safe(sc: torch.Tensor) -> bool:  # a scan of every scale byte: kept on the tensor per version
        b = sc.contiguous().view(torch.uint8)
        return bool(lib.mxfp8_scales_bf16_safe(b.data_ptr(), b.numel()))

    return W_MXFP8_DOT if all(_cached(lambda sc=sc: safe(sc), sc, layout=_SCALES_SAFE) for sc in scales) else W_MXFP8


def runs_on(fmt: int, x_dtype: torch.dtype) -> bool:
    """Whether packed experts of format `fmt` run on activations of `x_dtype`: MXFP8 on either, a plain
    format on its own dtype, the dot layout on bf16 (it is only ever made where the library runs it)."""
    if fmt == W_MXFP8:
        return x_dtype in WEIGHT_FORMAT
    if fmt in (W_BF16_DOT, W_MXFP8_DOT):
        return x_dtype == torch.bfloat16
    return WEIGHT_FORMAT.get(x_dtype) == fmt


def _cached(make, *tensors: torch.Tensor, layout: int = -1):
    """`make()`, kept on `tensors[0]` and made again once any of `tensors` was written: keyed like
    the dense packed weights, by version counter (an in-place write, also on a slice, bumps it) and
    storage, and by the `layout` it was packed in."""
    key = (layout, *((t._version, t.data_ptr()) for t in tensors))
    hit = getattr(tensors[0], _PACKED_ATTR, None)
    if hit is not None and hit[0] == key:
        return hit[1]
    packed = make()
    setattr(tensors[0], _PACKED_ATTR, (key, packed))
    return packed


def _check_weight(w: torch.Tensor, name: str) -> None:
    if w.dim() != 3 or w.device.type != "cpu" or w.dtype not in WEIGHT_FORMAT or not w.is_contiguous():
        raise ValueError(f"{name}: need a contiguous CPU fp32/bf16 [E, N, K] tensor, got {tuple(w.shape)} {w.dtype} on {w.device}")


def _sizes(w13: torch.Tensor, w2: torch.Tensor, H: int | None = None) -> tuple[int, int, int]:
    """(E, I, H) of stacked experts w13 [E, 2I, H] and w2 [E, H, I]; raises unless they fit each
    other (and x's hidden size `H`, if given)."""
    E, two_i, H13 = w13.shape if w13.dim() == 3 else (0, 1, 0)
    if two_i % 2 or w13.dim() != 3 or tuple(w2.shape) != (E, H13, two_i // 2) or (H is not None and H13 != H):
        fit = "each other" if H is None else f"x's hidden size {H}"
        raise ValueError(f"expert weights w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} do not fit {fit}")
    return E, two_i // 2, H13


def _pack_w13(w13: torch.Tensor, fmt: int) -> torch.Tensor:
    _check_weight(w13, "w13")
    E, two_i, H = w13.shape
    if two_i % 2:
        raise ValueError(f"w13: row count {two_i} is not 2 * intermediate_size")
    lib = _lib(record=False)
    if fmt == W_BF16_DOT:
        out = hugepages.empty(lib.moe_dot_w13_numel(E, two_i // 2, H), w13.dtype)
        rc = lib.moe_pack_dot_w13(w13.data_ptr(), E, two_i // 2, H, out.data_ptr())
    else:
        out = hugepages.empty(lib.moe_packed_w13_numel(E, two_i // 2, H), w13.dtype)
        rc = lib.moe_pack_w13(w13.data_ptr(), fmt, E, two_i // 2, H, out.data_ptr())
    if rc != 0:
        raise RuntimeError("moe_pack_w13 failed")
    return out


def _pack_w2(w2: torch.Tensor, fmt: int) -> torch.Tensor:
    _check_weight(w2, "w2")
    E, H, I = w2.shape
    lib = _lib(record=False)
    if fmt == W_BF16_DOT:
        out = hugepages.empty(lib.moe_dot_w2_numel(E, H, I), w2.dtype)
        rc = lib.moe_pack_dot_w2(w2.data_ptr(), E, H, I, out.data_ptr())
    else:
        out = hugepages.empty(lib.moe_packed_w2_numel(E, H, I), w2.dtype)
        rc = lib.moe_pack_w2(w2.data_ptr(), fmt, E, H, I, out.data_ptr())
    if rc != 0:
        raise RuntimeError("moe_pack_w2 failed")
    return out


def packed_w13(w13: torch.Tensor, fmt: int) -> torch.Tensor:
    """The packed form (format `fmt`) of w13 [E, 2I, H] (gate rows, then up rows), made on first use and after a write."""
    return _cached(lambda: _pack_w13(w13, fmt), w13, layout=fmt)


def packed_w2(w2: torch.Tensor, fmt: int) -> torch.Tensor:
    """The packed form (format `fmt`) of w2 [E, H, I], made on first use and after a write."""
    return _cached(lambda: _pack_w2(w2, fmt), w2, layout=fmt)


def _check_mx(data: torch.Tensor, scale: torch.Tensor, name: str) -> None:
    if (data.dim() != 3 or data.dtype != torch.float8_e4m3fn or scale.dtype != torch.float8_e8m0fnu
            or data.device.type != "cpu" or not data.is_contiguous() or not scale.is_contiguous()):
        raise ValueError(f"{name}: need contiguous CPU float8_e4m3fn data [E, N, K] and float8_e8m0fnu scales, "
                         f"got {tuple(data.shape)} {data.dtype} / {scale.dtype}")
    E, N, K = data.shape
    if K % 32:
        raise ValueError(f"{name}: reduction dim K = {K} is not a multiple of the MX block size 32")
    if tuple(scale.shape) != (E, N, K // 32):
        raise ValueError(f"{name}: scale has shape {tuple(scale.shape)}, expected {(E, N, K // 32)}")


def _pack_mx(data: torch.Tensor, scale: torch.Tensor, which: str, fmt: int = W_MXFP8) -> tuple[torch.Tensor, torch.Tensor]:
    """Panel-packed MXFP8 `which` ("w13": data [E, 2I, H] / scale [E, 2I, H/32]; "w2": [E, H, I] /
    [E, H, I/32]) as (bytes, scale bytes), in format `fmt` (W_MXFP8 or W_MXFP8_DOT)."""
    _check_mx(data, scale, which)
    check_nan_elements(data, scale)  # once per weight version: the tiles decode NaN only via the scale
    lib = _lib(record=False)
    E, N, K = data.shape
    # moe_pack_mx_w13 takes (E, I, H), moe_pack_mx_w2 (E, H, I): the panel count comes from I or H
    sizes = (E, N // 2, K) if which == "w13" else (E, N, K)
    dot = fmt == W_MXFP8_DOT
    if which == "w13":
        n = (lib.moe_dot_w13_numel if dot else lib.moe_packed_w13_numel)(*sizes)
        pack = lib.moe_pack_mx_dot_w13 if dot else lib.moe_pack_mx_w13
    else:
        n = (lib.moe_dot_w2_numel if dot else lib.moe_packed_w2_numel)(*sizes)
        pack = lib.moe_pack_mx_dot_w2 if dot else lib.moe_pack_mx_w2
    out, out_s = hugepages.empty(n, torch.uint8), hugepages.empty(n // 32, torch.uint8)
    if pack(data.data_ptr(), scale.data_ptr(), *sizes, out.data_ptr(), out_s.data_ptr()) != 0:
        raise RuntimeError(f"moe_pack_mx_{which} failed")
    return out, out_s


def packed_mx_w13(data: torch.Tensor, scale: torch.Tensor, fmt: int = W_MXFP8) -> tuple[torch.Tensor, torch.Tensor]:
    """Panel-packed MXFP8 w13 (bytes, scale bytes) of data [E, 2I, H] / scale [E, 2I, H/32], format `fmt`."""
    return _cached(lambda: _pack_mx(data, scale, "w13", fmt), data, scale, layout=fmt)


def packed_mx_w2(data: torch.Tensor, scale: torch.Tensor, fmt: int = W_MXFP8) -> tuple[torch.Tensor, torch.Tensor]:
    """Panel-packed MXFP8 w2 (bytes, scale bytes) of data [E, H, I] / scale [E, H, I/32], format `fmt`."""
    return _cached(lambda: _pack_mx(data, scale, "w2", fmt), data, scale, layout=fmt)


def pack(w13: torch.Tensor, w2: torch.Tensor, dot: bool = True) -> PackedExperts:
    """Plain fp32/bf16 experts w13 [E, 2I, H], w2 [E, H, I] (one dtype) -> their panels, in
    `plain_format`'s layout (`dot` False: the widening layout, which an `Epilogue` needs)."""
    E, I, H = _sizes(w13, w2)
    if w2.dtype != w13.dtype:
        raise ValueError(f"expert weights w13 {w13.dtype}, w2 {w2.dtype}: one dtype expected")
    _check_weight(w13, "w13")
    fmt = plain_format(w13.dtype) if dot else WEIGHT_FORMAT[w13.dtype]
    return PackedExperts(fmt, E, I, H, _pack_w13(w13, fmt), _pack_w2(w2, fmt))


def pack_mxfp8(w13: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor],
               act_dtype: torch.dtype | None = None) -> PackedExperts:
    """MXFP8 experts, w13 = (data [E, 2I, H], scale [E, 2I, H/32]), w2 = (data [E, H, I], scale
    [E, H, I/32]) -> their panels (bytes and scale bytes): in `mx_format`'s layout for activations
    of `act_dtype` (the dot layout runs on bf16 only), the W_MXFP8 panels when it is None."""
    E, I, H = _sizes(w13[0], w2[0])
    fmt = W_MXFP8 if act_dtype is None else mx_format(act_dtype, w13[1], w2[1])
    p13, s13 = _pack_mx(*w13, "w13", fmt)
    p2, s2 = _pack_mx(*w2, "w2", fmt)
    return PackedExperts(fmt, E, I, H, p13, p2, s13, s2)


def _unpanel(panels: torch.Tensor, E: int, rows: int, K: int, width: int, halves: int) -> torch.Tensor:
    """[E][ceil(rows/width)][K][halves * width] panels -> [E, halves * rows, K]: the inverse of the
    packing permutation (padding rows dropped)."""
    n = -(-rows // width)
    v = panels.view(E, n, K, halves, width).permute(0, 3, 1, 4, 2).reshape(E, halves, n * width, K)
    return v[:, :, :rows].reshape(E, halves * rows, K).contiguous()


def _unpanel_dot(panels: torch.Tensor, E: int, rows: int, K: int, gated: bool, width: int = 2) -> torch.Tensor:
    """Panels of the dot layouts, [E][n][ceil(K/width)][64][width] -> [E, 2 * rows, K] (gated: w13,
    rows = I; 32 gate then 32 up rows a panel) or [E, rows, K] (w2). width 2: weights in k-pairs;
    width 1: the MXFP8 scale panels (K = blocks)."""
    kp = -(-K // width)
    if gated:
        n = -(-rows // 32)
        v = panels.view(E, n, kp, 2, 32, width).permute(0, 3, 1, 4, 2, 5).reshape(E, 2, n * 32, width * kp)
        return v[:, :, :rows, :K].reshape(E, 2 * rows, K).contiguous()
    n = -(-rows // DOT_PANEL)
    v = panels.view(E, n, kp, DOT_PANEL, width).permute(0, 1, 3, 2, 4).reshape(E, n * DOT_PANEL, width * kp)
    return v[:, :rows, :K].contiguous()


def _mx_dot_pos(f: int, j: int) -> int:
    """Byte of (feature f of a 32-feature half, k j of the pair) within its 64 bytes (moe_experts.c's mx_dot_pos)."""
    w = 2 * (f % 16) + j
    return 16 * (w // 8) + w % 8 + (8 if f >= 16 else 0)


# gathers a packed half's 64 bytes back into [32 features][2 k] order
_MX_DOT_UNPERMUTE = torch.tensor([_mx_dot_pos(f, j) for f in range(32) for j in range(2)])


def unpack(p: PackedExperts) -> tuple[torch.Tensor, torch.Tensor] | tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The exact plain tensors a `PackedExperts` was made from (fresh copies): (w13, w2), or for
    MXFP8 ((w13 data, w13 scale), (w2 data, w2 scale)). Pure torch: a permutation of the bytes."""
    E, I, H = p.E, p.I, p.H
    if p.fmt == W_BF16_DOT:
        return _unpanel_dot(p.w13, E, I, H, True), _unpanel_dot(p.w2, E, H, I, False)
    if p.fmt == W_MXFP8_DOT:
        d13, d2 = (d.view(-1, 64)[:, _MX_DOT_UNPERMUTE].reshape(-1) for d in (p.w13, p.w2))
        return ((_unpanel_dot(d13, E, I, H, True).view(torch.float8_e4m3fn),
                 _unpanel_dot(p.s13, E, I, H // 32, True, width=1).view(torch.float8_e8m0fnu)),
                (_unpanel_dot(d2, E, H, I, False).view(torch.float8_e4m3fn),
                 _unpanel_dot(p.s2, E, H, I // 32, False, width=1).view(torch.float8_e8m0fnu)))
    w13 = _unpanel(p.w13, E, I, H, P13, 2)
    w2 = _unpanel(p.w2, E, H, I, P2, 1)
    if p.fmt != W_MXFP8:
        return w13, w2
    s13 = _unpanel(p.s13, E, I, H // 32, P13, 2).view(torch.float8_e8m0fnu)
    s2 = _unpanel(p.s2, E, H, I // 32, P2, 1).view(torch.float8_e8m0fnu)
    return (w13.view(torch.float8_e4m3fn), s13), (w2.view(torch.float8_e4m3fn), s2)


def route(
    logits: torch.Tensor, top_k: int, sigmoid: bool, renorm: bool, n_group: int = 1, topk_group: int = 1,
    scale: float = 1.0, bias: torch.Tensor | None = None,
    settle: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logits [T, E] -> (weights fp32 [T, k], ids int64 [T, k], tied rows): softmax top-k (within
    the `topk_group` groups of highest max score when `n_group` > 1, DeepSeek-V2's rule; renormalized
    if `renorm`; times `scale`), or with `sigmoid` DeepSeek-V3's grouped rule (bias picks, `scale`
    multiplies). `tied` is None, or the int64 indices of the rows whose last kept and first dropped
    score are within 4 ulps (or equal): which of them torch.topk keeps is its own implementation
    detail, so the caller routes those rows with the torch router. `settle(weights, ids, rows)`,
    when given, is how the caller does that: a replayed step (`native.graph`) whose routing meets a
    tie calls it on the recorded tensors and goes on."""
    if logits.dim() != 2 or logits.dtype not in DTYPE_CODE or logits.device.type != "cpu":
        raise ValueError(f"logits: need a CPU fp32/bf16 [T, E] tensor, got {tuple(logits.shape)} {logits.dtype}")
    T, E = logits.shape
    if not 1 <= top_k <= E or E > MAX_EXPERTS:
        raise ValueError(f"top_k={top_k} with {E} experts: need 1 <= top_k <= num_experts <= {MAX_EXPERTS}")
    if n_group < 1 or E % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"n_group={n_group}, topk_group={topk_group} do not divide {E} experts")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (E,) or not bias.is_contiguous()):
        raise ValueError(f"e_score_correction_bias: need fp32 [{E}], got {tuple(bias.shape)} {bias.dtype}")
    logits = logits.contiguous()
    weights = torch.empty(T, top_k, dtype=torch.float32)
    ids = torch.empty(T, top_k, dtype=torch.int64)
    tie = torch.empty(T, dtype=torch.uint8)
    n_tied = _lib().moe_route(
        logits.data_ptr(), DTYPE_CODE[logits.dtype], T, E, top_k, int(sigmoid), int(renorm), n_group, topk_group,
        scale, bias.data_ptr() if bias is not None else None, weights.data_ptr(), ids.data_ptr(), tie.data_ptr(),
    )
    if n_tied < 0:
        raise ValueError(f"moe_route rejected T={T} E={E} top_k={top_k} n_group={n_group} topk_group={topk_group}")
    if settle is not None:
        def on_tie(n: int) -> bool:
            if n < 0:
                return False
            settle(weights, ids, tie.nonzero().view(-1))
            return True

        graph.on_result(on_tie)
        # a capture that meets a tie settles it now, unrecorded, and records "no tie": a replay
        # then settles whatever ties it meets through on_tie (nonzero would break the capture)
        if n_tied > 0 and graph.settle_at_capture(lambda: on_tie(n_tied), 0):
            return weights, ids, None
    return weights, ids, (tie.nonzero().view(-1) if n_tied else None)


def _routing_args(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    if x.dim() != 2 or x.device.type != "cpu" or x.dtype not in DTYPE_CODE or x.stride(-1) != 1:
        raise ValueError(f"x: need a CPU fp32/bf16 [T, H] tensor with dense rows, got {tuple(x.shape)} {x.dtype}")
    T = x.shape[0]
    k = ids.shape[1] if ids.dim() == 2 else -1
    if ids.dtype != torch.int64 or ids.shape != (T, k) or weights.dtype != torch.float32 or weights.shape != (T, k):
        raise ValueError(f"routing: need ids int64 and weights fp32 of shape [{T}, k], got {tuple(ids.shape)} "
                         f"{ids.dtype} and {tuple(weights.shape)} {weights.dtype}")
    return weights.contiguous(), ids.contiguous(), k


def _check_epilogue(ep: Epilogue, x: torch.Tensor, E: int, I: int, fmt: int) -> None:
    H = x.shape[1]
    if fmt in (W_BF16_DOT, W_MXFP8_DOT):
        raise ValueError("expert epilogues (biases, clamped SwiGLU) run on the widening layouts: pack with dot=False")
    for name, b, shape in (("b13", ep.b13, (E, 2 * I)), ("b2", ep.b2, (E, H))):
        if b is not None and (b.dtype != x.dtype or tuple(b.shape) != shape or not b.is_contiguous() or b.device.type != "cpu"):
            raise ValueError(f"expert bias {name}: need a contiguous CPU {x.dtype} tensor {list(shape)}, "
                             f"got {b.dtype} {list(b.shape)}")


def _run(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, k: int, p13: torch.Tensor, p2: torch.Tensor,
         fmt: int, s13: torch.Tensor | None, s2: torch.Tensor | None, E: int, I: int, ep: Epilogue | None = None) -> torch.Tensor:
    T, H = x.shape
    out = torch.empty(T, H, dtype=x.dtype)
    args = (x.data_ptr(), DTYPE_CODE[x.dtype], x.stride(0), T, H, ids.data_ptr(), weights.data_ptr(), k,
            p13.data_ptr(), p2.data_ptr(), fmt, s13.data_ptr() if s13 is not None else None,
            s2.data_ptr() if s2 is not None else None, E, I, out.data_ptr(), DTYPE_CODE[out.dtype], int(invariance.on()))
    if ep is None:
        rc = _lib().moe_experts(*args)
    else:
        _check_epilogue(ep, x, E, I, fmt)
        alpha, limit = ep.clamp if ep.clamp is not None else (0.0, 0.0)
        rc = _lib().moe_experts_ep(*args, ep.b13.data_ptr() if ep.b13 is not None else None,
                                   ep.b2.data_ptr() if ep.b2 is not None else None, int(ep.clamp is not None), alpha, limit)
    if rc == -3:
        raise ValueError(f"expert ids must lie in [0, {E})")
    if rc == -2:
        raise ValueError(f"moe_experts: weight format {fmt} with H={H}, I={I} is not supported by this build")
    if rc != 0:
        raise MemoryError(f"moe_experts failed ({rc}): workspace allocation for T={T}")
    return out


def experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """x [T, H] (fp32/bf16, rows dense), w13 [E, 2I, H], w2 [E, H, I] in x's dtype, weights fp32
    [T, k], ids int64 [T, k] -> [T, H] in x's dtype: sum_j weights[t, j] * SwiGLU expert ids[t, j]."""
    weights, ids, k = _routing_args(x, weights, ids)
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"expert weights {w13.dtype}/{w2.dtype} differ from the activations' {x.dtype}")
    E, I, _ = _sizes(w13, w2, x.shape[1])
    fmt = plain_format(w13.dtype)
    return _run(x, weights, ids, k, packed_w13(w13, fmt), packed_w2(w2, fmt), fmt, None, None, E, I)


def experts_mxfp8(
    x: torch.Tensor, w13: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor, ids: torch.Tensor,
) -> torch.Tensor:
    """`experts` with MXFP8 weights: w13 = (data [E, 2I, H], scale [E, 2I, H/32]), w2 = (data
    [E, H, I], scale [E, H, I/32]) as `quantize_mxfp8` writes them; H and I multiples of 32."""
    weights, ids, k = _routing_args(x, weights, ids)
    E, I, _ = _sizes(w13[0], w2[0], x.shape[1])
    _check_mx(*w13, "w13")
    _check_mx(*w2, "w2")
    fmt = mx_format(x.dtype, w13[1], w2[1])
    p13, s13 = packed_mx_w13(*w13, fmt)
    p2, s2 = packed_mx_w2(*w2, fmt)
    return _run(x, weights, ids, k, p13, p2, fmt, s13, s2, E, I)


def experts_packed(x: torch.Tensor, p: PackedExperts, weights: torch.Tensor, ids: torch.Tensor,
                   epilogue: Epilogue | None = None) -> torch.Tensor:
    """`experts` / `experts_mxfp8` on weights already packed (`pack`, `pack_mxfp8`); `epilogue`:
    gpt-oss's biases and activation (widening layouts only)."""
    weights, ids, k = _routing_args(x, weights, ids)
    if x.shape[1] != p.H:
        raise ValueError(f"packed experts have hidden size {p.H}, x has {x.shape[1]}")
    if not runs_on(p.fmt, x.dtype):
        raise ValueError(f"packed expert weights (format {p.fmt}) differ from the activations' {x.dtype}")
    return _run(x, weights, ids, k, p.w13, p.w2, p.fmt, p.s13, p.s2, p.E, p.I, epilogue)
