"""MTP speculative decoding's ceiling on this CPU (docs/benchmarks.md "MTP drafts"): batch-1
greedy decode, plain against `speculative_config={"method": "mtp"}`, on an 8-layer GLM-4.5-shaped
model (hidden 1024, 16 experts of 512, vocab 32768) whose layers 1..7 add nothing (their attention
and MLP outputs zeroed: every weight is still read each step) and whose MTP layer is a copy of
layer 0, so every draft is the target's next token: what the mechanism gives at this per-step
weight read with perfect drafts. No trained MTP layer can be downloaded here.

    python benchmarks/mtp_ceiling.py [bfloat16|float32]
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch
import transformers
from safetensors.torch import load_file, save_file

from cuttle.engine import LLM, SamplingParams

H, LAYERS, N = 1024, 8, 128


def checkpoint() -> str:
    torch.manual_seed(0)
    cfg = transformers.Glm4MoeConfig(
        vocab_size=32768, hidden_size=H, intermediate_size=2048, num_hidden_layers=LAYERS, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, moe_intermediate_size=512, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=4, n_group=1, topk_group=1, first_k_dense_replace=0, routed_scaling_factor=1.0,
        attention_bias=True, use_qk_norm=True, max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=1)
    m = transformers.Glm4MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
        for i, layer in enumerate(m.model.layers):
            layer.self_attn.o_proj.weight.zero_()
            if i > 0:
                layer.mlp.experts.down_proj.zero_()
                layer.mlp.shared_experts.down_proj.weight.zero_()
        e = m.model.embed_tokens.weight
        e.div_(e.pow(2).mean(-1, keepdim=True).sqrt())  # RMS 1: the MTP's enorm leaves it as layer 0's norm does
    path = tempfile.mkdtemp()
    m.save_pretrained(path)
    sd = load_file(os.path.join(path, "model.safetensors"))
    mtp = {k.replace("model.layers.0.", f"model.layers.{LAYERS}."): v.clone() for k, v in sd.items() if k.startswith("model.layers.0.")}
    mtp.update({f"model.layers.{LAYERS}.enorm.weight": torch.ones(H), f"model.layers.{LAYERS}.hnorm.weight": torch.ones(H),
                f"model.layers.{LAYERS}.eh_proj.weight": torch.cat((torch.eye(H), torch.zeros(H, H)), 1),
                f"model.layers.{LAYERS}.shared_head.norm.weight": sd["model.norm.weight"].clone(),
                f"model.layers.{LAYERS}.shared_head.head.weight": sd["lm_head.weight"].clone(),
                f"model.layers.{LAYERS}.embed_tokens.weight": sd["model.embed_tokens.weight"].clone()})
    save_file({**sd, **mtp}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def main() -> None:
    dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
    path = checkpoint()
    prompt = list(range(100, 164))
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    for spec in (None, {"method": "mtp", "disable_by_batch_size": None}):
        llm = LLM(path, dtype=dtype, num_kv_blocks=64, speculative_config=spec, skip_tokenizer_init=True)
        llm.generate([prompt], sp, use_tqdm=False)  # warm: graphs captured
        best = 0.0
        for _ in range(3):
            t = time.perf_counter()
            llm.generate([prompt], sp, use_tqdm=False)
            best = max(best, N / (time.perf_counter() - t))
        st = llm.engine.stats()
        print(f"{dtype} {'mtp' if spec else 'plain':5s} {best:7.1f} tok/s (best of 3), drafts kept "
              f"{st['spec_accepted_tokens']}/{st['spec_draft_tokens']}", flush=True)
        del llm


if __name__ == "__main__":
    main()
