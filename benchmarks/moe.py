"""MoE layer benchmark: bf16 vs MXFP8 experts, on this CPU and (when present) the GPU kernels.

    python benchmarks/moe.py                      # Qwen3-30B-A3B layer: hidden 2048, expert width 768,
                                                  # 128 experts, top-8, bf16; batches 1, 16, 256
    python benchmarks/moe.py --experts 32 --iters 2   # a smaller, quicker run

CPU table: one FusedMoE layer's tokens/s (torch path) with bf16 experts and with MXFP8 experts
(dequantized one active expert at a time), their ratio, and each as a fraction of the memory-bandwidth
limit measured in this run: tokens / (bytes of the experts this batch touches / copy bandwidth).
GPU table (CUDA only, "not run" otherwise; `--no-cpu` skips the CPU table): microseconds per layer
of the Triton expert path (align, grouped GEMMs, SiLU, combine), bf16 vs MXFP8 weights by
`tl.dot_scaled` (MX tensor cores on sm100+, Triton's emulation before) and by the kernel's own
decode, against the torch path; eager, and replayed from a CUDA graph (the kernels without launch
overhead), over `--gpu-layers` layers cycled so the weights come from memory; the replayed layer
again with the one-program Triton alignment in place of the torch ops (the default); a sweep of
block configurations reports the best beside the default; each as a fraction of its limit measured
in the same run (expert bytes touched / copy bandwidth, or FLOPs / bf16 matmul rate). A second GPU
table times the alignment alone, both ways, over `--align-batches` (up to where the Triton kernel
pays, so the expert path can take it by default there).
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


def gpu_time(fns: list[Callable[[], object]], reps: int, graph: bool) -> float:
    """Median seconds per call over rounds that call each of `fns` once (one per layer, so the
    weights come from memory, not the L2), timed with CUDA events; `graph` replays one captured
    CUDA graph of a round instead (no launch overhead: what the kernels alone can do)."""
    import statistics

    run = lambda: [f() for f in fns]  # noqa: E731
    run()
    torch.cuda.synchronize()
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # warm-up on a side stream before capture, as torch asks
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        run = g.replay  # noqa: F811
        run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(fns))
    return statistics.median(times)


def gpu_matmul_tflops(n: int = 8192, reps: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / gpu_time([lambda: a @ b], reps, graph=False) / 1e12


def gpu_copy_bandwidth_gbs(nbytes: int = 1 << 31, reps: int = 10) -> float:
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / gpu_time([lambda: dst.copy_(src)], reps, graph=False) / 1e9


# Triton grouped-GEMM configurations tried at each batch (block_m, block_n, block_k, warps, stages):
# the default (experts_triton.default_config) first, then neighbours; the table reports the default
# and the best, so one run on a lent GPU says whether the default should change.
SMALL_M = [(16, 64, 128, 4, 4), (16, 32, 128, 4, 4), (16, 32, 256, 4, 3), (16, 64, 256, 4, 3), (16, 128, 128, 4, 4)]
LARGE_M = [(64, 128, 64, 8, 3), (64, 64, 128, 4, 3), (128, 128, 64, 8, 3), (64, 128, 128, 8, 3), (128, 256, 64, 8, 3)]


def gpu_rows(args: argparse.Namespace) -> tuple[list[list[object]], dict[str, float]]:
    from cuttle.moe.experts_torch import fused_experts_torch
    from cuttle.moe.experts_triton import default_config, fused_experts_triton
    from cuttle.moe.grouped_gemm_triton import GemmConfig, has_mx_tensor_cores

    device = torch.device("cuda")
    limits = {"copy GB/s": gpu_copy_bandwidth_gbs(), "bf16 matmul TFLOP/s": gpu_matmul_tflops()}
    bw, rate = limits["copy GB/s"] * 1e9, limits["bf16 matmul TFLOP/s"] * 1e12
    layers = [random_layer(args.hidden, args.inter, args.experts, args.topk, "cuda", seed=i) for i in range(args.gpu_layers)]
    quantized = [clone_quantized(layer) for layer in layers]
    native_mx = has_mx_tensor_cores(device)
    H, I, k = args.hidden, args.inter, args.topk
    rows = []
    with torch.no_grad():
        for batch in args.gpu_batches:
            x = torch.randn(batch, H, device=device, dtype=torch.bfloat16)
            routed = [route(router_logits(x, lay.gate_weight, lay.routing), lay.routing) for lay in layers]
            touched = [touched_bytes(lay, x) for lay in layers]
            bytes_bf16 = sum(touched) / len(touched)
            bytes_mx = sum(touched_bytes(q, x) for q in quantized) / len(quantized)
            flops = 6 * batch * k * H * I  # gate|up (2I x H) and down (H x I), 2 flops a multiply-add
            default = default_config(batch * k, args.experts)
            configs = [GemmConfig(*c) for c in (SMALL_M if batch * k / args.experts <= 16 else LARGE_M)]
            if default not in configs:
                configs.insert(0, default)

            def experts(ws, cfg, dot_scaled=None, align="torch"):
                return [lambda w=w, r=r: fused_experts_triton(x, w[0], w[1], r[0], r[1], config=cfg, dot_scaled=dot_scaled,
                                                              align=align)
                        for w, r in zip(ws, routed)]

            plain = [(lay.w13, lay.w2) for lay in layers]
            mx = [q.expert_weights() for q in quantized]
            t_torch = gpu_time([lambda lay=lay, r=r: fused_experts_torch(x, lay.w13, lay.w2, r[0], r[1])
                                for lay, r in zip(layers, routed)], args.iters, graph=False)
            variants = [("bf16", plain, None, bytes_bf16), ("MXFP8 in-kernel decode", mx, False, bytes_mx),
                        ("MXFP8 dot_scaled" + ("" if native_mx else " (emulated)"), mx, True, bytes_mx)]
            for name, ws, ds, nbytes in variants:
                limit = max(nbytes / bw, flops / rate)
                timed = {}
                for cfg in configs if ds is not False else [default]:  # the decode path: no longer a default
                    try:
                        timed[cfg] = gpu_time(experts(ws, cfg, ds), args.iters, graph=True)
                    except Exception as e:  # a configuration the compiler refuses (shared memory): reported
                        print(f"batch {batch} {name} {cfg}: {type(e).__name__}: {str(e)[:200]}")
                if default not in timed:
                    continue
                best = min(timed, key=timed.get)
                eager = gpu_time(experts(ws, default, ds), args.iters, graph=False)
                t_triton_align = gpu_time(experts(ws, default, ds, "triton"), args.iters, graph=True)
                rows.append([batch, name, f"{t_torch * 1e6:.1f}", f"{eager * 1e6:.1f}",
                             f"{timed[default] * 1e6:.1f}", f"{t_triton_align * 1e6:.1f}",
                             f"{timed[best] * 1e6:.1f}", "x".join(map(str, (best.block_m, best.block_n, best.block_k,
                                                                              best.num_warps, best.num_stages))),
                             limit / timed[best], "bytes" if nbytes / bw >= flops / rate else "flops"])
    return rows, limits


def gpu_align_rows(args: argparse.Namespace) -> list[list[object]]:
    """The alignment alone, torch ops vs the one-program Triton kernel, replayed from a CUDA graph,
    at each batch of `--align-batches` (block size as the expert path's default config picks)."""
    from cuttle.moe.align import align_tokens
    from cuttle.moe.align_triton import align_tokens_triton
    from cuttle.moe.experts_triton import default_config

    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for batch in args.align_batches:
        ids = torch.rand(batch, args.experts, device="cuda", generator=g).topk(args.topk, dim=-1).indices
        block = default_config(batch * args.topk, args.experts).block_m
        t = [gpu_time([lambda f=f: f(ids, args.experts, block)], args.iters, graph=True)
             for f in (align_tokens, align_tokens_triton)]
        same = all(torch.equal(getattr(align_tokens(ids, args.experts, block), f),
                               getattr(align_tokens_triton(ids, args.experts, block), f))
                   for f in ("sorted_ids", "block_expert", "expert_offsets"))
        rows.append([batch, batch * args.topk, block, f"{t[0] * 1e6:.1f}", f"{t[1] * 1e6:.1f}", t[0] / t[1], same])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--gpu-batches", type=int, nargs="+", default=[1, 16, 256, 4096])
    p.add_argument("--align-batches", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 2048, 4096, 16384])
    p.add_argument("--gpu-layers", type=int, default=4, help="distinct layers cycled on the GPU (weights past the L2)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU table (a GPU machine's run)")
    args = p.parse_args()

    info = machine_info()
    shape = f"hidden {args.hidden}, expert width {args.inter}, {args.experts} experts, top-{args.topk}"
    print(f"# MoE layer: bf16 vs MXFP8 experts ({shape})\n")
    print(f"{info['cpu']}, {info['threads']} threads, torch {info['torch']}, {info['date']}\n")
    if not args.no_cpu:
        bandwidth = copy_bandwidth_gbs(nbytes=1 << 28)
        print(f"## CPU (torch path), copy bandwidth {bandwidth:.1f} GB/s\n")
        print(markdown_table(
            ["batch", "bf16 tok/s", "MXFP8 tok/s", "MXFP8 / bf16", "bf16 / BW limit", "MXFP8 / BW limit"],
            cpu_rows(args, bandwidth)))
    print("\n## GPU kernels (Triton grouped GEMM), microseconds per layer\n")
    headers = ["batch", "experts", "torch bf16 (eager)", "Triton eager", "Triton graph", "Triton graph, Triton align",
               "Triton graph, best config",
               "best config (m n k warps stages)", "best / limit", "limit"]
    if torch.cuda.is_available():
        rows, limits = gpu_rows(args)
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
              + ", ".join(f"{k} {v:.0f}" for k, v in limits.items()) + f"; {args.gpu_layers} layers cycled\n")
        print(markdown_table(headers, rows))
        print("\n## GPU: the token-to-expert alignment alone, microseconds (graph)\n")
        print(markdown_table(["batch", "assignments", "block", "torch ops", "Triton kernel", "torch / Triton",
                              "same tensors"], gpu_align_rows(args)))
    else:
        print(markdown_table(headers, [[b, "not run (no GPU)", *[""] * 8] for b in args.gpu_batches]))


if __name__ == "__main__":
    main()
