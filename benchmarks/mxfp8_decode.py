"""Batch-1 decode with MXFP8 weights against the same engine in bf16, on one thread and the
process CPU clock (the shared 2-core machine made wall time a scheduler measurement), next to the
bound that one thread's copy bandwidth puts on it (bytes a decode token reads / read rate).

    python benchmarks/mxfp8_decode.py --model-preset qwen3-moe-small --option moe_quant
    python benchmarks/mxfp8_decode.py --model-preset qwen3-0.6b --option quantization
    python benchmarks/mxfp8_decode.py --model-preset qwen3-moe-small --option quantize_lm_head

Options: `moe_quant` (routed experts in MXFP8), `quantization` (every attention / dense-MLP linear
and the routed experts), `quantize_lm_head` (those and the lm_head: every 2-D weight a decode step
reads, as llama.cpp's Q8_0 quantizes them).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import PRESETS, markdown_table, preset_checkpoint  # noqa: E402
import mxfp8_gemm  # noqa: E402
from throughput import mxfp8_params, weight_counts  # noqa: E402


def decode_tok_s(path: str, tokens: int, **kw) -> float:
    from cuttle.engine import LLM, SamplingParams

    llm = LLM(path, dtype="bfloat16", max_model_len=256, enable_prefix_caching=False, num_kv_blocks=64, **kw)
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([[11, 12, 13, 14]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    engine = llm.engine
    engine.add_request("b1", list(range(20, 52)), sp)
    engine.step()  # prefill + first token
    t, steps = time.process_time(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps / (time.process_time() - t)


# --option -> (engine options, (quantization, moe_quant) for `mxfp8_params`, lm_head in MXFP8)
OPTIONS = {
    "moe_quant": ({"moe_quant": "mxfp8"}, (None, "mxfp8"), False),
    "quantization": ({"quantization": "mxfp8"}, ("mxfp8", None), False),
    "quantize_lm_head": ({"quantization": "mxfp8", "quantize_lm_head": True}, ("mxfp8", None), True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-preset", default="qwen3-moe-small", choices=sorted(PRESETS))
    ap.add_argument("--option", default="moe_quant", choices=sorted(OPTIONS))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    load0 = os.getloadavg()
    path = preset_checkpoint(args.model_preset)
    from cuttle.engine.config import ModelConfig
    from cuttle.engine.models import load_model

    mc = ModelConfig.from_pretrained(path)
    n_params = sum(p.numel() for p in load_model(path, mc, torch.bfloat16, torch.device("cpu")).parameters())
    read_params, _ = weight_counts(mc, n_params)
    engine_kw, n_opts, lm_head = OPTIONS[args.option]
    n_mx = mxfp8_params(mc, *n_opts) + (mc.vocab_size * mc.hidden_size if lm_head else 0)
    bytes_bf16 = read_params * 2
    bytes_mx = n_mx * 8.25 / 8 + (read_params - n_mx) * 2
    mxfp8_gemm.CLOCK = time.process_time
    bw = mxfp8_gemm.copy_gbs() / 2  # one thread's read rate: a copy counts read + write bytes
    bf16 = decode_tok_s(path, args.tokens)
    mx = decode_tok_s(path, args.tokens, **engine_kw)
    rows = [["bf16", f"{bytes_bf16 / 1e6:.0f}", f"{bf16:.2f}", f"{bw * 1e9 / bytes_bf16:.2f}", f"{bf16 / (bw * 1e9 / bytes_bf16):.2f}", "1.00"],
            [args.option, f"{bytes_mx / 1e6:.0f}", f"{mx:.2f}", f"{bw * 1e9 / bytes_mx:.2f}", f"{mx / (bw * 1e9 / bytes_mx):.2f}", f"{mx / bf16:.2f}"]]
    print(f"{args.model_preset}: {read_params / 1e6:.0f}M params read per token ({n_mx / 1e6:.0f}M in MXFP8 under {args.option}); "
          f"one thread reads {bw:.1f} GB/s (CPU clock)")
    print(markdown_table(["weights", "MB read / token", "batch-1 decode tok/s (1 thread, CPU time)", "bound tok/s",
                          "of bound", "vs bf16"], rows))
    print(f"load average before {load0}, after {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.model_preset, "option": args.option, "read_gbs": bw, "bf16_tok_s": bf16, "mxfp8_tok_s": mx,
                       "bytes_bf16": bytes_bf16, "bytes_mxfp8": bytes_mx, "load_before": load0, "load_after": os.getloadavg()}, f)


if __name__ == "__main__":
    main()
