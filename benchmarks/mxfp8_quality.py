"""MXFP8 quality figures (issue 18): what the format costs in accuracy, measured.

1. SQNR of one MXFP8-weight GEMM and of one MoE layer at Qwen3-30B-A3B expert shapes (hidden 2048,
   expert width 768, top-8; random N(0, 0.02) weights, 64 N(0, 1) tokens), floor and rceil scales:
   the native MXFP8 kernels against the same computation on the unquantized fp32 weights.
2. The embedded model (bf16 engine): greedy agreement and mean |delta logprob| of MXFP8 experts
   (`moe_quant`) and of MXFP8 everything (`quantization`) against bf16, teacher-forced on the bf16
   engine's greedy continuations of code prompts.
3. Engine-trainer logprob mismatch (rl/mismatch.py) on the embedded model, sampled by a bf16
   engine: plain bf16 engine vs fp32 trainer; an MXFP8-expert engine, and one with every linear
   and the lm_head in MXFP8, each vs an fp32 trainer quantizing the same weights the same way,
   and vs trainers that quantize less (post-training quantization).

    python benchmarks/mxfp8_quality.py [--experts 128] [--only sqnr,agreement,mismatch]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table  # noqa: E402

from cuttle.attention.native import mxfp8 as native_mx  # noqa: E402
from cuttle.moe import FusedMoE, RoutingConfig, quantize_mxfp8  # noqa: E402

CODE_PROMPTS = ["import os\n\n\ndef ", "class Queue:\n    def __init__(self, maxsize=0):\n", '"""Utilities for ',
                "def _read_config(path):\n    with open(path) as f:\n", "    for key, value in sorted(items):\n",
                "try:\n    import json\nexcept ImportError:\n", "def parse_args(argv=None):\n    parser = ",
                "    return self._cache[key]\n\n    def "]


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return float(10 * torch.log10(ref.square().sum() / (got - ref).square().sum()))


def sqnr_figures(experts: int) -> list[list]:
    H, I, k, T = 2048, 768, 8, 64
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    rows = []
    for mode in ("floor", "rceil"):
        for name, N, K in (("GEMM gate|up [1536, 2048]", 2 * I, H), ("GEMM down [2048, 768]", H, I)):
            w = torch.randn(N, K, generator=g) * 0.02
            xi = x if K == H else torch.randn(T, K, generator=g)
            got = native_mx.linear(xi, *quantize_mxfp8(w, 32, mode))
            rows.append([name, mode, f"{sqnr_db(xi.double() @ w.double().T, got):.1f}"])
        routing = RoutingConfig.from_hf({"model_type": "qwen3_moe", "num_experts": experts, "num_experts_per_tok": k,
                                         "norm_topk_prob": True})
        ref = FusedMoE(H, I, routing, torch.float32)
        with torch.no_grad():
            ref.gate_weight.normal_(0, 0.02, generator=g)
            ref.w13.normal_(0, 0.02, generator=g)
            ref.w2.normal_(0, 0.02, generator=g)
            y_ref = ref(x)
            ref.quantize_("mxfp8", scale_mode=mode)
            y_mx = ref(x)  # same routing (router weights are not quantized), native MXFP8 experts
        rows.append([f"MoE layer ({experts} experts, top-{k})", mode, f"{sqnr_db(y_ref, y_mx):.1f}"])
        del ref
    return rows


def teacher_forced(ref, test, prompts: list[list[int]], n: int) -> tuple[float, float, float]:
    """(agreement, agreement where ref's top-2 margin >= 0.1 nats, mean |delta logprob|) of `test`
    on `ref`'s greedy continuations, scored teacher-forced."""
    from cuttle.engine import SamplingParams

    outs = ref.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2), use_tqdm=False)
    full = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
    scored = test.generate(full, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=1), use_tqdm=False)
    same, clear, deltas = [], [], []
    for p, o, s in zip(prompts, outs, scored):
        c = o.outputs[0]
        for j, tok in enumerate(c.token_ids):
            got = s.prompt_logprobs[len(p) + j][tok]
            top2 = sorted((lp.logprob for lp in c.logprobs[j].values()), reverse=True)[:2]
            same.append(got.rank == 1)
            clear.append(top2[0] - top2[1] >= 0.1)
            deltas.append(abs(got.logprob - c.logprobs[j][tok].logprob))
    decisive = [s for s, c in zip(same, clear) if c]
    return sum(same) / len(same), sum(decisive) / max(1, len(decisive)), sum(deltas) / len(deltas)


def agreement_figures(n: int) -> list[list]:
    from cuttle.engine import LLM
    from cuttle.engine.default_model import DEFAULT_MODEL_DIR

    kw = dict(dtype="bfloat16", num_kv_blocks=256, logprobs_mode="raw")
    bf16 = LLM(DEFAULT_MODEL_DIR, **kw)
    prompts = [bf16.get_tokenizer().encode(t) for t in CODE_PROMPTS]
    rows = []
    for label, extra in (("MXFP8 experts (moe_quant)", {"moe_quant": "mxfp8"}),
                         ("MXFP8 linears + experts (quantization)", {"quantization": "mxfp8"}),
                         ("fp32 engine (yardstick: bf16 rounding)", {"dtype": "float32"})):
        test = LLM(DEFAULT_MODEL_DIR, **{**kw, **extra})
        a, d, m = teacher_forced(bf16, test, prompts, n)
        rows.append([label, f"{len(prompts)} x {n}", f"{100 * a:.1f} %", f"{100 * d:.1f} %", f"{m:.4f}"])
        del test
    return rows


def mismatch_figures() -> list[list]:
    from cuttle.engine import LLM, SamplingParams
    from cuttle.engine.default_model import DEFAULT_MODEL_DIR
    from cuttle.rl import TrainBatch, compute_advantages, mismatch, sample_groups
    from cuttle.rl.trainer import Trainer, TrainerConfig

    rows = []
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=48, ignore_eos=True)
    for engine_label, engine_kw, trainers in (
        ("bf16", {}, (("fp32", TrainerConfig()),)),
        ("bf16, MXFP8 experts", {"moe_quant": "mxfp8"},
         (("fp32, MXFP8 experts (same format)", TrainerConfig(moe_quant="mxfp8", quant_dtype="bfloat16")),
          ("fp32, unquantized (post-training quantization)", TrainerConfig()))),
        ("bf16, MXFP8 every linear + lm_head", {"quantization": "mxfp8", "quantize_lm_head": True},
         (("fp32, MXFP8 every linear + lm_head (same format)",
           TrainerConfig(quantization="mxfp8", quantize_lm_head=True, quant_dtype="bfloat16")),
          ("fp32, MXFP8 experts only", TrainerConfig(moe_quant="mxfp8", quant_dtype="bfloat16")),
          ("fp32, unquantized (post-training quantization)", TrainerConfig()))),
    ):
        llm = LLM(DEFAULT_MODEL_DIR, dtype="bfloat16", num_kv_blocks=256, **engine_kw)
        prompts = [llm.get_tokenizer().encode(t) for t in CODE_PROMPTS]
        groups = sample_groups(llm, prompts, 4, sp)
        for gr in groups:
            for i, s in enumerate(gr.samples):
                s.reward = float(i % 2)
        batch = TrainBatch.from_groups(groups, compute_advantages(groups, True))
        packed = batch.packed()
        for trainer_label, cfg in trainers:
            m = mismatch(Trainer(DEFAULT_MODEL_DIR, cfg).score(batch), packed.rollout_logprobs[packed.loss_mask > 0])
            rows.append([engine_label, trainer_label, m.num_tokens, f"{m.mean_abs:.4f}", f"{m.max_abs:.3f}", f"{m.k3_kl:.2e}"])
        del llm
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=32, help="experts of the SQNR layer (Qwen3-30B-A3B has 128; the SQNR is per expert shape, 32 keep the fp32 copies at ~2 GB)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt for the agreement figures")
    ap.add_argument("--only", default="sqnr,agreement,mismatch")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    parts = set(args.only.split(","))
    out = {"load_before": os.getloadavg()}
    if "sqnr" in parts:
        out["sqnr"] = sqnr_figures(args.experts)
        print(markdown_table(["what", "scales", "SQNR dB"], out["sqnr"]), flush=True)
    if "agreement" in parts:
        out["agreement"] = agreement_figures(args.tokens)
        print(markdown_table(["vs the bf16 engine", "prompts x tokens", "greedy agreement", "where bf16 margin >= 0.1",
                              "mean |dlogprob|"], out["agreement"]), flush=True)
    if "mismatch" in parts:
        out["mismatch"] = mismatch_figures()
        print(markdown_table(["engine", "trainer", "tokens", "mean |dlogprob|", "max |dlogprob|", "k3 KL"], out["mismatch"]), flush=True)
    out["load_after"] = os.getloadavg()
    print(f"load average before {out['load_before']}, after {out['load_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
