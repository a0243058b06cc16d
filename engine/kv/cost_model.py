"""Copy or recompute: the cost model that decides how a preempted sequence gets its KV back.

Swapping `b` blocks costs two copies (out now, back in later) of `b * bytes_per_block` bytes at the
measured copy bandwidth, plus a fixed per-transfer latency each way; recomputing `t` tokens costs
their FLOPs (the linear layers' `2 * active params` per token plus the attention's `4 * layers *
heads * head_dim` per token and context position) at the measured compute rate. Both rates are
measured once at start-up, in a few milliseconds, on the pools and dtype the engine really uses:
a copy between the device pool and the host tier through the transfer engine, and a GEMM of the
model's hidden width. Owns the numbers and the comparison; never moves KV.

It also chooses, for a run of host-tier hits, between copying them in and reading them in place
(the attention kernel reads the host blocks where they lie, every step). Copy-in costs one copy;
read in place costs, at every later step that attends them (the remaining decode steps, plus the
step that starts), what reading those bytes from the host pool costs beyond reading them from the
device pool: `host_read_penalty_s_per_byte` = 1 / host read bandwidth - 1 / device read
bandwidth. Where both pools are the same memory (CPU: two tensors in one RAM) the penalty is 0 and
reading in place always wins; a GPU would measure both (not wired: read in place is CPU-only).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from cuttle.engine.kv.storage import KVStorage
from cuttle.engine.kv.transfer import TransferEngine


@dataclass(slots=True)
class CostModel:
    copy_bytes_per_s: float
    copy_latency_s: float
    flops_per_s: float
    linear_flops_per_token: float
    attention_flops_per_token_ctx: float
    bytes_per_block: int
    host_read_penalty_s_per_byte: float = 0.0

    def copy_in_s(self, num_blocks: int) -> float:
        return self.copy_latency_s + num_blocks * self.bytes_per_block / self.copy_bytes_per_s

    def read_in_place_s(self, num_blocks: int, steps: int) -> float:
        return steps * num_blocks * self.bytes_per_block * self.host_read_penalty_s_per_byte

    def read_in_place_pays(self, num_blocks: int, remaining_steps: int) -> bool:
        """Whether `num_blocks` host hits attended by `remaining_steps` more steps (and this one)
        are better read where they are than copied in."""
        return self.read_in_place_s(num_blocks, remaining_steps + 1) <= self.copy_in_s(num_blocks)

    def swap_s(self, num_blocks: int) -> float:
        return 2 * (self.copy_latency_s + num_blocks * self.bytes_per_block / self.copy_bytes_per_s)

    def recompute_s(self, num_tokens: int) -> float:
        attention = self.attention_flops_per_token_ctx * num_tokens * (num_tokens + 1) / 2
        return (self.linear_flops_per_token * num_tokens + attention) / self.flops_per_s

    def swap_pays(self, num_tokens: int, num_blocks: int) -> bool:
        return num_tokens > 0 and self.swap_s(num_blocks) < self.recompute_s(num_tokens)

    @classmethod
    def measure(cls, transfer: TransferEngine, device_kv: KVStorage, host_kv: KVStorage, model_config,
                bytes_per_block: int) -> "CostModel":
        """Time a block copy device -> host (latency: one block; bandwidth: up to 32 MiB) and a
        GEMM at the model's width, best of three each. Uses blocks 0.. of both pools, which hold
        nothing yet."""
        n = max(1, min(len_blocks(device_kv), len_blocks(host_kv), (32 << 20) // bytes_per_block))
        ids = list(range(n))

        def timed(k: int) -> float:
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                transfer.submit(lambda: transfer.device_to_host(device_kv, ids[:k], host_kv, ids[:k])).wait()
                best = min(best, time.perf_counter() - t)
            return best

        latency = timed(1)
        bulk = timed(n)
        bandwidth = n * bytes_per_block / max(bulk - latency, 1e-9) if n > 1 else bytes_per_block / max(latency, 1e-9)
        mc = model_config
        dev, dtype = device_kv.device, device_kv.tensor.dtype
        width = mc.hidden_size
        a = torch.randn(256, width, dtype=dtype, device=dev)
        b = torch.randn(width, 4 * width, dtype=dtype, device=dev)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            torch.mm(a, b)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            best = min(best, time.perf_counter() - t)
        flops = 2 * 256 * width * 4 * width / max(best, 1e-9)
        # both pools in one RAM on CPU: reading a host block costs what reading a device block does
        penalty = 0.0
        return cls(bandwidth, latency, flops, linear_flops_per_token(mc), 4.0 * mc.num_layers * mc.num_heads * mc.head_dim,
                   bytes_per_block, penalty)


def len_blocks(kv: KVStorage) -> int:
    return kv.tensor.shape[2]


def linear_flops_per_token(mc) -> float:
    """2 x the parameters one token multiplies through (routed experts: only those it picks)."""
    h = mc.hidden_size
    attn = h * mc.num_heads * mc.head_dim * 2 + h * mc.num_kv_heads * mc.head_dim * 2
    top_k = int(mc.hf_config.get("num_experts_per_tok") or 0)
    total = 0
    for layer in range(mc.num_layers):
        if layer in mc.moe_layers:
            mlp = 3 * h * (top_k * mc.moe_intermediate_size + mc.shared_expert_intermediate_size)
        else:
            mlp = 3 * h * mc.intermediate_size
        total += attn + mlp
    return 2.0 * total
