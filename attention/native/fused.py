"""Fused elementwise ops of a decoder layer on CPU: RMSNorm (alone, or after the residual add),
q/k per-head RMSNorm + RoPE in place on the fused qkv rows, silu(gate) * up, the sigmoid of
gates and routers (NSA's branch gates, a shared expert's gate, the torch sigmoid router),
gpt-oss's attention-sink scaling of the attention output (`sink_scale`), and the plain adds and
scalings some families put between the kernels (`add`, `scale`: a shared expert's output added to
the routed one and its gate, OLMo's post-norm residual adds, Granite's multipliers, Ministral 3's
query scaling), bit for bit as torch computes them, so those steps replay as kernel graphs; and
multi-head latent attention's q / k / v assembled for the cache in one call (`mla_qkv`).

Owns the Python side of `attention/csrc/fused_ops.c` (built into the one kernel library of
`cuttle.attention.native.build`) and the torch code each kernel replaces, which is also its
fallback: used when the library is absent, a tensor is not a CPU fp32/bf16 tensor laid out as the
kernel reads it, or autograd has to see the op (grad enabled and an input requires grad: the
trainer runs the same model code). The kernels reproduce the torch code bit for bit (see the C
file for how), so the engine's numbers do not depend on which path ran; the vector widths that
takes are found once, when the kernel set is chosen (`probe_sum_lanes`). Two exceptions, both for
batch invariance (`native.invariance`): torch's elementwise loops take a scalar exp for the tail
of each thread's range, whose place in a tensor follows its row count, so an element's bits
depend on the batch around it. `sigmoid` takes one scalar formula for every element (always; fp32
within 1e-6 relative of torch's, 4 ulps at most where measured; bf16 within one bf16 step);
`silu_mul` reproduces torch's ranges unless the batch-invariant switch is on, and then puts the
scalar tail at the end of each row only.

Why: in a decode step these were a dozen small torch ops per layer, each a dispatch and a pass
over memory (about 15% of a batch-64 step of a 0.6B model, 20% at batch 1); fused, each is one
ctypes call.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from cuttle.attention.native import invariance, kernels
from cuttle.attention.native.build import DTYPE_CODE as _DT
from cuttle.attention.rope import apply_rope


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF semantics: normalize in fp32, cast back to the dtype, then scale by the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def probe_sum_lanes(lib: ctypes.CDLL) -> int | None:
    """The lane count of torch's fp32 sum kernel on this build (not always the widest vectors:
    torch 2.13 on AVX512 sums with 8 lanes), found by trying both on random rows; None when
    neither reproduces it (another summation order: the norms are then within an ulp of torch)."""
    x = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0))  # own generator: global RNG untouched
    w = torch.ones(1000)
    ref = rms_norm_torch(x, w, 1e-6)
    y = torch.empty_like(x)
    for lanes in (8, 16):
        lib.fused_rms_norm(x.data_ptr(), 1000, None, 0, None, w.data_ptr(), y.data_ptr(), 0, 8, 1000, 1e-6, lanes)
        if torch.equal(y, ref):
            return lanes
    return None


def _native(*tensors: torch.Tensor) -> bool:
    """CPU, one supported dtype, and no autograd to record (cheap: it runs on every call)."""
    dt = tensors[0].dtype
    if dt not in _DT:
        return False
    for t in tensors:
        if not t.is_cpu or t.dtype is not dt:
            return False
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def _rows(x: torch.Tensor) -> tuple[int, int] | None:
    """(rows, row stride) when x is rows of its last dim with unit inner stride, else None."""
    if x.dim() == 2 and x.stride(1) == 1:
        return x.shape[0], x.stride(0)
    if x.is_contiguous() and x.dim() >= 1:
        n = x.shape[-1]
        return (x.numel() // n if n else 0), n
    return None


def _vector_ok(w: torch.Tensor, n: int) -> bool:
    return w.dim() == 1 and w.shape[0] == n and w.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (HF semantics, `rms_norm_torch`); a new contiguous tensor."""
    ks = kernels()
    lib = ks.lib
    rows = _rows(x) if lib is not None and _native(x, weight) else None
    n = x.shape[-1] if x.dim() else 0
    if rows is None or rows[0] == 0 or n == 0 or not _vector_ok(weight, n):
        return rms_norm_torch(x, weight, eps)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    lib.fused_rms_norm(x.data_ptr(), rows[1], None, 0, None, weight.data_ptr(), y.data_ptr(), _DT[x.dtype],
                       rows[0], n, eps, ks.sum_lanes)
    return y


def rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    """RMSNorm of x's rows in place (rows of a 2-D view with unit inner stride, e.g. columns of
    the fused qkv rows); False, changing nothing, where the native kernel does not apply (the
    caller then uses `rms_norm`)."""
    ks = kernels()
    lib = ks.lib
    if (lib is None or x.dim() != 2 or x.stride(1) != 1 or x.shape[0] == 0 or x.shape[1] == 0 or not _native(x, weight)
            or not _vector_ok(weight, x.shape[1])):
        return False
    lib.fused_rms_norm_inplace(x.data_ptr(), x.stride(0), weight.data_ptr(), _DT[x.dtype], x.shape[0], x.shape[1], eps,
                               ks.sum_lanes)
    return True


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta)): the residual add and the next norm in one pass."""
    ks = kernels()
    lib = ks.lib
    n = x.shape[-1] if x.dim() else 0
    rx = _rows(x) if lib is not None and x.shape == delta.shape and _native(x, delta, weight) else None
    rd = _rows(delta) if rx is not None else None
    if rx is None or rd is None or rx[0] == 0 or n == 0 or not _vector_ok(weight, n):
        x = x + delta
        return x, rms_norm(x, weight, eps)
    x_new = torch.empty_like(x, memory_format=torch.contiguous_format)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    lib.fused_rms_norm(x.data_ptr(), rx[1], delta.data_ptr(), rd[1], x_new.data_ptr(), weight.data_ptr(), y.data_ptr(),
                       _DT[x.dtype], rx[0], n, eps, ks.sum_lanes)
    return x_new, y


def _table_rows(t: torch.Tensor, rows: int, half: int) -> int | None:
    """Row stride of a per-row cos/sin table [rows, half] or [rows, 1, half] (as RotaryEmbedding.tables gives)."""
    if t.shape[0] != rows or t.shape[-1] != half or t.stride(-1) != 1:
        return None
    if t.dim() == 2 or (t.dim() == 3 and t.shape[1] == 1):
        return t.stride(0)
    return None


def qk_norm_rope(
    qkv: torch.Tensor,  # [T, (q_heads + 2 kv_heads) * head_dim], the fused projection's output
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor | None,  # q/k RMSNorm weights [head_dim] (Qwen3), or None for none
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,  # [T, 1, rotary_dim / 2] in the activation dtype (RotaryEmbedding.tables)
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split qkv into q [T, Hq, D], k, v [T, Hkv, D], with q and k RMSNormed per head (when
    weights are given) and rotated over their first 2 * cos.shape[-1] dims (all of them but for
    partial rotary, GLM-4.5's; the rest pass through). The native path rewrites q and k inside `qkv` and returns
    views of it (row stride of qkv); the torch path returns new q, k."""
    ks = kernels()
    lib = ks.lib
    T = qkv.shape[0]
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    norms = (q_weight, k_weight) if q_weight is not None else ()
    half = cos.shape[-1]
    cs = _table_rows(cos, T, half) if lib is not None and qkv.dim() == 2 and _native(qkv, cos, sin, *norms) else None
    if (
        cs is None or _table_rows(sin, T, half) != cs or half == 0 or 2 * half > head_dim or qkv.stride(1) != 1 or T == 0
        or qkv.shape[1] != q_size + 2 * kv_size or head_dim % 2 or head_dim > 1024
        or (q_weight is None) != (k_weight is None)
        or (q_weight is not None and not (_vector_ok(q_weight, head_dim) and _vector_ok(k_weight, head_dim)))
    ):
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, q_heads, head_dim)
        k = k.view(-1, kv_heads, head_dim)
        if q_weight is not None:
            q = rms_norm(q, q_weight, eps)
            k = rms_norm(k, k_weight, eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.view(-1, kv_heads, head_dim)
    rc = lib.fused_qk_norm_rope(
        qkv.data_ptr(), _DT[qkv.dtype], qkv.stride(0), T, q_heads, kv_heads, head_dim, 2 * half,
        q_weight.data_ptr() if q_weight is not None else None, k_weight.data_ptr() if k_weight is not None else None,
        eps, cos.data_ptr(), sin.data_ptr(), cs, ks.sum_lanes,
    )
    if rc != 0:
        raise ValueError(f"fused_qk_norm_rope rejected head_dim={head_dim}")
    # the three views made directly: split + view costs ~3x as much in dispatch (per layer)
    rs, off = qkv.stride(0), qkv.storage_offset()
    return (
        qkv.as_strided((T, q_heads, head_dim), (rs, head_dim, 1), off),
        qkv.as_strided((T, kv_heads, head_dim), (rs, head_dim, 1), off + q_size),
        qkv.as_strided((T, kv_heads, head_dim), (rs, head_dim, 1), off + q_size + kv_size),
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows of [gate | up] (the fused gate/up projection): [M, 2I] -> [M, I]."""
    ks = kernels()
    lib = ks.lib
    inter = gate_up.shape[-1] // 2
    if (
        lib is None or gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[0] == 0 or inter == 0
        or gate_up.shape[1] != 2 * inter or not _native(gate_up)
    ):
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate) * up
    y = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype)
    # torch's thread ranges (where its scalar tails fall), or one range per row: batch-invariant
    threads = 1 if invariance.on() else torch.get_num_threads()
    lib.fused_silu_mul(gate_up.data_ptr(), gate_up.stride(0), y.data_ptr(), _DT[y.dtype], gate_up.shape[0], inter,
                       ks.vec_lanes, threads)
    return y


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid(x) for gates and routers, each element by one scalar formula wherever it sits
    (fp32, or bf16 rounded once; see the module docstring for how close to torch's); torch's op
    under autograd or without the library."""
    lib = kernels().lib
    if lib is None or not x.is_contiguous() or x.numel() == 0 or not _native(x):
        return torch.sigmoid(x)
    y = torch.empty_like(x)
    if lib.fused_sigmoid(x.data_ptr(), y.data_ptr(), _DT[x.dtype], x.numel()) != 0:
        raise ValueError(f"fused_sigmoid: dtype {x.dtype} is not supported")
    return y


def sink_scale(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """o [T, H, D] times sigmoid(lse [T, H] - sinks [H]) per row and head, in o's dtype (the fp32
    product rounded once): attention with a sink logit from attention without one. In place on a
    contiguous CPU o (one scalar formula per row and head: batch-invariant); torch otherwise, or
    under autograd."""
    lib = kernels().lib
    if (lib is None or o.dim() != 3 or not o.is_contiguous() or lse.dtype != torch.float32 or not lse.is_contiguous()
            or tuple(lse.shape) != tuple(o.shape[:2]) or tuple(sinks.shape) != (o.shape[1],) or not sinks.is_contiguous()
            or not _native(o, sinks) or not lse.is_cpu):
        return (o.float() * torch.sigmoid(lse - sinks.float())[..., None]).to(o.dtype)
    if lib.fused_sink_scale(o.data_ptr(), _DT[o.dtype], lse.data_ptr(), sinks.data_ptr(), *o.shape) != 0:
        raise ValueError(f"fused_sink_scale: dtype {o.dtype} is not supported")
    return o


def _flat_rows(x: torch.Tensor) -> tuple[int, int, int] | None:
    """(rows, elements a row, row stride) of a CPU tensor read as rows of its first dim, each row's
    elements contiguous (a contiguous tensor, or rows of one such as q's in the fused qkv)."""
    if x.dim() == 0 or x.numel() == 0:
        return None
    n = x.numel() // x.shape[0]
    if x.is_contiguous():
        return x.shape[0], n, n
    if x.dim() >= 2 and x[0].is_contiguous():
        return x.shape[0], n, x.stride(0)
    return None


def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y (same shape and dtype), as torch adds them; one native call on CPU."""
    lib = kernels().lib
    shape = _flat_rows(x)
    if lib is None or shape is None or y.shape != x.shape or not y.is_contiguous() or not _native(x, y):
        return x + y  # (torch's result for anything else: broadcasting, autograd, other devices)
    out = torch.empty(x.shape, dtype=x.dtype)
    rows, n, stride = shape
    lib.fused_elementwise(x.data_ptr(), stride, y.data_ptr(), n, None, 0.0, out.data_ptr(), _DT[x.dtype], rows, n, 0)
    return out


def scale(x: torch.Tensor, factor: float | torch.Tensor, divide: bool = False) -> torch.Tensor:
    """x * factor (or x / factor with `divide`), as torch computes it: `factor` a Python number
    (taken as a float, as torch takes it) or a tensor of one factor per row of x's first dim
    (shape [rows, 1, ...], x's dtype); one native call on CPU."""
    lib = kernels().lib
    shape = _flat_rows(x)
    rows_f = factor if isinstance(factor, torch.Tensor) else None
    if (lib is None or shape is None or not _native(x) or (rows_f is not None and (
            rows_f.numel() != shape[0] or rows_f.dim() != x.dim() or rows_f.shape[0] != shape[0] or not _native(x, rows_f)
            or not rows_f.is_contiguous()))):
        return x / factor if divide else x * factor
    out = torch.empty(x.shape, dtype=x.dtype)
    rows, n, stride = shape
    lib.fused_elementwise(x.data_ptr(), stride, None, 0, rows_f.data_ptr() if rows_f is not None else None,
                          0.0 if rows_f is not None else float(factor), out.data_ptr(), _DT[x.dtype], rows, n, 2 if divide else 1)
    return out


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """F.layer_norm over the last dim (StarCoder2's), one native call on CPU: moments in double,
    within an fp32 ulp or two of torch's (not its bits); torch under autograd or elsewhere."""
    lib = kernels().lib
    rows = _rows(x) if lib is not None and _native(x, weight, *(() if bias is None else (bias,))) else None
    n = x.shape[-1] if x.dim() else 0
    if rows is None or rows[0] == 0 or n == 0 or not _vector_ok(weight, n) or (bias is not None and not _vector_ok(bias, n)):
        return F.layer_norm(x, (n,), weight, bias, eps)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    lib.fused_layer_norm(x.data_ptr(), rows[1], weight.data_ptr(), bias.data_ptr() if bias is not None else None, y.data_ptr(),
                         _DT[x.dtype], rows[0], n, eps)
    return y


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """F.gelu(x, approximate="tanh"), one native call on CPU (libm's tanh: within an fp32 ulp or
    two of torch's vector tanh); torch under autograd or elsewhere."""
    lib = kernels().lib
    rows = _rows(x) if lib is not None and _native(x) else None
    n = x.shape[-1] if x.dim() else 0
    if rows is None or rows[0] == 0 or n == 0:
        return F.gelu(x, approximate="tanh")
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    lib.fused_gelu_tanh(x.data_ptr(), rows[1], y.data_ptr(), _DT[x.dtype], rows[0], n)
    return y


def narrow_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, :n] of a 2-D tensor with unit inner stride as a new contiguous tensor: one native copy
    (the multiply by 1.0 of `scale`, exact) on CPU, torch's copy otherwise."""
    part = x[:, :n]
    return scale(part, 1.0) if part.dim() == 2 and part.stride(1) == 1 else part.contiguous()


def mla_qkv(q: torch.Tensor, k_rot: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, nope: int,
            rope: int, vdim: int, cache_dim: int, interleave: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Multi-head latent attention's q, k, v for the paged cache, [T, heads, cache_dim] each (rotary
    dims first and rotated, nope dims, v, zero padding), from q rows [T, heads * (nope + rope)]
    (checkpoint order), the shared rotary key [T, rope] and kv [T, heads * (nope + vdim)]: one
    native call, the torch code's values bit for bit. None where the kernel does not apply (the
    caller then runs its torch code)."""
    lib = kernels().lib
    T = q.shape[0]
    if lib is None or T == 0 or any(t.dim() != 2 or t.stride(1) != 1 for t in (q, k_rot, kv)) or not _native(q, k_rot, kv, cos, sin):
        return None
    cs = _table_rows(cos, T, rope // 2)
    if cs is None or _table_rows(sin, T, rope // 2) != cs:
        return None
    out = [torch.empty(T, heads, cache_dim, dtype=q.dtype) for _ in range(3)]
    rc = lib.fused_mla_qkv(q.data_ptr(), q.stride(0), k_rot.data_ptr(), k_rot.stride(0), kv.data_ptr(), kv.stride(0),
                           cos.data_ptr(), sin.data_ptr(), cs, out[0].data_ptr(), out[1].data_ptr(), out[2].data_ptr(),
                           _DT[q.dtype], T, heads, nope, rope, vdim, cache_dim, int(interleave), kernels().sum_lanes)
    return None if rc != 0 else (out[0], out[1], out[2])
