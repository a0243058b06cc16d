"""gpt-oss checkpoints (GptOssForCausalLM): the layout of their routed experts, and their MXFP4 experts.

transformers' names for a layer's routed experts, under `model.layers.N.mlp.experts.`:

  gate_up_proj        [E, H, 2I]   columns interleaved: gate 0, up 0, gate 1, up 1, ...
  gate_up_proj_bias   [E, 2I]      interleaved the same way
  down_proj           [E, I, H]
  down_proj_bias      [E, H]

(the router is `mlp.router.{weight,bias}`). The engine's `FusedMoE` holds w13 [E, 2I, H] (the gate's
rows, then the up projection's) and w2 [E, H, I]; `to_engine` and `to_hf` convert one tensor either
way, exact permutations.

The released checkpoints store the two expert weights in MXFP4 (config.json's quantization_config
`quant_method: "mxfp4"`): `<name>_blocks` [E, out, in / 32, 16] uint8, two E2M1 codes a byte (the
low nibble first), and `<name>_scales` [E, out, in / 32] uint8, E8M0 exponents (bias 127).
`mxfp4_tensors` turns each pair into the transformers tensor it stands for, dequantized as
transformers dequantizes it. Exact: an E2M1 value times a power of two is a bf16 value. With
`moe_quant="mxfp8"` the experts are then quantized again, also exactly (test_gpt_oss checks it).
Each block's largest E2M1 magnitude is 1 or 1.5 times a power of two. The MXFP8 block scale puts
that value at 256 or 384, and every E2M1 value of the block at an E4M3 value.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

# E2M1 codes 0..15 -> values (sign bit 3)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_PACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)$")


def to_engine(part: str, t: torch.Tensor) -> torch.Tensor:
    """A transformers expert tensor (`part`: gate_up_proj, gate_up_proj_bias, down_proj or
    down_proj_bias) in the engine's layout: w13 [E, 2I, H], w13_bias [E, 2I], w2 [E, H, I], w2_bias."""
    if part == "gate_up_proj":
        t = t.transpose(1, 2)  # [E, 2I, H], rows interleaved
        return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)
    if part == "gate_up_proj_bias":
        return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)
    if part == "down_proj":
        return t.transpose(1, 2).contiguous()
    return t


def to_hf(part: str, t: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_engine` (a new tensor for the weights, `t` itself for down_proj_bias)."""
    if part in ("gate_up_proj", "gate_up_proj_bias"):
        half = t.shape[1] // 2
        inter = torch.stack((t[:, :half], t[:, half:]), dim=2).flatten(1, 2)  # rows gate 0, up 0, gate 1, ...
        return inter.transpose(1, 2).contiguous() if part == "gate_up_proj" else inter
    if part == "down_proj":
        return t.transpose(1, 2).contiguous()
    return t


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G * 32] bf16: code j of a block
    is the low nibble of byte j // 2 when j is even, its high nibble when odd; times 2^(scale - 127)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)} "
                         "(blocks [..., G, 16], scales [..., G])")
    if bool((scales == 255).any()):
        raise ValueError(f"{name}: an E8M0 scale of 255 (NaN) in its MXFP4 scales")
    lut = torch.tensor(_E2M1, dtype=torch.float32)
    out = torch.empty(*scales.shape[:-1], scales.shape[-1] * 32, dtype=torch.bfloat16)
    for i in range(blocks.shape[0]):  # one expert at a time: the temporaries stay one expert big
        codes = torch.stack((blocks[i] & 0x0F, blocks[i] >> 4), dim=-1).flatten(-2).long()  # [..., G, 32]
        out[i] = (lut[codes] * torch.exp2(scales[i].float() - 127.0)[..., None]).flatten(-2)
    return out


def mxfp4_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensor stream with each MXFP4 pair (`<name>_blocks`, `<name>_scales`)
    replaced by `<name>` in transformers' layout (gate_up_proj [E, H, 2I], down_proj [E, I, H]),
    dequantized; the other tensors pass through. A half of a pair held until its other half
    comes; one never completed is an error naming it."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        m = _PACKED.match(name)
        if m is None:
            yield name, t
            continue
        base, kind = m.group(1), m.group(2)
        pair = pending.setdefault(base, {})
        pair[kind] = t
        if len(pair) == 2:
            del pending[base]
            # [E, out, in] -> transformers' [E, in, out] (a view; `to_engine` transposes it back)
            yield base, dequantize_mxfp4(pair["blocks"], pair["scales"], base).transpose(1, 2)
    if pending:
        missing = [f"{base}_{'scales' if 'blocks' in pair else 'blocks'}" for base, pair in pending.items()]
        raise ValueError(f"MXFP4 checkpoint lacks {missing[:4]}{' ...' if len(missing) > 4 else ''} (each *_blocks needs its *_scales)")
