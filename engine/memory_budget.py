"""The KV pool's size from `gpu_memory_utilization` (vLLM's knob): that fraction of the memory free
on the device when the engine starts (on CPU: the kernel's MemAvailable), less the weights about
to be loaded into it, is the pool. vLLM's fraction is of the whole device and covers its
activations too; cuttle's activations are small next to the pool and are not reserved.

Owns only the arithmetic and the two probes (free device memory, the checkpoint's weight bytes at
the engine dtype, read from the safetensors headers without loading a tensor).
"""
from __future__ import annotations

import os

import torch
from safetensors import safe_open

from cuttle.engine.models.loader import checkpoint_files


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def checkpoint_weight_bytes(path: str, dtype: torch.dtype) -> int:
    """Bytes the checkpoint's tensors take once loaded at `dtype` (FP8 weights are dequantized to
    it; their scales are not kept)."""
    numel = 0
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if not name.endswith("_scale_inv"):
                    shape = f.get_slice(name).get_shape()
                    n = 1
                    for d in shape:
                        n *= d
                    numel += n
    return numel * dtype.itemsize


def kv_pool_bytes(fraction: float, device: torch.device, checkpoint: str, dtype: torch.dtype) -> int:
    free = free_memory_bytes(device)
    weights = checkpoint_weight_bytes(checkpoint, dtype)
    budget = int(fraction * free) - weights
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {fraction} of the {free / 2**30:.2f} GiB free on {device.type} leaves no room for the "
            f"KV cache after the weights ({weights / 2**30:.2f} GiB)"
        )
    return budget
