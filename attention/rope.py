"""Rotary position embeddings (NeoX "rotate half" layout, as HF Llama / Qwen use).

Owns the cos/sin tables (built once, fp32) and their application to q and k, and the tables that
move a cached segment's keys by a position offset without touching them (the attention backends
rotate the query instead: see `delta_tables`). Frequency scalings: `linear` (position
interpolation), `llama3` (Llama-3.1), `yarn` (with its attention factor, "mscale", which
multiplies cos and sin, so q.k gains its square) and `longrope` (Phi-3 / Phi-4-mini: per-pair
short factors, served within the original length, and an attention factor like YaRN's). The scaling dict arrives validated and complete
from `cuttle.engine.config`; this module never guesses a missing field. Must stay numerically
identical to transformers in float32: the angle of position p is the fp32 product p * inv_freq,
as HF computes it, and the attention factor is applied to the fp32 cos/sin as HF applies it.
"""
from __future__ import annotations

import math
from typing import Any

import torch


# Scalings whose angle stays p * inv_freq (only the frequencies change), so rotations compose:
# R(a + b) = R(a) R(b), and a key cached at c can be used at c + delta. YaRN is one of them: its
# attention factor m scales every position's cos/sin alike, so a cached key m R(c) k queried by
# R(-delta) m R(p) q still gives m^2 <R(p - delta) q, R(c) k>, and the delta tables carry no m.
# Dynamic NTK (the base depends on the current length) would not compose; config refuses it.
POSITION_LINEAR_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_type(scaling: dict[str, Any] | None) -> str:
    if scaling is None:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq
    assert scaling is not None
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    if kind == "longrope":
        # the short factors, one per rotated pair (engine/config.py `_longrope`: served within the
        # original length, where transformers uses them)
        for name in ("short_factor", "long_factor"):
            if len(scaling[name]) != head_dim // 2:
                raise ValueError(f"rope_scaling.{name} has {len(scaling[name])} entries; longrope needs one per rotated "
                                 f"pair ({head_dim // 2} for {head_dim} rotary dims)")
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * theta**shape)
    if kind != "llama3":
        raise ValueError(f"rope type {kind!r} is not supported (supported: {', '.join(POSITION_LINEAR_ROPE_TYPES)})")
    # Llama-3.1: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): dimensions that turn fewer than `beta_slow` times over the original
    context are interpolated (divided by `factor`), those that turn more than `beta_fast` times are
    kept, with a linear ramp between; the ramp's ends are rounded outwards unless `truncate` is false."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling["beta_fast"]), float(scaling["beta_slow"])

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return interpolated * (1 - keep) + extrapolated * keep


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor cos and sin are multiplied by (YaRN's "mscale"; 1 for every other type): the
    config's `attention_factor` if given, else 0.1 ln(factor) + 1, or with DeepSeek's `mscale` and
    `mscale_all_dim` the ratio of that formula at the two (the rest of DeepSeek's mscale is in the
    softmax scale: `yarn_softmax_scale`)."""
    if rope_type(scaling) == "longrope":
        assert scaling is not None
        return float(scaling["attention_factor"])  # (engine/config.py fills it in)
    if rope_type(scaling) != "yarn":
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim)))
    return _yarn_mscale(factor)


def yarn_softmax_scale(scaling: dict[str, Any] | None) -> float:
    """DeepSeek-V3's extra attention-logit multiplier under YaRN: mscale(factor, mscale_all_dim)^2
    (1 without `mscale_all_dim`, and for every other rope type)."""
    if rope_type(scaling) == "default" or scaling is None or not scaling.get("mscale_all_dim"):
        return 1.0
    m = _yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
    return m * m


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class RotaryEmbedding:
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None, device: torch.device):
        self.rotary_dim = head_dim  # dims rotated: the first `rotary_dim` of a head (NeoX halves)
        self.rope_type = rope_type(scaling)
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)  # [rotary_dim / 2] fp32, on the host
        self.attention_factor = rope_attention_factor(scaling)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]  # [P, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:  # YaRN: the fp32 tables scaled, as transformers does
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        self.cos = cos.to(device)
        self.sin = sin.to(device)
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def cast_tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos/sin tables [max_positions, D/2] in the activation dtype (cast once)."""
        if dtype not in self._cast:
            self._cast[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        return self._cast[dtype]

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for the given positions in the activation dtype, [T, 1, D/2] (once per step)."""
        cos, sin = self.cast_tables(dtype)
        return cos[positions][:, None, :], sin[positions][:, None, :]

    def delta_tables(self, deltas: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin of the angles -delta * inv_freq, [len(deltas), rotary_dim / 2], on the host.

        A segment whose keys were rotated at c but sit at c + delta is attended by rotating the
        query by -delta: <R(p) q, R(c + delta) k> = <R(p - delta) q, R(c) k>. The angle is the fp32
        product delta * inv_freq, as the position tables compute theirs; fp32 (never the activation
        dtype), so the rotation adds one rounding of q, not a bf16 angle error.
        """
        if self.rope_type not in POSITION_LINEAR_ROPE_TYPES:
            raise NotImplementedError(
                f"rope type {self.rope_type!r} is not linear in position, so cached keys cannot be moved "
                f"by a position offset (supported: {', '.join(POSITION_LINEAR_ROPE_TYPES)})"
            )
        angles = torch.tensor(deltas, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        return angles.cos(), -angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by position: (x1, x2) -> (x1*cos - x2*sin, x2*cos + x1*sin), in x's dtype
    as transformers computes it. Tables narrower than D/2 (partial rotary, GLM-4.5) rotate the
    first 2 * cos.shape[-1] dims and pass the rest through, as transformers' NeoX-style partial
    rotation does."""
    half = cos.shape[-1]
    if 2 * half < x.shape[-1]:
        return torch.cat((apply_rope(x[..., : 2 * half], cos, sin), x[..., 2 * half :]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated over its first 2 * cos.shape[-1] dims (NeoX halves of that span), the
    rest kept; cos/sin [N, 1, r/2] fp32. Computed in fp32, returned in x's dtype (one rounding)."""
    half = cos.shape[-1]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half : 2 * half]
    rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., 2 * half :]), dim=-1)
    return rot.to(x.dtype)
