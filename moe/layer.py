"""The MoE layer the engine's models call: router + routed experts, tokens in, tokens out.

Owns the routed-expert weights (stacked per expert), the router weight and, for sigmoid routers,
the expert-choice bias. Shared experts and dense MLPs belong to the model (`cuttle.moe.shared`
has a helper). Must never import from `cuttle.engine`.

Parameter layout (the engine's loader fills these from HF tensors):
  gate_weight             [E, H]          router logits = x @ gate_weight.T
  w13                     [E, 2*I, H]     gate_proj rows first, then up_proj rows (HF gate_up_proj)
  w2                      [E, H, I]       down_proj
  e_score_correction_bias [E] float32     only when routing.scoring_func == "sigmoid" (DeepSeek-V3)
  gate_bias, w13_bias, w2_bias [E], [E, 2*I], [E, H]   only with bias=True (gpt-oss): the router's
                                          logits bias and each expert's biases after its GEMMs

gpt-oss layers (biases, `ClampedSwiGLU`): on CPU `pack_` packs them in the widening layouts
(fp32 / bf16 / MXFP8 panels; not the AVX512-BF16 dot ones) and the native kernel adds the biases and
applies the clamped activation in its epilogues (`native_moe.Epilogue`); elsewhere (CUDA, autograd,
without the kernel library) they run the torch expert path, the Triton kernels having no biases.

MXFP8 experts: after loading, `layer.quantize_("mxfp8")` replaces the parameters w13 / w2 with the
buffers w13_mx / w13_scale / w2_mx / w2_scale (E4M3 data, E8M0 scales, blocks of 32 along the
reduction dim H for w13 and I for w2); a checkpoint saved already quantized fills those buffers
through `load_quantized_(tensors)` (names and file format: `cuttle.moe.checkpoint`).
Forward then runs the Triton grouped GEMM on CUDA and the torch dequantizing path elsewhere.

On CPU, plain fp32/bf16 experts take the native path (`experts_native`: routing and the whole
expert computation in native calls, weights packed once and repacked after any write) when the
CPU kernel library is loaded, MXFP8 experts too (their E4M3 bytes and E8M0 scales packed into
the same panels, decoded in registers); the torch path is the reference and the fallback.

Packed-only layers (`pack_`, what the engine does at load and after every weight update): the
experts are then held only in the kernels' panel layout (`packed`); the plain parameters (or MXFP8
buffers) are dropped, so expert memory is not doubled. The torch path, which a packed layer still
takes under autograd or with the native path switched off, unpacks the layer's experts per call
(an exact permutation, one layer at a time); `unpack_` restores the plain tensors for good (the
loader does before it writes weights). A layer never packed keeps its plain tensors and a lazily
made packed copy beside them (`experts_native` caches it on the tensor), as standalone use expects.
"""
from __future__ import annotations

from typing import Literal, Mapping

import torch
from torch import nn

from cuttle.attention.native import moe as native_moe
from cuttle.moe import experts_native
from cuttle.moe.experts_torch import ClampedSwiGLU, ExpertWeight, fused_experts_torch
from cuttle.moe.mxfp8 import MXTensor, ScaleMode, quantize_mxfp8
from cuttle.moe.routing import RoutingConfig, route, router_logits

QUANTIZED_NAMES = ("w13_mx", "w13_scale", "w2_mx", "w2_scale")


def _quantize_per_expert(w: torch.Tensor, scale_mode: ScaleMode) -> MXTensor:
    """Quantize [E, N, K] one expert at a time, so the temporaries stay one expert big."""
    E, N, K = w.shape
    data = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(E, N, K // 32, dtype=torch.float8_e8m0fnu, device=w.device)
    for e in range(E):
        data[e], scale[e] = quantize_mxfp8(w[e], 32, scale_mode)
    return MXTensor(data, scale)


class FusedMoE(nn.Module):
    """Routed experts of one decoder layer: x [T, H] -> sum over the top-k experts of weight * SwiGLU(x)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, routing: RoutingConfig, dtype: torch.dtype,
        bias: bool = False, activation: ClampedSwiGLU | None = None,
    ) -> None:
        super().__init__()
        E = routing.num_experts
        self.routing = routing
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_weight = nn.Parameter(torch.empty(E, hidden_size, dtype=dtype), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(E, 2 * intermediate_size, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, hidden_size, intermediate_size, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias: nn.Parameter | None = None
        if routing.scoring_func == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False)
        self.gate_bias = self.w13_bias = self.w2_bias = None
        if bias:
            self.gate_bias = nn.Parameter(torch.empty(E, dtype=dtype), requires_grad=False)
            self.w13_bias = nn.Parameter(torch.empty(E, 2 * intermediate_size, dtype=dtype), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(E, hidden_size, dtype=dtype), requires_grad=False)
        self.activation = activation  # None: silu(gate) * up
        self.quant: Literal["mxfp8"] | None = None
        self.act_quant: ScaleMode | None = None
        self.packed: native_moe.PackedExperts | None = None  # set by pack_: then the only copy of the experts

    def quantize_(
        self, mode: Literal["mxfp8"] = "mxfp8", scale_mode: ScaleMode = "floor", activations: bool = False
    ) -> None:
        """Quantize the loaded expert weights in place; `activations` also rounds GEMM inputs to MXFP8."""
        if mode != "mxfp8":
            raise ValueError(f"unsupported MoE quantization {mode!r}")
        self.unpack_()
        w13 = _quantize_per_expert(self.w13.data, scale_mode)
        self._set_quantized(w13, _quantize_per_expert(self.w2.data, scale_mode))
        self.act_quant = scale_mode if activations else None

    def load_quantized_(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take already-quantized experts: `tensors` holds QUANTIZED_NAMES (E4M3 data, E8M0 scales)."""
        w13 = MXTensor(tensors["w13_mx"], tensors["w13_scale"])
        w2 = MXTensor(tensors["w2_mx"], tensors["w2_scale"])
        E, I, H = self.routing.num_experts, self.intermediate_size, self.hidden_size
        if w13.shape != (E, 2 * I, H) or w2.shape != (E, H, I):
            raise ValueError(f"quantized experts {tuple(w13.shape)}, {tuple(w2.shape)} do not fit E={E} H={H} I={I}")
        self._set_quantized(w13, w2)

    def _set_quantized(self, w13: MXTensor, w2: MXTensor) -> None:
        device = self.gate_weight.device
        self.packed = None  # replaced wholesale
        # Dropping the bf16 parameters is the point: only the MXFP8 copy stays resident.
        for name in ("w13", "w2"):
            if name in self._parameters:
                del self._parameters[name]
        self.register_buffer("w13_mx", w13.data.to(device))
        self.register_buffer("w13_scale", w13.scale.to(device))
        self.register_buffer("w2_mx", w2.data.to(device))
        self.register_buffer("w2_scale", w2.scale.to(device))
        self.quant = "mxfp8"

    def pack_(self) -> bool:
        """Hold the experts only in the native kernels' panel layout from now on: packed here, once
        (not at the first forward), and the plain copy dropped. Returns False, changing nothing,
        where the native path could not run them: kernel library not loaded or switched off, not
        on CPU, activation quantization, weights that need gradients or are not contiguous."""
        if self.packed is not None:
            return True
        if not native_moe.available() or self.act_quant is not None:
            return False
        dot = self.plain_swiglu  # gpt-oss's epilogues run on the widening layouts only
        w13, w2 = self.expert_weights()
        if isinstance(w13, MXTensor) and isinstance(w2, MXTensor):
            if w13.data.device.type != "cpu" or w2.data.device.type != "cpu":
                return False
            # the layer's activations are in its router's dtype: the dot layout only for bf16 ones
            self.packed = native_moe.pack_mxfp8((w13.data, w13.scale), (w2.data, w2.scale),
                                                act_dtype=self.gate_weight.dtype if dot else None)
            for name in QUANTIZED_NAMES:
                del self._buffers[name]
            return True
        if (w13.device.type != "cpu" or w13.requires_grad or w2.requires_grad or w13.dtype not in native_moe.WEIGHT_FORMAT
                or not w13.is_contiguous() or not w2.is_contiguous()):
            return False
        self.packed = native_moe.pack(w13, w2, dot=dot)
        del self._parameters["w13"], self._parameters["w2"]
        return True

    def unpack_(self) -> None:
        """Back to plain tensors (bit-exact: packing is a permutation), e.g. before weights are written."""
        if self.packed is None:
            return
        w13, w2 = native_moe.unpack(self.packed)
        self.packed = None
        if self.quant == "mxfp8":
            for name, t in zip(QUANTIZED_NAMES, (*w13, *w2)):
                self.register_buffer(name, t)
        else:
            self.w13 = nn.Parameter(w13, requires_grad=False)
            self.w2 = nn.Parameter(w2, requires_grad=False)

    # state_dict / load_state_dict see a packed layer as the unpacked one (same names, same bytes),
    # so copying weights between models does not depend on which of them packed its experts
    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[override]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.packed is not None:
            w13, w2 = self.expert_weights()
            if isinstance(w13, MXTensor) and isinstance(w2, MXTensor):
                named = zip(QUANTIZED_NAMES, (w13.data, w13.scale, w2.data, w2.scale))
            else:
                named = zip(("w13", "w2"), (w13, w2))
            for name, t in named:
                destination[prefix + name] = t

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        if self.packed is None:
            return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.unpack_()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.pack_()

    def expert_weights(self) -> tuple[ExpertWeight, ExpertWeight]:
        """The experts as plain tensors (or `MXTensor`s); for a packed layer, fresh unpacked copies."""
        if self.packed is not None:
            w13, w2 = native_moe.unpack(self.packed)
            return (MXTensor(*w13), MXTensor(*w2)) if self.quant == "mxfp8" else (w13, w2)
        if self.quant == "mxfp8":
            return MXTensor(self.w13_mx, self.w13_scale), MXTensor(self.w2_mx, self.w2_scale)
        return self.w13, self.w2

    def expert_weight_bytes(self) -> int:
        """Resident bytes of the routed-expert weights (data + scales; the panels when packed,
        padding rows included)."""
        if self.packed is not None:
            return self.packed.nbytes()
        w13, w2 = self.expert_weights()
        if isinstance(w13, MXTensor):
            return w13.nbytes() + w2.nbytes()
        return sum(w.numel() * w.element_size() for w in (w13, w2))

    @property
    def plain_swiglu(self) -> bool:
        """Whether the experts are silu(gate) * up without biases (what the native and Triton
        kernels compute); gpt-oss's are not."""
        return self.w13_bias is None and self.activation is None

    def epilogue(self, x: torch.Tensor) -> native_moe.Epilogue | None:
        """gpt-oss's biases and activation for the native kernel, in x's dtype (None: plain SwiGLU)."""
        if self.plain_swiglu:
            return None
        b13, b2 = self.w13_bias, self.w2_bias
        clamp = (self.activation.alpha, self.activation.limit) if self.activation is not None else None
        return native_moe.Epilogue(None if b13 is None else b13.to(x.dtype).contiguous(),
                                   None if b2 is None else b2.to(x.dtype).contiguous(), clamp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.plain_swiglu:
            if self.packed is not None and experts_native.supports_packed(x, self.gate_weight, self.packed):
                return experts_native.fused_moe_native(x, self.gate_weight, self.packed, None, self.routing,
                                                       self.e_score_correction_bias, self.gate_bias, self.epilogue(x))
            return self._forward_torch(x)
        if self.packed is not None:
            if experts_native.supports_packed(x, self.gate_weight, self.packed):
                return experts_native.fused_moe_native(x, self.gate_weight, self.packed, None, self.routing, self.e_score_correction_bias)
            return self._forward_torch(x)
        if self.quant is None and experts_native.supports(x, self.gate_weight, self.w13, self.w2):
            return experts_native.fused_moe_native(x, self.gate_weight, self.w13, self.w2, self.routing, self.e_score_correction_bias)
        if self.quant == "mxfp8" and self.act_quant is None:
            w13, w2 = self.expert_weights()
            if experts_native.supports_mxfp8(x, self.gate_weight, w13, w2):  # MXFP8 bytes read by the native panels
                return experts_native.fused_moe_native(x, self.gate_weight, w13, w2, self.routing, self.e_score_correction_bias)
        return self._forward_torch(x)

    def _forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The reference path (Triton on CUDA): under autograd, activation quantization, without the
        native kernels, and gpt-oss's experts everywhere. A packed layer's experts are unpacked
        for the call."""
        logits = router_logits(x, self.gate_weight, self.routing, self.gate_bias)
        weights, ids = route(logits, self.routing, self.e_score_correction_bias)
        w13, w2 = self.expert_weights()
        if not self.plain_swiglu:
            return fused_experts_torch(x, w13, w2, weights, ids, act_quant=self.act_quant, b13=self.w13_bias,
                                       b2=self.w2_bias, activation=self.activation)
        if x.is_cuda:
            from cuttle.moe.experts_triton import fused_experts_triton

            return fused_experts_triton(x, w13, w2, weights, ids, act_quant=self.act_quant)
        return fused_experts_torch(x, w13, w2, weights, ids, act_quant=self.act_quant)
