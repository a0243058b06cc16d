"""What serving LoRA adapters (engine/lora.py) costs beside the base model: one LoRA-enabled engine
decoding the same prompts on the base weights, under one adapter, and under `--adapters`
different adapters mixed in every step, rounds interleaved (this VM's memory rate drifts),
medians reported.

The adapters are random PEFT adapters of rank `--rank` on every projection the engine adapts
(q/k/v/o_proj, and gate/up/down_proj of dense MLPs), written once beside the preset's checkpoint.
Each adapter row costs the delta's two products per projection (a native kernel on CPU); decode
steps under one adapter replay kernel graphs of their own, steps mixing adapters run eagerly, so
the base model also runs on a second engine with `enforce_eager` (the `base, eager` row: what the
eager steps alone cost), and the table gives the adapters' bytes read per step
over the base weights' bytes (what the extra weight bytes alone would cost a memory-bound step).

    python benchmarks/lora.py [--model-preset qwen3-0.6b] [--batches 1,16] [--rank 16] [--adapters 4]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DEFAULT_CACHE_DIR, PRESETS, copy_bandwidth_gbs, machine_info, markdown_table, preset_checkpoint  # noqa: E402

MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(path: str, config: dict, rank: int, seed: int) -> str:
    """A random PEFT adapter (adapter_config.json + adapter_model.safetensors) for `config`."""
    from safetensors.torch import save_file

    if os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        return path
    h, inter = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    moe = config.get("model_type") == "qwen3_moe"  # every layer's MLP routed: attention only
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for block, modules in MODULES.items():
            if block == "mlp" and moe:
                continue
            for m in modules:
                fan_in, fan_out = shapes[m]
                key = f"base_model.model.model.layers.{layer}.{block}.{m}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) / fan_in**0.5).to(torch.bfloat16)
                tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.01).to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    targets = [m for b, ms in MODULES.items() if not (b == "mlp" and moe) for m in ms]
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none"}, f)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return path


def run_once(llm, prompts: list, loras: list, out_len: int) -> tuple[float, int]:
    from cuttle.engine import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, lora_request=loras, use_tqdm=False)
    return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-preset", default="qwen3-0.6b", choices=sorted(PRESETS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4, help="adapters mixed in the 'mixed' rows")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from cuttle.engine import LLM, LoRARequest

    config = PRESETS[args.model_preset][0]
    path = preset_checkpoint(args.model_preset)
    adapters = [LoRARequest(f"a{i}", i + 1, write_adapter(os.path.join(DEFAULT_CACHE_DIR, f"{args.model_preset}-lora-r{args.rank}-{i}"),
                                                          config, args.rank, i))
                for i in range(args.adapters)]
    out: dict = {"machine": machine_info(), "args": vars(args), "copy_gbs": copy_bandwidth_gbs(), "rows": []}
    llm = LLM(path, dtype=args.dtype, num_kv_blocks=1024, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
              skip_tokenizer_init=True, max_num_seqs=max(int(b) for b in args.batches.split(",")))
    eager = LLM(path, dtype=args.dtype, num_kv_blocks=1024, enforce_eager=True, skip_tokenizer_init=True,
                max_num_seqs=max(int(b) for b in args.batches.split(",")))
    loaded = llm.engine.loras.resolve(adapters[0])
    weight_bytes = sum(p.nbytes for p in llm.engine.runner.model.parameters())
    rng = random.Random(0)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [[rng.randrange(1000, 30000) for _ in range(args.prompt_len)] for _ in range(batch)]
        kinds = {"base": (llm, [None] * batch), "base, eager": (eager, [None] * batch), "one adapter": (llm, [adapters[0]] * batch)}
        if batch > 1:  # adapters are mixed across a batch's requests: one request is the one-adapter row
            kinds[f"{min(batch, args.adapters)} adapters mixed"] = (llm, [adapters[i % args.adapters] for i in range(batch)])
        for engine, loras in kinds.values():
            run_once(engine, prompts[:1], loras[:1], 4)  # warm-up (kernel graphs, adapters loaded)
        rates: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(args.rounds):
            for kind, (engine, loras) in kinds.items():
                engine.reset_prefix_cache()  # every round prefills again
                dt, n = run_once(engine, prompts, loras, args.output_len)
                rates[kind].append(n / dt)
        base = statistics.median(rates["base"])
        distinct = {"base": 0, "base, eager": 0, "one adapter": 1}
        for kind, r in rates.items():
            med = statistics.median(r)
            k = distinct.get(kind, min(batch, args.adapters))
            extra = k * loaded.nbytes / weight_bytes
            out["rows"].append({"batch": batch, "kind": kind, "tok_s": med, "ratio": med / base, "rounds": r, "adapter_bytes_frac": extra})
            rows.append([batch, kind, f"{med:.1f}", f"{med / base:.2f}", f"{extra:.1%}"])
    print(f"\n{args.model_preset}, {args.dtype}, rank {args.rank}, prompt {args.prompt_len}, output {args.output_len}; "
          f"copy bandwidth {out['copy_gbs']:.1f} GB/s; one adapter {loaded.nbytes / 2**20:.1f} MiB, "
          f"base weights {weight_bytes / 2**20:.0f} MiB\n")
    print(markdown_table(["batch", "requests", "output tok/s", "vs base", "adapter bytes / base weights"], rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
