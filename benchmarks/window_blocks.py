"""Blocks given back behind a sliding window (docs/architecture.md "Blocks behind a sliding
window"): one KV pool, one workload, the engine with and without giving blocks back.

A StarCoder2-shaped model (every layer windowed; random weights, bf16) with W = 512 and blocks of
16 decodes 8 requests of 64 prompt tokens and 1536 new tokens each (1600 tokens, 3x the window)
in a pool of 288 blocks (4608 tokens: 8 windows' worth). Giving blocks back, each sequence holds
its window's ~34 blocks and all 8 run at once; keeping every block (the engine before), a
sequence grows to 100 blocks, so about 3 fit and the rest wait or are preempted and recomputed.
A third run keeps every block in a pool large enough for all 8 (800 blocks): the memory the same
concurrency needed before. A fourth gives blocks back but runs every step eagerly
(`enforce_eager`): before windowed graphs (`WindowRows`), every decode step past W ran so. Reports
wall time, generated tokens per second, preemptions, the most blocks any sequence held and the
pool's peak use, in one run.

    .venv/bin/python benchmarks/window_blocks.py [--new-tokens 1536] [--requests 8]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, make_random_checkpoint, markdown_table  # noqa: E402

from cuttle.attention.metadata import NULL_BLOCK  # noqa: E402
from cuttle.engine import LLM, SamplingParams  # noqa: E402

WINDOW, BLOCK, PROMPT = 512, 16, 64
CONFIG = {
    "architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2", "vocab_size": 4096, "hidden_size": 512,
    "intermediate_size": 2048, "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 2,
    "max_position_embeddings": 4096, "sliding_window": WINDOW, "use_bias": True, "norm_epsilon": 1e-5,
    "rope_theta": 100000.0, "tie_word_embeddings": True, "eos_token_id": 0, "bos_token_id": 0,
}


def run(path: str, num_blocks: int, keep: bool, requests: int, new_tokens: int, eager: bool = False) -> dict:
    llm = LLM(path, dtype="bfloat16", block_size=BLOCK, num_kv_blocks=num_blocks, max_num_seqs=requests,
              max_num_batched_tokens=512, max_model_len=PROMPT + new_tokens, enforce_eager=eager)
    eng = llm.engine
    assert eng.block_manager.window == WINDOW
    if keep:
        eng.block_manager.window = None  # the engine before: every block kept, all taken at admission
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(requests):
        eng.add_request(f"r{i}", [1 + (i * 31 + j * 7) % 4000 for j in range(PROMPT)], params)
    held = used = 0
    t0 = time.perf_counter()
    generated = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                generated += len(out.outputs[0].token_ids)
        running = eng.scheduler.running
        held = max(held, max((sum(b != NULL_BLOCK for b in s.block_table) for s in running), default=0))
        used = max(used, num_blocks - eng.block_manager.num_free_blocks)
    wall = time.perf_counter() - t0
    return {"wall": wall, "tok_s": generated / wall, "preemptions": eng.stats()["preemptions"], "held": held, "used": used,
            "graph_steps": eng.stats()["graph_steps"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=1536)
    args = ap.parse_args()
    torch.manual_seed(0)
    path = make_random_checkpoint(os.path.join(tempfile.gettempdir(), "cuttle-bench-window-blocks"), CONFIG)
    total = PROMPT + args.new_tokens
    window_pool = args.requests * (-(-WINDOW // BLOCK) + 4)
    full_pool = args.requests * -(-total // BLOCK)
    runs = [("given back", window_pool, False, False), ("every block kept", window_pool, True, False),
            ("every block kept", full_pool, True, False), ("given back, eager steps", window_pool, False, True)]
    rows = []
    for name, blocks, keep, eager in runs:
        r = run(path, blocks, keep, args.requests, args.new_tokens, eager)
        rows.append([name, blocks, f"{r['wall']:.1f}", f"{r['tok_s']:.1f}", r["preemptions"], r["held"], r["used"],
                     r["graph_steps"]])
        print(f"{name} / {blocks} blocks: {r}", flush=True)
    print(machine_info())
    print(f"\n{args.requests} requests x ({PROMPT} prompt + {args.new_tokens} new tokens), window {WINDOW}, blocks of {BLOCK}, bf16\n")
    print(markdown_table(["blocks behind the window", "pool (blocks)", "wall (s)", "generated tok/s", "preemptions",
                          "most blocks one sequence held", "pool peak (blocks)", "graph steps"], rows))


if __name__ == "__main__":
    main()
