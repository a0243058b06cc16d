"""fla-org NSAForCausalLM checkpoints (issue 16): a tiny synthetic checkpoint written in fla-org's
config and tensor names loads (`LLM(model=...)`), and the engine's log-probabilities at every
position equal an independent per-token implementation of fla-org's model written here from its
description (docs/nsa.md, reference/attention-anchors.md section 2: RMSNorm + SwiGLU + RoPE, NSA with
mean-pooled compression over blocks of `block_size`, the query's own block forced and
`block_counts` blocks in all, a `window_size` window, gates sigmoid(g_proj) with row 3h + branch),
fp32 within 1e-5. Unmapped fields are refused, naming them."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import ModelConfig
from cuttle.engine.models.nsa_config import nsa_config

from helpers import write_tokenizer

TOL = 1e-5
FLA = {"architectures": ["NSAForCausalLM"], "model_type": "nsa", "hidden_size": 64, "num_hidden_layers": 2,
       "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "qkv_bias": False, "block_size": 8, "block_counts": 3,
       "window_size": 12, "rope_theta": 10000.0, "max_position_embeddings": 256, "hidden_ratio": 4,
       "intermediate_size": None, "hidden_act": "swish", "initializer_range": 0.02, "elementwise_affine": True,
       "norm_eps": 1e-6, "use_cache": True, "pad_token_id": None, "bos_token_id": None, "eos_token_id": 1,
       "tie_word_embeddings": False, "fuse_norm": True, "fuse_swiglu": True, "fuse_cross_entropy": True,
       "vocab_size": 256}


def fla_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hid, h, hkv, d, inter = 64, 4, 2, 16, 256  # inter: fla's GatedMLP for hidden 64, ratio 4 (170 -> 256)

    def w(*shape, s=0.15):
        return torch.randn(*shape, generator=g) * s

    out = {"model.embeddings.weight": w(256, hid, s=1.0), "model.norm.weight": 1 + w(hid, s=0.1), "lm_head.weight": w(256, hid)}
    for i in range(2):
        p = f"model.layers.{i}."
        out.update({p + "attn_norm.weight": 1 + w(hid, s=0.1), p + "mlp_norm.weight": 1 + w(hid, s=0.1),
                    p + "attn.q_proj.weight": w(h * d, hid, s=0.4), p + "attn.k_proj.weight": w(hkv * d, hid, s=0.4),
                    p + "attn.v_proj.weight": w(hkv * d, hid), p + "attn.o_proj.weight": w(hid, h * d),
                    p + "attn.g_proj.weight": w(3 * h, hid, s=0.5), p + "mlp.gate_proj.weight": w(inter, hid),
                    p + "mlp.up_proj.weight": w(inter, hid), p + "mlp.down_proj.weight": w(hid, inter)})
    return out


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta=10000.0):  # x [S, H, D], rotate-half (non-interleaved) RoPE
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None].float(), torch.cat([ang.sin()] * 2, -1)[:, None].float()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def softmax_attend(q, k, v, scale):  # q [G, D], k/v [N, D]; no key -> 0
    if k.shape[0] == 0:
        return torch.zeros_like(q)
    return torch.softmax(q @ k.T * scale, -1) @ v


def fla_nsa_layer(q, k, v, gates, bs: int, n: int, window: int):
    """One layer's NSA, token by token: q [S, H, D], k/v [S, Hkv, D] after RoPE, gates [S, H, 3]."""
    S, H, D = q.shape
    hkv = k.shape[1]
    G, scale = H // hkv, D**-0.5
    out = torch.zeros_like(q)
    for t in range(S):
        for h in range(hkv):
            qs = q[t, h * G : (h + 1) * G]
            nc = (t + 1) // bs  # complete blocks: mean-pooled keys / values
            ck = torch.stack([k[i * bs : (i + 1) * bs, h].mean(0) for i in range(nc)]) if nc else k.new_zeros(0, D)
            cv = torch.stack([v[i * bs : (i + 1) * bs, h].mean(0) for i in range(nc)]) if nc else k.new_zeros(0, D)
            o_cmp = softmax_attend(qs, ck, cv, scale)
            imp = torch.softmax(qs @ ck.T * scale, -1).sum(0) if nc else torch.zeros(0)
            own = t // bs
            rest = sorted((i for i in range(nc) if i != own), key=lambda i: (-imp[i].item(), i))[: n - 1]
            keys = [j for b in sorted({own, *rest}) for j in range(b * bs, min(b * bs + bs, t + 1))]
            o_slc = softmax_attend(qs, k[keys, h], v[keys, h], scale)
            lo = max(0, t - window + 1)
            o_win = softmax_attend(qs, k[lo : t + 1, h], v[lo : t + 1, h], scale)
            g = gates[t, h * G : (h + 1) * G]
            out[t, h * G : (h + 1) * G] = g[:, 0:1] * o_cmp + g[:, 1:2] * o_slc + g[:, 2:3] * o_win
    return out


def fla_logprobs(wts: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
    x = wts["model.embeddings.weight"][torch.tensor(tokens)]
    pos = torch.arange(len(tokens))
    for i in range(2):
        p = f"model.layers.{i}."
        h = rms(x, wts[p + "attn_norm.weight"])
        q = rope((h @ wts[p + "attn.q_proj.weight"].T).view(-1, 4, 16), pos)
        k = rope((h @ wts[p + "attn.k_proj.weight"].T).view(-1, 2, 16), pos)
        v = (h @ wts[p + "attn.v_proj.weight"].T).view(-1, 2, 16)
        gates = torch.sigmoid(h @ wts[p + "attn.g_proj.weight"].T).view(-1, 4, 3)
        o = fla_nsa_layer(q, k, v, gates, FLA["block_size"], FLA["block_counts"], FLA["window_size"])
        x = x + o.reshape(len(tokens), -1) @ wts[p + "attn.o_proj.weight"].T
        h = rms(x, wts[p + "mlp_norm.weight"])
        gate, up = h @ wts[p + "mlp.gate_proj.weight"].T, h @ wts[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ wts[p + "mlp.down_proj.weight"].T
    return (rms(x, wts["model.norm.weight"]) @ wts["lm_head.weight"].T).log_softmax(-1)


def write_fla_checkpoint(path: str, cfg: dict, wts: dict[str, torch.Tensor]) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in wts.items()}, os.path.join(path, "model.safetensors"))
    write_tokenizer(path, 256)


def test_fla_checkpoint_loads_and_equals_fla_model(tmp_path):
    wts = fla_weights()
    write_fla_checkpoint(str(tmp_path), FLA, wts)
    mc = ModelConfig.from_pretrained(str(tmp_path))
    assert mc.intermediate_size == 256 and mc.num_kv_heads == 2 and not mc.qk_norm
    assert mc.hf_config["nsa"] == {"compress_block": 8, "compress_stride": 8, "select_block": 8, "top_n": 3,
                                   "init_blocks": 0, "local_blocks": 1, "window": 12, "compress_fn": "mean"}
    llm = LLM(str(tmp_path), dtype="float32", attention_backend="torch", max_num_batched_tokens=16)
    prompts = [[(7 * i + 3) % 250 + 3 for i in range(n)] for n in (5, 30, 61)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2, prompt_logprobs=2),
                        use_tqdm=False)
    compared = 0
    for prompt, o in zip(prompts, outs):
        full = prompt + list(o.outputs[0].token_ids)
        ref = fla_logprobs(wts, full[:-1])
        rows = [(p - 1, lps) for p, lps in enumerate(o.prompt_logprobs) if p > 0]
        rows += [(len(prompt) - 1 + s, lps) for s, lps in enumerate(o.outputs[0].logprobs)]
        for r, lps in rows:
            for t, lp in lps.items():
                assert abs(lp.logprob - ref[r, t].item()) <= TOL, (len(prompt), r, t)
                compared += 1
    assert compared > 2 * (5 + 30 + 61 + 27)


@pytest.mark.parametrize("over, match", [
    ({"elementwise_affine": False}, "elementwise_affine"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attn": {"layers": [0]}}, r"\['attn'\]"),
    ({"block_counts": [4, 4]}, "block_counts"),
    ({"block_counts": 64}, "nsa.top_n"),
])
def test_unmapped_fla_fields_are_refused(over, match):
    with pytest.raises(ValueError, match=match):
        nsa_config(ModelConfig.from_hf({**FLA, **over}).hf_config)
