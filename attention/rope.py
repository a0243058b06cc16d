"""Rotary position embeddings (NeoX "rotate half" layout, as HF Llama / Qwen use).

Owns the cos/sin tables (built once, fp32) and their application to q and k, and the tables that
move a cached segment's keys by a position offset without touching them (the attention backends
rotate the query instead: see `delta_tables`). Supports the Llama-3.1 frequency scaling. Must stay
numerically identical to transformers in float32: the angle of position p is the fp32 product
p * inv_freq, as HF computes it.
"""
from __future__ import annotations

import math
from typing import Any

import torch

# Scalings whose angle stays p * inv_freq (only the frequencies change), so rotations compose:
# R(a + b) = R(a) R(b), and a key cached at c can be used at c + delta. Dynamic NTK (the base
# depends on the current length) or YaRN's mscale-folded tables would not compose: refused.
POSITION_LINEAR_ROPE_TYPES = ("default", "llama3")


def rope_type(scaling: dict[str, Any] | None) -> str:
    if scaling is None:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama-3.1: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    factor = float(scaling["factor"])
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


class RotaryEmbedding:
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None, device: torch.device):
        self.rotary_dim = head_dim  # dims rotated: the first `rotary_dim` of a head (NeoX halves)
        self.rope_type = rope_type(scaling)
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)  # [rotary_dim / 2] fp32, on the host
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]  # [P, D/2]
        self.cos = freqs.cos().to(device)
        self.sin = freqs.sin().to(device)
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for the given positions in the activation dtype, [T, 1, D/2] (once per step)."""
        if dtype not in self._cast:
            self._cast[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        cos, sin = self._cast[dtype]
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
    """x [T, H, D] rotated by position: (x1, x2) -> (x1*cos - x2*sin, x2*cos + x1*sin)."""
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
