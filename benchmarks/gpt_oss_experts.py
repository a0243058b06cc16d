"""gpt-oss's routed experts on this CPU: the native path (biases and the clamped SwiGLU in the
kernel's epilogues, `moe_experts_ep`) against the torch expert path, bf16 and MXFP8 weights.

    python benchmarks/gpt_oss_experts.py                 # gpt-oss-20b's expert shape: hidden 2880,
                                                         # expert width 2880, top-4, 8 experts
    python benchmarks/gpt_oss_experts.py --experts 32    # all of gpt-oss-20b's (a 5 GB bf16 layer)

One layer, random weights. For each batch: tokens/s of each path and the native/torch ratio, and
the native path as a fraction of the memory-bandwidth limit measured in this run (tokens / (bytes
of the experts the batch touches / copy bandwidth)). 8 experts by default, so the layer fits
beside the rest on a small machine; at batch 1 a token touches its 4 experts either way.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import best_seconds, copy_bandwidth_gbs, machine_info, markdown_table  # noqa: E402

from cuttle.attention.native import moe as native_moe  # noqa: E402
from cuttle.moe import FusedMoE, RoutingConfig  # noqa: E402
from cuttle.moe.experts_torch import ClampedSwiGLU  # noqa: E402


def make_layer(H: int, I: int, E: int, k: int, quant: str | None) -> FusedMoE:
    layer = FusedMoE(H, I, RoutingConfig.from_hf({"model_type": "gpt_oss", "num_local_experts": E, "num_experts_per_tok": k}),
                     torch.bfloat16, bias=True, activation=ClampedSwiGLU())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (layer.gate_weight, layer.w13, layer.w2):
            for e in range(p.shape[0]):  # (one expert at a time: no fp32 copy of the layer)
                p[e].copy_(torch.randn(p.shape[1:], generator=g) * 0.02)
        for b in (layer.gate_bias, layer.w13_bias, layer.w2_bias):
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    if quant:
        layer.quantize_("mxfp8")
    return layer


def touched_bytes(layer: FusedMoE, x: torch.Tensor) -> int:
    """Bytes of the experts this batch routes to (weights and scales as held)."""
    from cuttle.moe.routing import route, router_logits

    _, ids = route(router_logits(x, layer.gate_weight, layer.routing, layer.gate_bias), layer.routing)
    per_expert = layer.expert_weight_bytes() / layer.routing.num_experts
    return int(per_expert * len(set(ids.flatten().tolist())))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--inter", type=int, default=2880)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 32])
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args()
    if not native_moe.available():
        sys.exit("the native MoE kernels are not available here (CPU kernel library not built, or CUTTLE_MOE_NATIVE=0)")
    bw = copy_bandwidth_gbs()
    print(f"machine: {machine_info()}; copy bandwidth {bw:.1f} GB/s; threads {torch.get_num_threads()}")
    rows = []
    for quant in (None, "mxfp8"):
        layer = make_layer(args.hidden, args.inter, args.experts, args.topk, quant)
        for T in args.batches:
            x = torch.randn(T, args.hidden, generator=torch.Generator().manual_seed(T)).bfloat16()
            with torch.inference_mode():
                t_torch = best_seconds(lambda: layer._forward_torch(x), args.iters)
                assert layer.pack_()
                t_native = best_seconds(lambda: layer(x), args.iters)
                nbytes = touched_bytes(layer, x)
                layer.unpack_()
            limit = T / (nbytes / (bw * 1e9))
            rows.append([quant or "bf16", T, f"{T / t_torch:.1f}", f"{T / t_native:.1f}", f"{t_torch / t_native:.2f}",
                         f"{nbytes / 1e6:.0f}", f"{(T / t_native) / limit:.2f}"])
            print(rows[-1], flush=True)
    print()
    print(markdown_table(["experts", "batch", "torch tok/s", "native tok/s", "native / torch", "MB touched",
                          "native of bandwidth limit"], rows))


if __name__ == "__main__":
    main()
