"""Reads FP8 block-scaled checkpoints (Qwen3-*-FP8, DeepSeek-V3): each quantized weight W8
(float8_e4m3fn, [..., rows, cols]) comes with `weight_scale_inv` S ([..., ceil(rows/b0),
ceil(cols/b1)]), and the weight is W = W8 * S per block (S is the inverse of the scale the
quantizer divided by, hence the name).

Owns the pairing of weights with their scales and the dequantization, done at load into full
precision (fp32 here; the loader then casts to the engine dtype): the model runs on dequantized
weights, so an FP8 checkpoint costs the memory of a bf16 one. It never guesses: an FP8 weight
without its scale, a scale without its weight, a scale grid of the wrong shape, or an FP8 weight in
a module the config says is not converted is an error naming the tensor.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from cuttle.engine.config import Fp8BlockQuant

_SCALE = "_scale_inv"  # "<module>.weight_scale_inv" beside "<module>.weight"


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W8 [..., r, c] x per-block S [..., ceil(r/b0), ceil(c/b1)] -> fp32 [..., r, c] (edge blocks
    cropped, as the quantizer padded them)."""
    r, c = weight.shape[-2:]
    b0, b1 = block
    want = (*weight.shape[:-2], -(-r // b0), -(-c // b1))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale grid {tuple(scale_inv.shape)} does not fit weight {tuple(weight.shape)} in blocks of {b0}x{b1} (expected {want})")
    s = scale_inv.float().repeat_interleave(b0, dim=-2).repeat_interleave(b1, dim=-1)[..., :r, :c]
    return weight.float() * s


def dequantized_tensors(tensors: Iterable[tuple[str, torch.Tensor]], quant: Fp8BlockQuant, source: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every FP8 weight replaced by its dequantized fp32 value and the
    scales consumed; everything else passes through unchanged. A weight and its scale may come in
    any order (or shard): the first of a pair waits for the other."""
    weights: dict[str, torch.Tensor] = {}  # FP8 weights waiting for their scale
    scales: dict[str, torch.Tensor] = {}  # scales waiting for their weight, by weight name
    for name, t in tensors:
        if name.endswith(".weight" + _SCALE):
            wname = name[: -len(_SCALE)]
            if not t.is_floating_point() or t.dtype.itemsize < 2:
                raise ValueError(f"tensor {name!r} in {source!r} is {t.dtype}; FP8 block scales are fp32, bf16 or fp16")
            if wname in weights:
                yield wname, _dequantize(wname, weights.pop(wname), t, quant)
            else:
                scales[name[: -len(_SCALE)]] = t
        elif t.dtype == torch.float8_e4m3fn:
            _check_converted(name, quant, source)
            if name in scales:
                yield name, _dequantize(name, t, scales.pop(name), quant)
            else:
                weights[name] = t
        elif t.dtype in (torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
            raise ValueError(f"tensor {name!r} in {source!r} is {t.dtype}; FP8 block checkpoints hold float8_e4m3fn weights")
        else:
            yield name, t
    if weights:
        raise ValueError(f"FP8 weights in {source!r} have no weight_scale_inv: {sorted(weights)[:8]}")
    if scales:
        raise ValueError(
            f"weight_scale_inv tensors in {source!r} have no FP8 weight beside them: {sorted(n + _SCALE for n in scales)[:8]}"
        )


def _dequantize(name: str, weight: torch.Tensor, scale_inv: torch.Tensor, quant: Fp8BlockQuant) -> torch.Tensor:
    try:
        return dequantize_block_fp8(weight, scale_inv, quant.block)
    except ValueError as err:
        raise ValueError(f"tensor {name!r}: {err}") from None


def _check_converted(name: str, quant: Fp8BlockQuant, source: str) -> None:
    module = name.rsplit(".", 1)[0]
    for ignored in quant.ignored:
        # transformers matches a listed name against the module name, whole or as its last parts
        if module == ignored or module.endswith("." + ignored):
            raise ValueError(f"tensor {name!r} in {source!r} is FP8, but quantization_config lists {ignored!r} as not converted")
