"""Tiny random HF checkpoints built from configs into a directory (no download), and the
transformers oracle's greedy outputs. Shared by the engine, RL and server tests."""
from __future__ import annotations

import json
import os
from typing import Any

import torch

ARCHS = ["qwen3", "qwen3_moe", "llama"]
NEW_TOKENS = 48


def parity_prompts() -> list[list[int]]:
    import random

    rng = random.Random(1234)
    lengths = [3, 9, 16, 17, 31, 40, 57, 70]  # below, at and across block boundaries
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


_VOCAB_CHARS = [chr(c) for c in range(33, 127)]


def write_tokenizer(path: str, vocab_size: int, extra_specials: tuple[str, ...] = ()) -> None:
    """A word-level tokenizer over printable chars + filler tokens, with ChatML specials (and
    `extra_specials` after them, inside the vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_specials]
    vocab: dict[str, int] = {}
    for t in specials + _VOCAB_CHARS:
        vocab[t] = len(vocab)
    i = 0
    while len(vocab) < vocab_size:
        vocab[f"w{i}"] = len(vocab)
        i += 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(specials)
    tok.save(os.path.join(path, "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": template, "eos_token": "<|im_end|>", "bos_token": None}, f)



def tiny_mistral(window: int | None, layers: int = 3, head_dim: int = 24, max_positions: int = 1024):
    """A random tiny MistralForCausalLM (float32, eval) with sliding window `window` (None: none)
    on every layer; head_dim is not hidden / heads, as in Mistral's own checkpoints."""
    import transformers

    from moe_families import randomize_

    cfg = transformers.MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                                     max_position_embeddings=max_positions, rms_norm_eps=1e-6, rope_theta=10000.0,
                                     sliding_window=window, tie_word_embeddings=False, eos_token_id=1, bos_token_id=None)
    return randomize_(transformers.MistralForCausalLM(cfg).float().eval(), 0.15, seed=7)


def interleaving_ops(max_prompt: int, max_tokens: int, max_steps: int, max_size: int):
    """The hypothesis strategy of `run_interleaving`'s operations."""
    from hypothesis import strategies as st

    return st.lists(st.one_of(
        st.tuples(st.just("add"), st.integers(1, max_prompt), st.integers(1, max_tokens), st.integers(1, 3), st.booleans()),
        st.tuples(st.just("step"), st.integers(1, max_steps)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ), min_size=1, max_size=max_size)


def run_interleaving(engine, ops: list[tuple], base: list[int], shared: bool) -> None:
    """Property tests of the block manager: each op on a live engine ("add", prompt length,
    max_tokens, n, greedy) / ("step", k) / ("abort", which), every block's references checked to be
    its holders' after each op and each step of the drain, every block free at the end. `shared`:
    prompts are prefixes of `base` (prefix-cache hits), else each its own."""
    from cuttle.engine import SamplingParams

    bm = engine.block_manager
    live: list[str] = []

    def check() -> None:
        bm.check_invariants([s for r in engine.requests.values() for s in r.seqs if not s.is_finished])

    for k, op in enumerate(ops):
        if op[0] == "add":
            _, plen, max_tokens, n, greedy = op
            toks = (base * 3)[:plen] if shared else [3 + (k * 7 + i) % 250 for i in range(plen)]
            rid = f"q{len(engine.requests)}-{k}-{id(op)}"
            engine.add_request(rid, toks, SamplingParams(n=n, temperature=0 if greedy else 1.0, max_tokens=max_tokens, ignore_eos=True))
            live.append(rid)
        elif op[0] == "step":
            for _ in range(op[1]):
                engine.step()
        elif live:
            engine.abort_request(live.pop(op[1] % len(live)))
        check()
    while engine.has_unfinished_requests():
        engine.step()
        check()
    assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]
    assert all(b.ref_count == 0 for b in bm.blocks)


def save_checkpoint(path: str, model) -> tuple[str, object]:
    """A transformers model saved HF-style in `path` with the test tokenizer over its vocabulary:
    (path, model), what the model tests' fixtures return."""
    model.save_pretrained(path)
    write_tokenizer(path, model.config.vocab_size)
    return path, model

def tiny_config(arch: str, **over: Any):
    import transformers

    common = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
        eos_token_id=1, bos_token_id=None,
    )
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(**{"head_dim": 16, **common, **over})
    elif arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**{
            "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
            "norm_topk_prob": True, "mlp_only_layers": [], **common, **over,
        })
    elif arch == "llama":
        cfg = transformers.LlamaConfig(
            head_dim=16,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 128},
            **{**common, **over},
        )
    else:
        raise ValueError(arch)
    return cfg


def make_checkpoint(path: str, arch: str, seed: int = 0, **over: Any):
    """Random model (weights scaled up so greedy outputs are not all one token) saved HF-style."""
    import transformers

    cfg = tiny_config(arch, **over)
    torch.manual_seed(seed)
    model_cls = {"qwen3": transformers.Qwen3ForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
                 "llama": transformers.LlamaForCausalLM}[arch]
    model = model_cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, cfg.vocab_size)
    return model


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], list[list[float]], list[list[float]]]:
    """transformers greedy tokens, chosen-token logprobs, and prompt logprobs, one prompt at a time."""
    toks, lps, plps = [], [], []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
            gen = out.sequences[0, len(p):].tolist()
            step_lp = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(out.logits, gen)]
            full = model(ids).logits[0].float().log_softmax(-1)
            prompt_lp = [full[i, p[i + 1]].item() for i in range(len(p) - 1)]
        toks.append(gen)
        lps.append(step_lp)
        plps.append(prompt_lp)
    return toks, lps, plps


def assert_scored_by_transformers(model, prompt: list[int], out, tol: float, prompt_logprobs: bool = True) -> None:
    """An engine output (greedy, with logprobs=0, and prompt_logprobs=0 unless `prompt_logprobs` is
    False) against transformers (or a peft model) scoring the whole sequence in one forward: its
    argmax at every generated position must be the engine's token (by induction, its own greedy
    `generate`), and every logprob within `tol`."""
    c = out.outputs[0]
    with torch.no_grad():
        hf = model(torch.tensor([prompt + c.token_ids])).logits[0].float().log_softmax(-1)
    n = len(prompt)
    assert hf[n - 1 : -1].argmax(-1).tolist() == c.token_ids
    for step, tok in enumerate(c.token_ids):
        assert abs(c.logprobs[step][tok].logprob - hf[n - 1 + step, tok].item()) <= tol
    for pos in range(1, n if prompt_logprobs else 1):
        assert abs(out.prompt_logprobs[pos][prompt[pos]].logprob - hf[pos - 1, prompt[pos]].item()) <= tol


def mistral_tokenizer_dir(src: str, d) -> str:
    """A model directory `d` holding the tokenizer.json transformers makes of a Mistral vocabulary
    `src` (a Tekken .json, or a SentencePiece model) as the HF repos ship it, with <s> / </s>;
    returns its path (for cuttle's `Tokenizer`)."""
    import json
    import os
    import shutil

    if src.endswith(".json"):
        from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

        convert_tekken_tokenizer(src, chat_template="{{ messages }}")._tokenizer.save(os.path.join(d, "tokenizer.json"))
    else:
        from transformers import LlamaTokenizer

        shutil.copy(src, os.path.join(d, "tokenizer.model"))
        LlamaTokenizer.from_pretrained(str(d), legacy=False)._tokenizer.save(os.path.join(d, "tokenizer.json"))
        os.remove(os.path.join(d, "tokenizer.model"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
    return str(d)


def assert_packed_forward_is_transformers(path: str, model, docs: list[list[int]], tol: float = 1e-4) -> None:
    """cuttle's training forward (`forward_packed`, fp32) of `docs` packed in one row, positions
    restarting per document, against transformers scoring each document alone."""
    from cuttle.engine.config import ModelConfig
    from cuttle.engine.models import load_model

    ours = load_model(path, ModelConfig.from_pretrained(path), torch.float32, torch.device("cpu"))
    ids = torch.tensor([[t for d in docs for t in d]])
    positions = torch.tensor([[p for d in docs for p in range(len(d))]])
    doc_ids = torch.tensor([[i for i, d in enumerate(docs) for _ in d]])
    with torch.no_grad():
        got = ours.compute_logits(ours.forward_packed(ids, positions, doc_ids))[0].log_softmax(-1)
        want = torch.cat([model(torch.tensor([d])).logits[0].float().log_softmax(-1) for d in docs])
    torch.testing.assert_close(got, want, rtol=0, atol=tol)


def assert_generates_as_transformers(path: str, model, prompts: list[list[int]], max_tokens: int = 16, tol: float = 1e-4) -> None:
    """The engine (fp32, chunked prefill: 24-token chunks) greedy on `prompts`, every step's and
    every prompt position's logprob scored by `model` (transformers) within `tol`."""
    from cuttle.engine import LLM, SamplingParams

    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, prompt_logprobs=0),
                        use_tqdm=False)
    for prompt, o in zip(prompts, outs):
        assert_scored_by_transformers(model, prompt, o, tol)


def assert_hf_names_round_trip(path: str, model) -> None:
    """The loaded model's `hf_state_dict` names and values are transformers' (a tied lm_head,
    which is the embedding, aside)."""
    from cuttle.engine.config import ModelConfig
    from cuttle.engine.models import load_model
    from cuttle.engine.models.loader import hf_state_dict

    names, theirs = hf_state_dict(load_model(path, ModelConfig.from_pretrained(path), torch.float32, torch.device("cpu"))), model.state_dict()
    tied = model.config.tie_word_embeddings
    assert set(names) == set(theirs) - ({"lm_head.weight"} if tied else set())
    for k, t in names.items():
        assert torch.equal(t, theirs[k]), k


def each_scheduled_step(engine):
    """Step `engine` until nothing is left, yielding each step's schedule before the step runs it
    (the engine prepares, stages, captures or replays it as usual): what a test inspects between
    the scheduler and the runner."""
    while engine.has_unfinished_requests():
        sched = engine.scheduler.schedule()
        yield sched
        engine.scheduler.schedule = lambda s=sched: s
        try:
            engine.step()
        finally:
            del engine.scheduler.schedule
