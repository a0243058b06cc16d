"""Sampler semantics against direct references; stops, min_tokens, penalties; detokenization."""
from __future__ import annotations

import math

import pytest
import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.sampler import SampleRequest, counter_uniform, sample


def row(params: SamplingParams, step: int = 0, out: list[int] | None = None, prompt: list[int] | None = None) -> SampleRequest:
    return SampleRequest(params, seed=1, index=0, step=step, prompt_ids=prompt or [], output_ids=out or [], stop_ids=[0])


def support(logits: torch.Tensor, params: SamplingParams, draws: int = 300) -> set[int]:
    seen = set()
    for s in range(draws):
        r = row(params, step=s)
        seen.add(sample(logits.clone()[None], [r])[0].token)
    return seen


def test_counter_uniform_is_deterministic_and_spread():
    u = counter_uniform([7] * 1000, [0] * 1000, list(range(1000)))
    assert torch.equal(u, counter_uniform([7] * 1000, [0] * 1000, list(range(1000))))
    assert 0.45 < u.mean().item() < 0.55 and u.min() >= 0 and u.max() < 1
    assert not torch.equal(u[:10], counter_uniform([7] * 10, [1] * 10, list(range(10))))


def test_top_k_top_p_min_p_supports():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    assert support(logits, SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    assert support(logits, SamplingParams(temperature=1.0, top_p=0.7)) == {0, 1}  # 0.4 + 0.3 reaches 0.7
    assert support(logits, SamplingParams(temperature=1.0, top_p=0.71)) == {0, 1, 2}
    assert support(logits, SamplingParams(temperature=1.0, min_p=0.3)) == {0, 1, 2}  # >= 0.12
    assert support(logits, SamplingParams(temperature=0)) == {0}


def test_processed_logprobs_are_the_sampling_distribution():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    res = sample(logits.clone()[None], [row(SamplingParams(temperature=0.5, top_k=2, logprobs=2))])[0]
    z = torch.tensor([0.4, 0.3]) ** 2
    want = torch.log(z / z.sum())
    assert res.token in (0, 1)
    assert math.isclose(res.logprob, want[res.token].item(), abs_tol=1e-6)
    assert set(res.top) == {0, 1} and res.top[0].rank == 1
    raw = sample(logits.clone()[None], [row(SamplingParams(temperature=0.5, top_k=2, logprobs=0))], "raw")[0]
    assert math.isclose(raw.logprob, math.log([0.4, 0.3][raw.token]), abs_tol=1e-6)


def test_empirical_frequencies_match_probabilities():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    counts = torch.zeros(4)
    logits = probs.log()
    n = 4000
    rows = [SampleRequest(SamplingParams(temperature=1.0), seed=3, index=0, step=s, prompt_ids=[], output_ids=[], stop_ids=[]) for s in range(n)]
    for r in sample(logits.repeat(n, 1), rows):
        counts[r.token] += 1
    assert torch.allclose(counts / n, probs, atol=0.03)


def test_penalties():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    p = SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    r = SampleRequest(p, 0, 0, 2, prompt_ids=[2], output_ids=[0, 0], stop_ids=[])
    from cuttle.engine.sampler import apply_penalties

    apply_penalties(logits, [r])
    assert torch.allclose(logits, torch.tensor([[2.0 / 2 - 0.5 - 0.5, 1.0, -2.0, 0.5]]))


def test_min_tokens_suppresses_stop_ids():
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    r = SampleRequest(SamplingParams(temperature=0, min_tokens=3), 0, 0, 1, [], [], stop_ids=[0])
    assert sample(logits.clone(), [r])[0].token != 0
    r.step = 3
    assert sample(logits.clone(), [r])[0].token == 0


def test_stop_strings_and_stop_ids_end_generation(qwen3_path):
    llm = LLM(qwen3_path, dtype="float32", num_kv_blocks=64)
    tok = llm.get_tokenizer()
    base = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    third = base.token_ids[2]
    stopped = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[third], ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == base.token_ids[:3] and stopped.finish_reason == "stop" and stopped.stop_reason == third
    piece = tok.decode(base.token_ids[3:4])
    # the text as detokenized in context (what a stop-string request sees)
    full_text = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, stop=["never-there"], ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    cut = full_text.index(piece)
    by_str = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, stop=[piece], ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert by_str.finish_reason == "stop" and by_str.stop_reason == piece
    assert by_str.text == full_text[:cut] and piece not in by_str.text
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_incremental_detokenizer_never_emits_broken_utf8(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from cuttle.engine.tokenizer import IncrementalDetokenizer
    from cuttle.engine.tokenizer import Tokenizer as CuttleTokenizer

    text = "héllo wörld — café ☕ naïve 日本語のテキスト 🐍🐍 emoji ok " * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    t = CuttleTokenizer(str(tmp_path))
    ids = t.encode("日本語 🐍 café ☕")
    # split multi-byte characters across tokens: encode byte by byte with the base alphabet
    det = IncrementalDetokenizer(t, [], True)
    pieces = []
    for i in range(1, len(ids) + 1):
        d = det.step(ids[:i])
        assert "\ufffd" not in d
        pieces.append(d)
    assert "".join(pieces) == t.decode(ids)
    assert any(p == "" for p in pieces) or len(ids) == len("日本語 🐍 café ☕")


@pytest.mark.parametrize("bad", [{"role": "user"}])
def test_chat_template_errors_are_value_errors(qwen3_path, bad):
    llm = LLM(qwen3_path, dtype="float32", num_kv_blocks=32)
    with pytest.raises((ValueError, KeyError)):
        llm.chat([bad], SamplingParams(max_tokens=2), use_tqdm=False)
    out = llm.chat([{"role": "user", "content": "a b c"}], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    tok = llm.get_tokenizer()
    assert out[0].prompt_token_ids == tok.encode("<|im_start|>user\na b c<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def test_greedy_rows_with_something_to_apply_leave_the_plain_argmax():
    """Plain greedy rows are answered by the argmax alone; a greedy row with penalties, logprobs,
    an active min_tokens, a token mask or raw logprobs must still get them (in any batch)."""
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    logits[:, 7] = 9.0  # the argmax of every row
    plain = SampleRequest(SamplingParams(temperature=0), 0, 0, 1, [], [], stop_ids=[7])
    assert [(r.token, r.logprob, r.top) for r in sample(logits.clone(), [plain] * 5)] == [(7, 0.0, None)] * 5
    raw = sample(logits.clone(), [plain] * 5, "raw")
    assert [r.token for r in raw] == [7] * 5
    want = torch.log_softmax(logits, dim=-1)[:, 7]
    assert torch.allclose(torch.tensor([r.logprob for r in raw]), want) and all(r.logprob != 0.0 for r in raw)
    penalized = SampleRequest(SamplingParams(temperature=0, repetition_penalty=10.0), 0, 0, 1, [7], [], stop_ids=[])
    with_lp = SampleRequest(SamplingParams(temperature=0, logprobs=1), 0, 0, 1, [], [], stop_ids=[])
    min_tok = SampleRequest(SamplingParams(temperature=0, min_tokens=3), 0, 0, 1, [], [], stop_ids=[7])
    out = sample(logits.clone(), [plain, penalized, with_lp, min_tok, plain])
    assert out[0].token == 7 and out[4].token == 7
    assert out[1].token != 7 and out[3].token != 7
    assert out[2].token == 7 and math.isclose(out[2].logprob, want[2].item(), rel_tol=1e-6) and 7 in out[2].top
    # each beside plain rows only (the batch the argmax alone would otherwise answer)
    assert [r.token for r in sample(logits[:2].clone(), [plain, penalized])] == [7, out[1].token]
    assert [r.token for r in sample(logits[:4].clone(), [plain, plain, plain, min_tok])] == [7, 7, 7, out[3].token]
    assert sample(logits[2:3].clone(), [with_lp])[0].top == out[2].top
