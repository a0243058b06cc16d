"""What the NSA and training-free top-k tests share (tests/engine/test_nsa_engine.py,
test_sparse_engine.py, test_nsa_recipe.py; tests/attention/test_nsa_kernels.py, test_topk.py):
tiny random checkpoints with peaked attention, the one-full-forward oracle the engine's
log-probabilities are checked against, the run of a kernel test file's Triton cases in a
subprocess under the Triton interpreter, shuffled block tables for the kernels' own tests, and
tiny random NSA checkpoints."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

# fp32 engine vs the fp32 reference. Not 1e-5: on the peaked test model the fp32 reference's own
# logprobs differ from a float64 forward of the same weights by up to 1.6e-5 (measured on an
# AVX512 EPYC, where the engine's preempt-and-recompute case came to 1.26e-5 from it; 6e-6 without
# preemption), so two fp32 orders of summation may differ by that much; 2e-5 keeps the bound at
# the oracle's own error.
TOL = 2e-5


def peaked_init_(model) -> None:
    """Random weights large enough that attention and block scores are peaked (near-uniform scores
    would make a top-n choice a coin toss between two correct paths); q/k norms at 2."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("ck_weight", "cv_weight")):
                p.normal_(0, p.shape[1] ** -0.5)
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.normal_(0, 0.15)
        for layer in model.layers:
            layer.attn.q_norm.weight.fill_(2.0)
            layer.attn.k_norm.weight.fill_(2.0)


def save_checkpoint(path: str, hf: dict[str, Any], model) -> None:
    """config.json, the model's weights under their HF names and a word-level tokenizer."""
    from cuttle.engine.models.loader import hf_state_dict

    from helpers import write_tokenizer

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    save_file({k: v.contiguous().clone() for k, v in hf_state_dict(model).items()}, os.path.join(path, "model.safetensors"))
    write_tokenizer(path, hf["vocab_size"])


def reference_logprobs(model, tokens: list[int], sparse=None) -> torch.Tensor:
    """[len(tokens), vocab] log-probabilities of one causal forward of the whole sequence (under
    training-free top-k `sparse`, if given)."""
    ids = torch.tensor([tokens])
    pos = torch.arange(len(tokens))[None]
    mask = torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()[None]
    with torch.no_grad():
        return model.compute_logits(model.forward_masked(ids, pos, mask, sparse=sparse)[0]).log_softmax(-1)


def check_against_reference(model, outs, with_prompt: bool, sparse=None, tol: float = TOL) -> int:
    """Every logprob the engine returned (samples', and the prompt's if `with_prompt`) equals the
    reference's on that sample's own sequence; returns how many were compared."""
    compared = 0
    for o in outs:
        prompt = list(o.prompt_token_ids)
        for c in o.outputs:
            ref = reference_logprobs(model, (prompt + list(c.token_ids))[:-1], sparse)
            for step, lps in enumerate(c.logprobs):
                for t, lp in lps.items():
                    assert abs(lp.logprob - ref[len(prompt) - 1 + step, t].item()) <= tol, (len(prompt), step, t)
                    compared += 1
            if with_prompt:
                for p in range(1, len(prompt)):
                    for t, lp in o.prompt_logprobs[p].items():
                        assert abs(lp.logprob - ref[p - 1, t].item()) <= tol, (len(prompt), p, t)
                        compared += 1
    return compared


def check_triton_subprocess(test_file: str, case_names: set[str], tol: float = TOL, cuda: bool = False) -> None:
    """Run `python <test_file> --triton` with TRITON_INTERPRET=1 (it must be set before triton is
    imported, hence a process of its own), or with `cuda` `--triton --cuda` compiled for the GPU;
    each case prints {"case", "err"}: all must be there and within tol."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if not cuda:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, test_file, "--triton", *(["--cuda"] if cuda else [])],
                          cwd=Path(test_file).parent, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {r["case"] for r in rows} == case_names
    for r in rows:
        assert r["err"] <= tol, r


def shuffled_block_tables(lens: list[int], block_size: int, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """Block tables int32 [len(lens), max blocks] for sequences of `lens` keys over one pool of
    shuffled blocks (one spare), and the pool's block count."""
    nbs = [-(-n // block_size) for n in lens]
    total = sum(nbs) + 1
    perm = torch.randperm(total, generator=g).to(torch.int32)
    tables = torch.zeros(len(lens), max(nbs), dtype=torch.int32)
    at = 0
    for i, nb in enumerate(nbs):
        tables[i, :nb] = perm[at : at + nb]
        at += nb
    return tables, total


# ---- tiny NSA checkpoints (tests/engine/test_nsa_engine.py, test_kv_tiers_sparse.py) ----------
NSA_SMALL = {"compress_block": 8, "compress_stride": 4, "select_block": 16, "top_n": 3, "init_blocks": 1,
             "local_blocks": 1, "window": 24}


def nsa_hf_config(nsa: dict[str, Any] | None = None, **over: Any) -> dict[str, Any]:
    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "eos_token_id": 1,
        "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "float32",
        "nsa": dict(NSA_SMALL if nsa is None else nsa),
    }
    cfg.update(over)
    return cfg


def random_nsa_model(hf: dict[str, Any], seed: int = 0):
    from cuttle.engine.config import ModelConfig
    from cuttle.engine.models.transformer import CausalLM

    torch.manual_seed(seed)
    model = CausalLM(ModelConfig.from_hf(hf), torch.float32, torch.device("cpu"))
    peaked_init_(model)
    return model


def make_nsa_checkpoint(path: str, nsa: dict[str, Any] | None = None, seed: int = 0, **over: Any):
    hf = nsa_hf_config(nsa, **over)
    model = random_nsa_model(hf, seed)
    save_checkpoint(path, hf, model)
    return model
