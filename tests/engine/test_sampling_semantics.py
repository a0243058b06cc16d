"""Offline API edges a third probe found (each test failed before its fix): token ids past the
vocabulary in stop_token_ids, a malformed prompt after good ones, controls that leave no token to
sample, booleans and stop fields of the wrong type, the repetition penalty over squid documents,
vLLM's rules for stop strings under min_tokens and for a stop token's text, and `LLM.chat`'s
prompt text. The model is the tests' tiny random Qwen3 (word-level tokenizer, EOS id 2)."""
from __future__ import annotations

import pytest
import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.tokenizer import IncrementalDetokenizer
from helpers import make_checkpoint
from squid_oracle import dense_logits, layout_rows

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def llm(qwen3_path):
    return LLM(qwen3_path, dtype="float32", num_kv_blocks=64)


def _idle(llm) -> bool:
    s = llm.stats()
    return not llm.engine.has_unfinished_requests() and s["kv_blocks_free"] == s["kv_blocks_total"]


def _greedy(llm, n=10, **kw):
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw), use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("min_tokens", [0, 2])
def test_stop_token_ids_past_the_vocabulary_are_refused(llm, min_tokens):
    """With min_tokens the sampler indexed the logits with the id: the step raised and took every
    request in it down (offline the whole call, on the server all requests in flight)."""
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, min_tokens=min_tokens, stop_token_ids=[vocab]), use_tqdm=False)
    assert _idle(llm)
    assert len(_greedy(llm, 4).token_ids) == 4


@pytest.mark.parametrize("bad", [None, 3.5, object()])
def test_a_malformed_prompt_after_good_ones_leaves_nothing_queued(llm, bad):
    """A TypeError from the second prompt left the first one queued; it then ran unseen inside the
    next call (8 tokens generated for a 2-token call, blocks held)."""
    with pytest.raises(ValueError, match="prompt must be"):
        llm.generate([PROMPT, bad], SamplingParams(max_tokens=2), use_tqdm=False)
    assert _idle(llm)
    before = llm.stats()["generated_tokens"]
    _greedy(llm, 2)
    assert llm.stats()["generated_tokens"] - before == 2


def test_controls_that_leave_no_token_are_refused_at_admission(llm):
    tok = llm.get_tokenizer()
    word = tok.decode([40])
    with pytest.raises(ValueError, match="allowed_token_ids .* banned by bad_words"):
        llm.generate([PROMPT], SamplingParams(max_tokens=3, allowed_token_ids=[40], bad_words=[word]), use_tqdm=False)
    # left: EOS only, which min_tokens forbids
    with pytest.raises(ValueError, match="min_tokens"):
        llm.generate([PROMPT], SamplingParams(max_tokens=3, min_tokens=2, allowed_token_ids=[40, 2], bad_words=[word]), use_tqdm=False)
    assert _idle(llm)


def test_a_row_its_controls_empty_at_run_time_fails_alone(llm):
    """Controls that empty a row only once something is generated (admission cannot see it):
    allowed_token_ids [40, 41], two-token bad words "40 40" and "40 41", and a bias that makes 40
    the first token. The second step's logits were all -inf: it sampled token 0 (greedy) or the
    last id, with NaN logprobs. Now that request fails with the reason; the one beside it runs on."""
    tok = llm.get_tokenizer()
    engine = llm.engine
    bad = [tok.decode([40, 40]), tok.decode([40, 41])]
    assert [tok.encode(w, add_special_tokens=False) for w in bad] == [[40, 40], [40, 41]]
    for temp in (0.0, 1.0):
        engine.add_request("dead", PROMPT, SamplingParams(temperature=temp, max_tokens=3, logprobs=1, allowed_token_ids=[40, 41],
                                                           bad_words=bad, logit_bias={40: 50.0}))
        engine.add_request("alive", PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        assert done["dead"].error is not None and "no token may be sampled" in done["dead"].error
        assert done["dead"].outputs[0].token_ids == [40]
        assert done["alive"].error is None and done["alive"].outputs[0].token_ids == _greedy(llm, 3).token_ids
        assert _idle(llm)


@pytest.mark.parametrize("kw,field", [
    (dict(ignore_eos="false"), "ignore_eos"), (dict(ignore_eos=0.0), "ignore_eos"),
    (dict(skip_special_tokens="no"), "skip_special_tokens"), (dict(include_stop_str_in_output=None), "include_stop_str_in_output"),
    (dict(stop=5), "stop"), (dict(stop={"a": 1}), "stop"), (dict(stop_token_ids=5), "stop_token_ids"),
])
def test_sampling_params_booleans_and_stop_fields_are_typed(kw, field):
    """ignore_eos="false" was truthy (EOS ignored), stop=5 a bare TypeError, a dict's keys taken
    as stop strings."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_repetition_penalty_covers_the_documents(tmp_path):
    """vLLM's repetition penalty runs over the whole prompt; a squid query's prompt is prefix +
    documents + query (what RequestOutput.prompt_token_ids reports), but the documents' tokens
    were left out. Oracle: the dense forward of the squid layout, the penalty applied by hand."""
    model = make_checkpoint(str(tmp_path), "qwen3", seed=21)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, squid_positions="concat")
    docs = [[40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [60, 61, 62, 63, 64]]
    query = [30, 31, 32]
    rp = 3.0
    out = llm.generate({"documents": docs, "prompt": query},
                       SamplingParams(temperature=0, max_tokens=1, logprobs=20, repetition_penalty=rp), use_tqdm=False)[0]
    tokens, pos, group = layout_rows([], docs, query, "concat")
    logits = dense_logits(model, tokens, pos, group)[-1].clone()
    seen = torch.tensor(sorted(set(tokens)))
    vals = logits[seen]
    logits[seen] = torch.where(vals > 0, vals / rp, vals * rp)
    ref = logits.log_softmax(-1)
    lps = out.outputs[0].logprobs[0]
    assert len(lps) >= 20
    for t, lp in lps.items():
        assert abs(lp.logprob - ref[t].item()) <= 1e-5, t


def _vllm_stop(texts: list[str], stop: str, min_tokens: int) -> int | None:
    """vLLM v1's detokenizer rule (engine/detokenizer.py update()): the text of the first
    min_tokens tokens is never searched; after that each token's new text is, from len(stop) - 1
    characters before it. texts[i] is the text after token i + 1. Returns the tokens kept."""
    offset = 0
    for n, text in enumerate(texts, start=1):
        if n <= min_tokens:
            offset = len(text)
            continue
        if text.find(stop, max(0, offset - len(stop) + 1)) != -1:
            return n
        offset = len(text)
    return None


@pytest.mark.parametrize("min_tokens", [0, 1, 2, 3])
def test_stop_strings_skip_the_text_of_the_first_min_tokens(llm, min_tokens):
    """The check used to start at output token min_tokens (>=), so a stop string in that token's
    text ended the output inside vLLM's min_tokens window."""
    base = _greedy(llm, 12)
    tok = llm.get_tokenizer()
    detok = IncrementalDetokenizer(tok, PROMPT, True)
    ids, texts, text = list(PROMPT), [], ""
    for t in base.token_ids:
        ids.append(t)
        text += detok.step(ids)
        texts.append(text)
    for stop in sorted({tok.decode([t]).strip() for t in base.token_ids[:4]}):
        want = _vllm_stop(texts, stop, min_tokens)
        got = _greedy(llm, 12, stop=[stop], min_tokens=min_tokens)
        if want is None:
            assert got.finish_reason == "length"
        else:
            assert len(got.token_ids) == want and got.finish_reason == "stop", (stop, want, got.token_ids)


def test_a_stop_tokens_text_is_left_out_unless_include_stop_str_in_output(llm):
    """vLLM v1 leaves the text of the token that stopped the output (a stop_token_ids entry, EOS)
    out of `text` unless include_stop_str_in_output; it was always kept. The id stays in token_ids."""
    base = _greedy(llm, 8, stop=["never-there"])  # text detokenized in context
    third = base.token_ids[2]
    two = _greedy(llm, 2, stop=["never-there"]).text
    for kw in ({}, {"stop": ["never-there"]}):  # text decoded at the end, or step by step
        cut = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[third], **kw), use_tqdm=False)[0].outputs[0]
        assert cut.token_ids == base.token_ids[:3] and cut.text == two
        kept = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[third], include_stop_str_in_output=True,
                                                     **kw), use_tqdm=False)[0].outputs[0]
        assert kept.token_ids == base.token_ids[:3] and kept.text == _greedy(llm, 3, stop=["never-there"]).text
        eos = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, logit_bias={2: 100.0}, skip_special_tokens=False, **kw),
                           use_tqdm=False)[0].outputs[0]
        assert eos.token_ids == [2] and eos.text == ""
        eos = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, logit_bias={2: 100.0}, skip_special_tokens=False,
                                                    include_stop_str_in_output=True, **kw), use_tqdm=False)[0].outputs[0]
        assert eos.token_ids == [2] and eos.text.strip() == llm.get_tokenizer().decode([2], skip_special_tokens=False).strip()


def test_chat_reports_the_rendered_prompt(llm):
    msgs = [{"role": "user", "content": "a b"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt == tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert out.prompt_token_ids == tok.encode(out.prompt, add_special_tokens=False)


def test_text_decoded_at_the_end_equals_the_incremental_text():
    """The two text paths (step by step for stop strings and streams, once at the end otherwise)
    must agree; with a prompt ending inside a UTF-8 character they did not (U+FFFD at the end, ''
    step by step). Every split of a text with 2- and 3-byte characters, on the embedded model's
    byte-level BPE."""
    from cuttle.engine.default_model import default_model_path
    from cuttle.engine.tokenizer import Tokenizer

    tok = Tokenizer(default_model_path())
    ids = tok.encode("x = 'é日本' # ünï", add_special_tokens=False)
    for cut in range(1, len(ids)):
        prompt, out = ids[:cut], ids[cut:]
        detok = IncrementalDetokenizer(tok, prompt, True)
        step, text = list(prompt), ""
        for t in out:
            step.append(t)
            text += detok.step(step)
        assert tok.decode_continuation(prompt, out) == text, cut
