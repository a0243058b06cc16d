"""MXFP8 linear layers of the engine's models (`EngineConfig.quantization="mxfp8"`, vLLM's flag).

Owns three steps: replacing every attention and dense-MLP projection of a freshly built model by an
`MXLinearWeight` (E4M3 data + E8M0 block scales, blocks of 32 along the input dim, no high-
precision copy) before any weight arrives (`prepare_quantized_linears`); writing a high-precision
tensor into one (`write_quantized_linear`: cast to the model dtype, then `quantize_mxfp8`, floor
scales, as the routed experts are quantized; rows are independent, so q_proj alone gives the same
bytes as the fused q|k|v), which the loader and `update_weights` both call; and the forward
(`linear`): the native MXFP8 GEMM (`cuttle.attention.native.mxfp8`) on CPU, the torch reference
(dequantize, then `F.linear`) elsewhere, under autograd, or without the kernel library.

The lm_head joins them only on request (`quantize_lm_head`, `EngineConfig.quantize_lm_head`): a
separate lm_head is replaced like the projections (no high-precision copy); a tied one keeps the
embedding in the model dtype for the token lookup and gets an MXFP8 copy of it for the logits,
derived from the embedding (`tie_to`: requantized whenever the embedding's version changes, so an
update through either name reaches both), at vocab x hidden x 8.25 bits beside the embedding.

What stays in the model dtype: the embedding, the lm_head unless asked, norms, biases, routers and
shared experts. Routed experts are `moe_quant`'s (the loader quantizes them too under
`quantization="mxfp8"`). NSA and MLA attention are refused (their extra projections are not
covered). Never touches checkpoint names: the loader routes tensors here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from cuttle.attention.native import gemm, mxfp8
from cuttle.engine.config import QUANTIZATION_MODES  # one list: EngineConfig validates against it too
from cuttle.moe.mxfp8 import dequantize_mxfp8, quantize_mxfp8

if TYPE_CHECKING:
    from cuttle.engine.models.transformer import CausalLM

_SCALE_MODE = "floor"  # the OCP spec's rule, as for the routed experts (moe_quant)


class MXLinearWeight(nn.Module):
    """An [N, K] linear weight held in MXFP8: buffers `data` (float8_e4m3fn [N, K]) and `scale`
    (float8_e8m0fnu [N, K/32]); `dtype` is the model dtype the weight is quantized from."""

    def __init__(self, n: int, k: int, dtype: torch.dtype, name: str = "weight") -> None:
        super().__init__()
        if k % 32 != 0:
            raise ValueError(f"quantization='mxfp8': {name} has input dim {k}, not a multiple of the MX block size 32")
        self.register_buffer("data", torch.empty(n, k, dtype=torch.float8_e4m3fn))
        self.register_buffer("scale", torch.empty(n, k // 32, dtype=torch.float8_e8m0fnu))
        self.dtype = dtype
        # a tied lm_head's source (the embedding) and the (version, pointer) its bytes were made
        # from; kept in a tuple so nn.Module does not register the embedding a second time
        self.tied: tuple[torch.Tensor] | None = None
        self.tied_key: tuple[int, int] | None = None

    def tie_to(self, source: torch.Tensor) -> None:
        """Make this weight the MXFP8 copy of `source` (a tied lm_head's embedding), kept in step
        with it by `refresh`."""
        if tuple(source.shape) != tuple(self.data.shape):
            raise ValueError(f"tied MXFP8 weight {tuple(self.data.shape)} cannot copy a {tuple(source.shape)} tensor")
        self.tied, self.tied_key = (source,), None

    def refresh(self) -> bool:
        """Requantize a tied weight whose source changed since (an in-place write bumps the
        version); returns whether it did. Untied weights are written by the loader instead."""
        if self.tied is None:
            return False
        src = self.tied[0]
        key = (src._version, src.data_ptr())
        if key == self.tied_key:
            return False
        write_quantized_linear(self, src.detach())
        self.tied_key = key
        return True

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def nbytes(self) -> int:
        return self.data.numel() + self.scale.numel()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_mxfp8(self.data, self.scale, 32, dtype)


def linear(x: torch.Tensor, weight: torch.Tensor | MXLinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The models' linear layer: MXFP8 weights through `mxfp8_linear`, the rest through
    `native.gemm.linear` (which itself falls back to `F.linear`)."""
    if not isinstance(weight, MXLinearWeight):
        return gemm.linear(x, weight, bias)
    weight.refresh()  # a tied lm_head whose embedding was written since (normally done at load / update)
    native = (
        x.device.type == "cpu" and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16) and mxfp8.available()
        and not (torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)))
    )
    if native:
        return mxfp8.linear(x, weight.data, weight.scale, bias)
    return reference_linear(x, weight, bias)


def reference_linear(x: torch.Tensor, weight: MXLinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch MXFP8 path: dequantize exactly to x's dtype, then `F.linear` (the kernel's oracle)."""
    return F.linear(x, weight.dequantize(x.dtype), bias)


def dense_linear(x: torch.Tensor, weight: torch.Tensor | MXLinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The training / scoring path's linear (`CausalLM.forward_masked`): `F.linear` on any leading
    dims under autograd; an MXFP8 weight goes through `reference_linear`, so gradients reach x (the
    quantized weight itself is a buffer and takes none: training in MXFP8 is the trainer's STE on
    high-precision master weights, `cuttle.moe.mxfp8.fake_quantize_ste`)."""
    if isinstance(weight, MXLinearWeight):
        weight.refresh()
        return reference_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_slots(model: CausalLM) -> list[tuple[nn.Module, str, str]]:
    """(module, attribute, engine parameter name) of every linear weight `quantization` covers (the
    lm_head aside); the trainer quantizes the same ones on the fly (`cuttle.rl.trainer`)."""
    from cuttle.engine.models.transformer import Attention, DenseMLP, GeluMLP, NSAAttention

    slots: list[tuple[nn.Module, str, str]] = []
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        if isinstance(attn, NSAAttention) or not isinstance(attn, Attention):
            raise ValueError(f"quantization='mxfp8' covers plain attention and dense MLP layers; layer {i} has "
                             f"{type(attn).__name__} (NSA and MLA models are not supported)")
        slots += [(attn, "qkv_weight", f"layers.{i}.attn.qkv_weight"), (attn, "o_weight", f"layers.{i}.attn.o_weight")]
        if isinstance(layer.mlp, DenseMLP):
            slots += [(layer.mlp, "gate_up_weight", f"layers.{i}.mlp.gate_up_weight"),
                      (layer.mlp, "down_weight", f"layers.{i}.mlp.down_weight")]
        if isinstance(layer.mlp, GeluMLP):
            slots += [(layer.mlp, "fc_weight", f"layers.{i}.mlp.fc_weight"), (layer.mlp, "proj_weight", f"layers.{i}.mlp.proj_weight")]
    return slots


def prepare_quantized_linears(model: CausalLM, mode: str = "mxfp8", lm_head: bool = False) -> None:
    """Replace each covered linear parameter by an (unfilled) `MXLinearWeight` of its shape;
    `lm_head` also the lm_head (a tied one becomes an MXFP8 copy of the embedding, see `tie_to`)."""
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}; got {mode!r}")
    slots = linear_slots(model)
    if lm_head and not isinstance(model.lm_head, MXLinearWeight):
        slots.append((model, "lm_head", "lm_head"))
    for module, attr, name in slots:
        p = getattr(module, attr)
        if isinstance(p, MXLinearWeight):
            continue
        n, k = p.shape
        mx_weight = MXLinearWeight(n, k, p.dtype, name)
        tied = module is model and model.cfg.tie_word_embeddings
        del module._parameters[attr]  # the point: no high-precision copy stays resident (a tied lm_head's is the embedding)
        setattr(module, attr, mx_weight.to(p.device))
        if tied:
            mx_weight.tie_to(model.embed)


def quantized_linears(model: CausalLM) -> dict[str, MXLinearWeight]:
    """Engine parameter name (e.g. `layers.0.attn.qkv_weight`, `lm_head`) -> its MXFP8 weight, for
    every linear that `prepare_quantized_linears` replaced."""
    out: dict[str, MXLinearWeight] = {}
    if isinstance(model.lm_head, MXLinearWeight):
        out["lm_head"] = model.lm_head
    for i, layer in enumerate(model.layers):
        for owner, prefix in ((layer.attn, "attn"), (layer.mlp, "mlp")):
            for attr, mod in owner.named_children():
                if isinstance(mod, MXLinearWeight):
                    out[f"layers.{i}.{prefix}.{attr}"] = mod
    return out


def write_quantized_linear(weight: MXLinearWeight, src: torch.Tensor, rows: slice | None = None,
                           check_only: bool = False) -> int:
    """Quantize a high-precision `src` (all rows, or `rows` of the fused weight) into `weight`;
    returns the number of elements written. Raises on a shape mismatch; `check_only`: only that."""
    data, scale = (weight.data, weight.scale) if rows is None else (weight.data[rows], weight.scale[rows])
    if tuple(data.shape) != tuple(src.shape):
        raise ValueError(f"tensor has shape {tuple(src.shape)}, the MXFP8 weight expects {tuple(data.shape)}")
    if check_only:
        return src.numel()
    with torch.no_grad():
        q, q_scale = quantize_mxfp8(src.to(device=data.device, dtype=weight.dtype), 32, _SCALE_MODE)
        data.copy_(q)
        scale.copy_(q_scale)
    return src.numel()


def refresh_tied(model: CausalLM) -> None:
    """Bring a tied MXFP8 lm_head in step with the embedding now (after a load or a weight update),
    so that no request pays for it; `linear` would otherwise do it at the next logits."""
    if isinstance(model.lm_head, MXLinearWeight):
        model.lm_head.refresh()
