"""Beam search (engine/beam_search.py; vLLM's LLM.beam_search and `use_beam_search`).

Oracles: transformers' own beam search on the same checkpoint (the beams, with the end token a
token like any other), each beam's cumulative logprob against transformers scoring the whole
sequence, greedy decoding for one beam, and vLLM's rules (EOS completes a beam, the length
penalty's ranking, the prompt counted in the length) on hand-made candidates."""
from __future__ import annotations

import time

import httpx
import pytest
import torch

from cuttle.engine import LLM, BeamSearchParams, Logprob, SamplingParams
from cuttle.engine.sampling_params import RequestOutputKind
from cuttle.engine.beam_search import BeamSearch, beam_score

PROMPTS = [[5 + (i * 7) % 200 for i in range(12)], [3, 9, 27, 81, 17, 51, 153]]


@pytest.fixture(scope="module")
def llm(qwen3_path):
    return LLM(qwen3_path, dtype="float32", num_kv_blocks=256, max_num_seqs=64)


@pytest.fixture(scope="module")
def hf(qwen3_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(qwen3_path, torch_dtype=torch.float32).eval()


@pytest.mark.parametrize("width", [2, 4])
def test_beams_equal_transformers_beam_search(llm, hf, width):
    steps = 6
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                              max_new_tokens=steps, eos_token_id=None, pad_token_id=0, length_penalty=1.0,
                              early_stopping=False)
        assert [b.tokens for b in out.sequences] == ref.tolist()
        for b in out.sequences:
            assert b.finish_reason == "length" and len(b.logprobs) == steps
            with torch.no_grad():
                lp = hf(torch.tensor([b.tokens])).logits[0].float().log_softmax(-1)
            want = sum(lp[i - 1, b.tokens[i]].item() for i in range(len(prompt), len(b.tokens)))
            assert abs(b.cum_logprob - want) <= 1e-4, (b.cum_logprob, want)
        scores = [b.cum_logprob for b in out.sequences]
        assert scores == sorted(scores, reverse=True)


def test_one_beam_is_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))
    for p, g, b in zip(PROMPTS, greedy, beams):
        assert b.sequences[0].tokens == p + g.outputs[0].token_ids
        assert b.sequences[0].text == llm.get_tokenizer().decode(b.sequences[0].tokens, True)


def test_offline_search_computes_one_token_a_beam_a_step(llm):
    """Each beam is an engine session: the prompt is computed once, then one token a live beam a
    step (a kept candidate forks its parent's KV); no session is left open."""
    prompt = [7 + (i * 11) % 190 for i in range(40)]
    before = llm.engine.stats()
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))[0]
    after = llm.engine.stats()
    assert len(out.sequences) == 3 and after["steps"] - before["steps"] == 6
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] == len(prompt) + 5 * 3
    assert after["sessions_open"] == 0


def _top(pairs: dict[int, float]) -> dict[int, Logprob]:
    return {t: Logprob(lp, r + 1) for r, (t, lp) in enumerate(pairs.items())}


def test_vllm_rules_on_hand_made_candidates():
    eos = 99
    prompt = [1, 2, 3]
    s = BeamSearch(prompt, BeamSearchParams(beam_width=2, max_tokens=3), {eos})
    assert s.pending() == [prompt]
    s.advance([_top({10: -0.1, eos: -0.5, 11: -1.0, 12: -3.0})])  # EOS completes a beam: two others live
    assert [b.tokens for b in s.beams] == [prompt + [10], prompt + [11]]
    assert [(b.tokens, b.finish_reason, b.stop_reason) for b in s.completed] == [(prompt + [eos], "stop", eos)]
    s.advance([_top({20: -0.2, 21: -4.0, eos: -5.0, 22: -6.0}), _top({30: -0.1, 31: -0.2, 32: -9.0, 33: -9.5})])
    # live, by cumulative logprob: 10 20 (-0.3), 11 30 (-1.1); 11 31 (-1.2) and the rest drop
    assert [(b.tokens[3:], round(b.cum_logprob, 6)) for b in s.beams] == [([10, 20], -0.3), ([11, 30], -1.1)]
    assert len(s.completed) == 2  # 10 EOS (-5.1) joined
    s.advance([_top({40: -2.0, 41: -3.0, 42: -4.0, 43: -5.0}), _top({50: -0.1, 51: -7.0, 52: -8.0, 53: -9.0})])
    assert s.done and s.pending() == []
    best = s.result()
    # scores: cum / len ** 1.0, the prompt counted, a final EOS not: [1 2 3 EOS] -0.5 / 3 = -0.167
    # beats [1 2 3 11 30 50] -1.2 / 6 = -0.2 and [1 2 3 10 20 40] -2.3 / 6
    assert [b.tokens[3:] for b in best] == [[eos], [11, 30, 50]]
    assert [b.finish_reason for b in best] == ["stop", "length"]
    assert s.generated(best[0]) == [] and s.generated(best[1]) == [11, 30, 50]
    assert beam_score(prompt + [eos], -0.5, {eos}, 1.0) == pytest.approx(-0.5 / 3)
    # a length penalty of 0 ranks by the cumulative logprob alone
    s0 = BeamSearch(prompt, BeamSearchParams(beam_width=1, max_tokens=2, length_penalty=0.0), {eos})
    s0.advance([_top({10: -0.1, eos: -0.5})])
    s0.advance([_top({20: -0.1, 21: -0.2})])
    assert s0.result()[0].tokens == prompt + [10, 20]
    # include_stop_str_in_output keeps the EOS in the generated ids
    s1 = BeamSearch(prompt, BeamSearchParams(beam_width=1, max_tokens=1, include_stop_str_in_output=True), {eos})
    s1.advance([_top({eos: -0.1, 10: -0.2})])
    assert s1.generated(s1.result()[0]) == [eos]
    # ignore_eos: the end token is a token like any other
    s2 = BeamSearch(prompt, BeamSearchParams(beam_width=1, max_tokens=1, ignore_eos=True), {eos})
    s2.advance([_top({eos: -0.1, 10: -0.2})])
    assert not s2.completed and s2.beams[0].tokens == prompt + [eos]


@pytest.mark.parametrize("kw,field", [
    ({"beam_width": 0}, "beam_width"), ({"beam_width": 11}, "beam_width"), ({"beam_width": True}, "beam_width"),
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": 0.7}, "temperature"), ({"length_penalty": float("nan")}, "length_penalty"),
])
def test_params_are_checked(kw, field):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kw})


def test_prompt_too_long_and_documents_are_refused(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([[5] * 10], BeamSearchParams(beam_width=2, max_tokens=llm.engine.max_model_len))
    with pytest.raises(ValueError, match="documents"):
        llm.beam_search([{"documents": [[5, 6]], "prompt": [7]}], BeamSearchParams(beam_width=2, max_tokens=2))


@pytest.fixture(scope="module")
def live(qwen3_path):
    from server_fixture import LiveServer

    with LiveServer(qwen3_path, dtype="float32", num_kv_blocks=256, max_model_len=128) as srv:
        yield srv


def _post(live, body: dict) -> httpx.Response:
    return httpx.post(live.url + "/v1/completions", json={"model": "test-model", **body}, timeout=60)


def test_server_use_beam_search_equals_offline(live, llm):
    r = _post(live, {"prompt": PROMPTS, "use_beam_search": True, "n": 3, "max_tokens": 5, "ignore_eos": True,
                     "return_token_ids": True, "length_penalty": 0.5, "temperature": 0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    offline = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True, length_penalty=0.5))
    tok = llm.get_tokenizer()
    for i, (p, out) in enumerate(zip(PROMPTS, offline)):
        mine = [c for c in choices if c["index"] // 3 == i]
        assert [c["token_ids"] for c in mine] == [b.tokens[len(p):] for b in out.sequences]
        assert [c["text"] for c in mine] == [tok.decode(b.tokens[len(p):], True) for b in out.sequences]
        assert all(c["finish_reason"] == "length" and c["prompt_token_ids"] == p for c in mine)
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    assert usage["prompt_tokens"] == sum(map(len, PROMPTS))


@pytest.mark.parametrize("extra,param", [
    ({"stream": True}, "stream"), ({"logprobs": 21}, "logprobs"), ({"top_p": 0.5}, "top_p"), ({"temperature": 0.8}, "temperature"),
    ({"n": 11}, "n"), ({"stop": ["x"]}, "stop"), ({"echo": True}, "echo"), ({"documents": [[5, 6]]}, "documents"),
    ({"length_penalty": "long"}, "length_penalty"), ({"use_beam_search": "yes"}, "use_beam_search"),
])
def test_server_refuses_what_beam_search_cannot_do(live, extra, param):
    r = _post(live, {"prompt": [5, 6, 7], "use_beam_search": True, "n": 2, "max_tokens": 3, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert _post(live, {"prompt": [5, 6, 7], "max_tokens": 2}).status_code == 200


def test_length_penalty_without_beam_search_is_refused(live):
    r = _post(live, {"prompt": [5, 6, 7], "max_tokens": 2, "length_penalty": 0.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty"
    # use_beam_search false is plain sampling
    plain = _post(live, {"prompt": [5, 6, 7], "max_tokens": 2, "use_beam_search": False})
    assert plain.status_code == 200 and plain.json()["choices"]


def test_server_search_runs_in_sessions_one_token_a_beam_a_step(live):
    """As offline: the prompt computed once, then one token a live beam a step; no session left."""
    prompt = [11 + (i * 13) % 180 for i in range(40)]
    before = live.llm.engine.stats()
    r = _post(live, {"prompt": prompt, "use_beam_search": True, "n": 3, "max_tokens": 6, "ignore_eos": True})
    after = live.llm.engine.stats()
    assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] == len(prompt) + 5 * 3
    assert after["sessions_open"] == 0


def test_server_search_goes_on_without_sessions_where_their_limit_leaves_no_room(qwen3_path, llm):
    """max_sessions 2 refuses a width-3 search's forks after its first step: it goes on with
    one-token requests over each beam's stream, with the offline result, and leaves no session."""
    from server_fixture import LiveServer

    with LiveServer(qwen3_path, dtype="float32", num_kv_blocks=256, max_model_len=128, max_sessions=2) as srv:
        before = srv.llm.engine.stats()
        r = _post(srv, {"prompt": PROMPTS, "use_beam_search": True, "n": 3, "max_tokens": 5, "ignore_eos": True,
                        "return_token_ids": True})
        after = srv.llm.engine.stats()
    assert r.status_code == 200, r.text
    offline = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
    got = [c["token_ids"] for c in r.json()["choices"]]
    assert got == [b.tokens[len(p):] for p, out in zip(PROMPTS, offline) for b in out.sequences]
    assert after["sessions_open"] == 0 and after["sessions_opened"] > before["sessions_opened"]
    assert r.json()["usage"]["prompt_tokens"] == sum(map(len, PROMPTS))


def test_a_client_leaving_mid_search_closes_its_sessions(live):
    prompt = [9 + (i * 17) % 170 for i in range(6)]
    before = live.llm.engine.stats()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(live.url + "/v1/completions", json={"model": "test-model", "prompt": prompt, "use_beam_search": True,
                                                       "n": 10, "max_tokens": 120, "ignore_eos": True}, timeout=0.5)
    deadline = time.time() + 20
    while time.time() < deadline and (live.llm.engine.stats()["sessions_open"] or live.llm.engine.has_unfinished_requests()):
        time.sleep(0.05)
    after = live.llm.engine.stats()
    assert after["sessions_open"] == 0 and not live.llm.engine.has_unfinished_requests()
    assert after["steps"] - before["steps"] < 120  # it stopped when the client left, not at the end
    assert _post(live, {"prompt": prompt, "max_tokens": 2}).status_code == 200


def test_chat_use_beam_search_equals_offline_over_the_rendered_conversation(live, llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b c d"}]
    ids = httpx.post(live.url + "/tokenize", json={"model": "test-model", "messages": messages}, timeout=30).json()["tokens"]
    r = httpx.post(live.url + "/v1/chat/completions", timeout=60,
                   json={"model": "test-model", "messages": messages, "use_beam_search": True, "n": 3,
                         "max_completion_tokens": 5, "ignore_eos": True, "length_penalty": 0.5, "return_token_ids": True})
    assert r.status_code == 200, r.text
    offline = llm.beam_search([ids], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True, length_penalty=0.5))[0]
    tok = llm.get_tokenizer()
    choices = r.json()["choices"]
    assert [c["message"]["content"] for c in choices] == [tok.decode(b.tokens[len(ids):], True) for b in offline.sequences]
    assert r.json()["prompt_token_ids"] == ids and [c["token_ids"] for c in choices] == [b.tokens[len(ids):] for b in offline.sequences]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all(c["message"]["role"] == "assistant" and c["finish_reason"] == "length" for c in choices)
    assert r.json()["object"] == "chat.completion" and r.json()["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("extra,param", [
    ({"stream": True}, "stream"), ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"seed": 3}, "seed"), ({"top_logprobs": 2}, "top_logprobs"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"documents": ["x y"]}, "documents"), ({"temperature": 0.7}, "temperature"), ({"n": 11}, "n"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "name": "a.py", "text": "x y"}]}]}, "messages"),
])
def test_chat_refuses_what_beam_search_cannot_do(live, extra, param):
    body = {"model": "test-model", "messages": [{"role": "user", "content": "a"}], "use_beam_search": True, "n": 2,
            "max_tokens": 3, **extra}
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert param in r.json()["error"]["message"]


def test_a_search_cancelled_while_the_engine_forks_leaves_no_session(qwen3_path):
    """The client leaves while a step's forks run on the engine thread: the forks still happen,
    and the search's cleanup (one command queued behind them) closes them too."""
    import asyncio
    import threading

    from cuttle.engine.async_engine import AsyncEngine
    from cuttle.engine.server.beam_completions import _search_in_sessions

    engine = LLM(qwen3_path, dtype="float32", num_kv_blocks=128).engine
    entered, release = threading.Event(), threading.Event()
    real = engine.fork_beams

    def slow_fork(sids, origins):
        entered.set()
        release.wait(10)
        real(sids, origins)

    engine.fork_beams = slow_fork
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    searches = [BeamSearch(p, params, engine.eos_token_ids) for p in PROMPTS]
    step = SamplingParams(temperature=0.0, max_tokens=1, logprobs=6, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    ae = AsyncEngine(engine)
    ae.start()
    try:
        async def leave_mid_fork() -> None:
            task = asyncio.ensure_future(_search_in_sessions(ae, searches, step, "t", 0, [], []))
            await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
            task.cancel()  # the client left: the fork command has started, its await is cancelled
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(leave_mid_fork())
        assert engine.stats()["sessions_open"] == 0
    finally:
        ae.shutdown()


def test_beam_logprobs_are_the_steps_that_chose_them(live, llm):
    """`logprobs: k` (completions) and `logprobs` / `top_logprobs` (chat): each token's logprob
    under the step that chose it and that step's top k candidates, as the offline beams hold them."""
    body = {"prompt": PROMPTS[:1], "use_beam_search": True, "n": 2, "max_tokens": 4, "ignore_eos": True, "logprobs": 3}
    r = _post(live, body)
    assert r.status_code == 200, r.text
    offline = llm.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))[0]
    tok = llm.get_tokenizer()
    for c, beam in zip(r.json()["choices"], offline.sequences):
        gen = beam.tokens[len(PROMPTS[0]):]
        lp = c["logprobs"]
        assert lp["tokens"] == [tok.token_text(t) for t in gen]
        assert lp["token_logprobs"] == pytest.approx([d[t].logprob for t, d in zip(gen, beam.logprobs)], abs=1e-6)
        assert [set(top) for top in lp["top_logprobs"]] == \
            [{tok.token_text(k) for k, v in d.items() if v.rank <= 3 or k == t} for t, d in zip(gen, beam.logprobs)]
    messages = [{"role": "user", "content": "a b"}]
    ids = httpx.post(live.url + "/tokenize", json={"model": "test-model", "messages": messages}, timeout=30).json()["tokens"]
    chat = httpx.post(live.url + "/v1/chat/completions", timeout=60, json={
        "model": "test-model", "messages": messages, "use_beam_search": True, "n": 2, "max_tokens": 3, "ignore_eos": True,
        "logprobs": True, "top_logprobs": 2}).json()
    offline = llm.beam_search([ids], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))[0]
    for c, beam in zip(chat["choices"], offline.sequences):
        gen, content = beam.tokens[len(ids):], c["logprobs"]["content"]
        assert [x["token"] for x in content] == [tok.token_text(t) for t in gen]
        assert [x["logprob"] for x in content] == pytest.approx([d[t].logprob for t, d in zip(gen, beam.logprobs)], abs=1e-6)
        assert [[y["token"] for y in x["top_logprobs"]] for x in content] == \
            [[tok.token_text(t) for t, _ in sorted(d.items(), key=lambda kv: kv[1].rank)[:2]] for d in beam.logprobs]


def test_a_weight_update_during_a_search_is_a_503_and_closes_its_sessions(live):
    """A weight update (in_flight="abort") while a server beam search runs: the search ends with
    a 503 (its turn in flight was aborted, or its next step ran under the new weights: no search
    spans two versions), every session it held is closed, and the server serves the next request."""
    import threading

    from safetensors.torch import save

    prompt = [11 + (i * 13) % 170 for i in range(6)]
    got = {}

    def search() -> None:
        got["r"] = httpx.post(live.url + "/v1/completions", json={"model": "test-model", "prompt": prompt, "use_beam_search": True,
                                                                  "n": 8, "max_tokens": 100, "ignore_eos": True}, timeout=120)

    t = threading.Thread(target=search)
    t.start()
    engine = live.llm.engine
    deadline = time.time() + 30
    while time.time() < deadline and engine.stats()["sessions_open"] == 0:
        time.sleep(0.01)
    name, w = next(iter(engine.runner.model.named_parameters()))
    r = httpx.post(live.url + "/v1/rl/update_weights", params={"in_flight": "abort"}, content=save({name: w.detach().clone()}),
                   timeout=60)
    assert r.status_code == 200, r.text
    t.join(120)
    assert got["r"].status_code == 503, got["r"].text
    assert "retry" in got["r"].json()["error"]["message"]
    deadline = time.time() + 20
    while time.time() < deadline and (engine.stats()["sessions_open"] or engine.has_unfinished_requests()):
        time.sleep(0.05)
    assert engine.stats()["sessions_open"] == 0 and not engine.has_unfinished_requests()
    assert _post(live, {"prompt": prompt, "max_tokens": 2}).status_code == 200
