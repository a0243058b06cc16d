"""The NSA model option: config.json's "nsa" object (our names and fla-org's), the NSA layer's
weights under their HF names, and its training path (autograd through the torch reference).
`make_nsa_checkpoint` builds the tiny random NSA checkpoints the engine tests use (no download)."""
from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from cuttle.attention.nsa import NSAConfig
from cuttle.engine.config import ModelConfig
from cuttle.engine.models.loader import hf_state_dict, load_model, load_weights
from cuttle.engine.models.nsa_config import nsa_config
from cuttle.engine.models.transformer import CausalLM, NSAAttention

from helpers import write_tokenizer

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


def random_nsa_model(hf: dict[str, Any], seed: int = 0) -> CausalLM:
    """A CausalLM with random weights large enough that attention and block scores are peaked
    (near-uniform scores would make the top-n choice a coin toss between paths)."""
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig.from_hf(hf), torch.float32, torch.device("cpu"))
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
    return model


def make_nsa_checkpoint(path: str, nsa: dict[str, Any] | None = None, seed: int = 0, **over: Any) -> CausalLM:
    hf = nsa_hf_config(nsa, **over)
    model = random_nsa_model(hf, seed)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    save_file({k: v.contiguous().clone() for k, v in hf_state_dict(model).items()}, os.path.join(path, "model.safetensors"))
    write_tokenizer(path, hf["vocab_size"])
    return model


def test_config_fields_and_fla_names():
    cfg = nsa_config(nsa_hf_config({"block_size": 32, "block_counts": 4, "window_size": 64, "compress_block": 16,
                                    "compress_stride": 8}))
    assert cfg == NSAConfig(compress_block=16, compress_stride=8, select_block=32, top_n=4, window=64)
    assert nsa_config({"architectures": ["Qwen3ForCausalLM"]}) is None
    assert nsa_config(nsa_hf_config({})) == NSAConfig()


@pytest.mark.parametrize(
    "nsa,over,match",
    [
        ({"select_block": 40}, {}, r"nsa\.select_block"),
        ({"window": -4}, {}, r"nsa\.window"),
        ({"top_n": 20, "select_block": 64}, {"max_position_embeddings": 512}, r"nsa\.top_n"),
        ({"block_size": 64, "select_block": 64}, {}, r"select_block given twice"),
        ({"blocks": 3}, {}, r"nsa\.blocks is not an NSA field"),
    ],
)
def test_bad_nsa_config_is_refused_naming_the_field(nsa, over, match):
    with pytest.raises(ValueError, match=match):
        CausalLM(ModelConfig.from_hf(nsa_hf_config(nsa, **over)), torch.float32, torch.device("cpu"))


def test_weights_round_trip_under_hf_names(tmp_path):
    model = make_nsa_checkpoint(str(tmp_path))
    names = set(hf_state_dict(model))
    for i in range(2):
        for n in ("g_proj", "compress_k", "compress_v"):
            assert f"model.layers.{i}.self_attn.{n}.weight" in names
    loaded = load_model(str(tmp_path), model.cfg, torch.float32, torch.device("cpu"))
    assert isinstance(loaded.layers[0].attn, NSAAttention)
    for (n, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), n
    # a dense model has no place for NSA tensors: refused, not dropped
    dense = CausalLM(ModelConfig.from_hf({k: v for k, v in nsa_hf_config().items() if k != "nsa"}), torch.float32,
                     torch.device("cpu"))
    with pytest.raises(ValueError, match="g_proj"):
        load_weights(dense, [("model.layers.0.self_attn.g_proj.weight", torch.zeros(12, 64))])


def test_training_path_learns_through_every_nsa_weight():
    model = random_nsa_model(nsa_hf_config({**NSA_SMALL, "window": 8}), seed=1)
    params = [p for p in model.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=3e-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (2, 48), generator=g)
    pos = torch.arange(48).expand(2, -1)
    mask = torch.ones(48, 48, dtype=torch.bool).tril().expand(2, -1, -1)
    losses = []
    for _ in range(4):
        hidden = model.forward_masked(ids[:, :-1], pos[:, :-1], mask[:, :-1, :-1])
        logits = hidden @ model.lm_head.T
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        attn = model.layers[0].attn
        for w in (attn.g_weight, attn.ck_weight, attn.cv_weight, attn.qkv_weight):
            assert w.grad is not None and w.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    packed = mask.clone()
    packed[:, 30:, :30] = False  # two documents in a row: not a layout NSA layers take
    with pytest.raises(NotImplementedError, match="causal"):
        model.forward_masked(ids, pos, packed)
