"""MoE layer benchmark: bf16 vs MXFP8 experts, on this CPU and (when present) the GPU kernels.

    python benchmarks/moe.py                      # Qwen3-30B-A3B layer: hidden 2048, expert width 768,
                                                  # 128 experts, top-8, bf16; batches 1, 16, 256
    python benchmarks/moe.py --experts 32 --iters 2   # a smaller, quicker run

CPU table: one FusedMoE layer's tokens/s (torch path) with bf16 experts and with MXFP8 experts
(dequantized one active expert at a time), their ratio, and each as a fraction of the memory-bandwidth
limit measured in this run: tokens / (bytes of the experts this batch touches / copy bandwidth).
GPU table (CUDA only, "not run" otherwise): the Triton grouped-GEMM expert path, bf16 vs MXFP8
weights (dot_scaled on sm100+, in-kernel dequantization elsewhere), against the torch path on the
same GPU, and as a fraction of the copy bandwidth measured there.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import copy_bandwidth_gbs, machine_info, markdown_table  # noqa: E402

from cuttle.moe import FusedMoE, RoutingConfig  # noqa: E402
from cuttle.moe.routing import route, router_logits  # noqa: E402


def random_layer(H: int, I: int, E: int, k: int, device: str, seed: int = 0) -> FusedMoE:
    layer = FusedMoE(H, I, RoutingConfig(E, k, True), torch.bfloat16).to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    for p in (layer.gate_weight, layer.w13, layer.w2):
        p.data.normal_(0.0, 0.02, generator=g)
    return layer


def clone_quantized(layer: FusedMoE) -> FusedMoE:
    """An MXFP8 copy sharing the router weight; the bf16 layer stays usable."""
    q = FusedMoE(layer.hidden_size, layer.intermediate_size, layer.routing, torch.bfloat16).to(layer.gate_weight.device)
    q.load_state_dict(layer.state_dict())
    q.quantize_("mxfp8")
    return q


def touched_bytes(layer: FusedMoE, x: torch.Tensor) -> int:
    """Expert weight bytes one forward of `x` must read: the distinct experts its tokens route to."""
    _, ids = route(router_logits(x, layer.gate_weight, layer.routing), layer.routing)
    distinct = int(torch.unique(ids).numel())
    return layer.expert_weight_bytes() * distinct // layer.routing.num_experts


def best_seconds(fn: Callable[[], object], iters: int, sync: Callable[[], None] = lambda: None) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def cpu_rows(args: argparse.Namespace, bandwidth: float) -> list[list[object]]:
    layer = random_layer(args.hidden, args.inter, args.experts, args.topk, "cpu")
    quantized = clone_quantized(layer)
    rows = []
    with torch.no_grad():
        for batch in args.batches:
            x = torch.randn(batch, args.hidden, generator=torch.Generator().manual_seed(batch)).bfloat16()
            t_bf16 = best_seconds(lambda: layer(x), args.iters)
            t_mx = best_seconds(lambda: quantized(x), args.iters)
            limit_bf16 = touched_bytes(layer, x) / (bandwidth * 1e9)
            limit_mx = touched_bytes(quantized, x) / (bandwidth * 1e9)
            rows.append([batch, batch / t_bf16, batch / t_mx, t_bf16 / t_mx, limit_bf16 / t_bf16, limit_mx / t_mx])
    return rows


def gpu_rows(args: argparse.Namespace) -> list[list[object]]:
    from cuttle.moe.experts_torch import fused_experts_torch
    from cuttle.moe.grouped_gemm_triton import has_mx_tensor_cores

    device = torch.device("cuda")
    bandwidth = gpu_copy_bandwidth_gbs()
    layer = random_layer(args.hidden, args.inter, args.experts, args.topk, "cuda")
    quantized = clone_quantized(layer)
    sync = torch.cuda.synchronize
    kind = "dot_scaled" if has_mx_tensor_cores(device) else "in-kernel dequant"
    rows = []
    with torch.no_grad():
        for batch in args.gpu_batches:
            x = torch.randn(batch, args.hidden, device=device, dtype=torch.bfloat16)
            weights, ids = route(router_logits(x, layer.gate_weight, layer.routing), layer.routing)
            t_torch = best_seconds(lambda: fused_experts_torch(x, layer.w13, layer.w2, weights, ids), args.iters, sync)
            t_bf16 = best_seconds(lambda: layer(x), args.iters, sync)
            t_mx = best_seconds(lambda: quantized(x), args.iters, sync)
            limit_mx = touched_bytes(quantized, x) / (bandwidth * 1e9)
            rows.append([batch, batch / t_torch, batch / t_bf16, batch / t_mx, t_bf16 / t_mx, limit_mx / t_mx, kind])
    return rows


def gpu_copy_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    src = torch.ones(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / best_seconds(lambda: dst.copy_(src), repeats, torch.cuda.synchronize) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--gpu-batches", type=int, nargs="+", default=[1, 16, 256, 4096])
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args()

    info = machine_info()
    shape = f"hidden {args.hidden}, expert width {args.inter}, {args.experts} experts, top-{args.topk}"
    print(f"# MoE layer: bf16 vs MXFP8 experts ({shape})\n")
    print(f"{info['cpu']}, {info['threads']} threads, torch {info['torch']}, {info['date']}\n")
    bandwidth = copy_bandwidth_gbs(nbytes=1 << 28)
    print(f"## CPU (torch path), copy bandwidth {bandwidth:.1f} GB/s\n")
    print(markdown_table(
        ["batch", "bf16 tok/s", "MXFP8 tok/s", "MXFP8 / bf16", "bf16 / BW limit", "MXFP8 / BW limit"],
        cpu_rows(args, bandwidth)))
    print("\n## GPU kernels (Triton grouped GEMM)\n")
    headers = ["batch", "torch bf16 tok/s", "Triton bf16 tok/s", "Triton MXFP8 tok/s", "MXFP8 / bf16",
               "MXFP8 / BW limit", "MX path"]
    if torch.cuda.is_available():
        print(f"{torch.cuda.get_device_name()}\n")
        print(markdown_table(headers, gpu_rows(args)))
    else:
        print(markdown_table(headers, [[b, "not run (no GPU)", "", "", "", "", ""] for b in args.gpu_batches]))


if __name__ == "__main__":
    main()
