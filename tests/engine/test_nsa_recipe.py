"""The `--attention nsa` variant of the default model's recipe (engine/train_default_model.py) on
tiny data: a dense model turned into an NSA one by `nsa_from_dense` starts where the design says
(gates 1/2, phi = block means), a few training steps on causal rows lower the loss, and the saved
checkpoint loads in the engine (`LLM(model=...)`) with the log-probabilities of the training
forward at every position (fp32 within 1e-5)."""
from __future__ import annotations

import argparse
import random

import torch

from cuttle.attention.nsa import compress
from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import ModelConfig
from cuttle.engine.models.transformer import CausalLM
from sparse_helpers import check_against_reference

from cuttle.engine.train_default_model import (
    causal_rows, evaluate, init_weights, nsa_from_dense, round_to_saved, save_causal, train, train_tokenizer,
)

NSA = dict(compress_block=8, compress_stride=4, select_block=16, top_n=3, init_blocks=1, local_blocks=1, window=16,
           compress_fn="linear")


def tiny_hf(vocab: int, nsa: bool) -> dict:
    hf = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=64,
              num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
              max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
              hidden_act="silu", attention_bias=False, torch_dtype="float32", vocab_size=vocab, eos_token_id=0,
              bos_token_id=None)
    if nsa:
        hf["nsa"] = dict(NSA)
    return hf


def code_texts() -> list[str]:
    """Three code-like texts made here, fixed for good: the test once trained on the repository's own
    sources, so an edit to one of them could give the trained model an exact router tie (two experts
    equal in fp32) that the engine's rounding breaks the other way; a failure then said nothing about
    the edit."""
    g = random.Random(0)
    words = ["block", "score", "keys", "query", "select", "window", "compress", "gate", "layer", "head", "index",
             "value", "mask", "top", "local", "init", "stride", "weight", "scale", "cache"]
    texts = []
    for module in range(3):
        lines = [f'"""module {module}: helpers for {g.choice(words)} {g.choice(words)}."""', "import torch", ""]
        for f in range(40):
            a, b, c = g.sample(words, 3)
            lines += [f"def {a}_{b}_{f}({a}, {b}, {c}=None):", f"    # the {c} of each {a}",
                      f"    {c} = {a}.{g.choice(['sum', 'mean', 'amax', 'softmax'])}(-1) * {b}",
                      f"    if {c} is None:", f"        return {a}", f"    return torch.{g.choice(['cat', 'stack'])}([{a}, {c}])", ""]
        texts.append("\n".join(lines))
    return texts


def test_nsa_recipe_trains_and_its_checkpoint_serves_the_training_forward(tmp_path):
    torch.manual_seed(0)
    texts = code_texts()
    tok = train_tokenizer(texts, 400)
    docs = [tok.encode(t).ids[:600] + [0] for t in texts]
    rows = causal_rows(docs, 96)
    assert rows[0].shape == (len(docs) * 7, 96)  # 601 tokens a doc: 6 full pieces and one of 25

    dense = CausalLM(ModelConfig.from_hf(tiny_hf(tok.get_vocab_size(), nsa=False)), torch.float32, torch.device("cpu"))
    init_weights(dense, 0)
    hf = tiny_hf(tok.get_vocab_size(), nsa=True)
    model = nsa_from_dense(dense, hf)
    attn, dattn = model.layers[0].attn, dense.layers[0].attn
    assert torch.equal(attn.qkv_weight, dattn.qkv_weight) and torch.equal(attn.o_weight, dattn.o_weight * (2 / 3))
    assert torch.count_nonzero(attn.g_weight) == 0  # every gate sigmoid(0) = 1/2
    k = torch.randn(40, 2, 16)
    assert torch.allclose(compress(k, attn.ck_weight, model.nsa), k.unfold(0, 8, 4).mean(-1), atol=1e-6)

    before = evaluate(model, rows, 8)
    losses = train(model, rows, steps=12, batch=4, lr=3e-3, seed=0, autocast=False, progress=False)
    round_to_saved(model)
    after = evaluate(model, rows, 8)
    assert after < before - 0.3, (before, after, losses)

    args = argparse.Namespace(out=str(tmp_path), init=None, steps=12, batch=4, seq_len=96, tool_chats=0, lr=3e-3,
                              autocast="off", seed=0, attention="nsa", rows="causal")
    save_causal(args, model, hf, tok, {96: after}, 0.1, 1.0, 1, rows[0].shape[0], 1)

    prompt = docs[0][:70]
    llm = LLM(str(tmp_path), dtype="float32", attention_backend="torch", max_num_batched_tokens=32)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=2),
                       use_tqdm=False)[0]
    compared = check_against_reference(model, [out], with_prompt=True)
    assert compared >= 2 * (len(prompt) - 1 + 12)
