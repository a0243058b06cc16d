"""Agent sessions (engine/session.py): a multi-turn session's sampled logprobs equal one full
transformers forward over the concatenated ids (fp32 <= 1e-5); each later turn computes only what
is not in its pinned KV (the appended ids + the previous turn's last sampled token); pins survive
pool pressure that evicts other cache; weight updates drop the pins (recomputed, never reused);
nothing leaks after finish, abort or close; limits are refused by name and the engine serves on."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from helpers import make_checkpoint

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.async_engine import AsyncEngine
from cuttle.engine.sampling_params import RequestOutputKind
from cuttle.engine.scheduler import SchedulerOutput

BS = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("session-qwen3"))
    model = make_checkpoint(path, "qwen3")
    return path, model


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


def turn_params(seed: int, max_tokens: int) -> SamplingParams:
    # temperature 1, no truncation: the processed logprob is the model's log-softmax
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


def prefilled(llm: LLM) -> int:
    return llm.stats()["prefill_tokens_computed"]


def assert_matches_full_forward(model, stream: list[int], turns: list[tuple[int, list[int], list[float]]]) -> None:
    """Each turn (start index in `stream`, its sampled ids, the engine's logprobs) against one
    transformers forward over the whole stream."""
    with torch.no_grad():
        lp = model(torch.tensor([stream])).logits[0].float().log_softmax(-1)
    worst = 0.0
    for start, toks, lps in turns:
        assert stream[start:start + len(toks)] == toks
        ref = [lp[start + i - 1, t].item() for i, t in enumerate(toks)]
        worst = max(worst, max(abs(a - b) for a, b in zip(lps, ref)))
    assert worst <= 1e-5, worst


def sampled(out) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return list(c.token_ids), [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]


def assert_all_free(llm: LLM) -> None:
    eng = llm.engine
    assert eng.sessions.stats()["sessions_open"] == 0 and not eng.sessions.turns
    eng.block_manager.check_invariants([])
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_multi_turn_session_equals_full_forward_and_prefills_only_appended(ckpt):
    path, model = ckpt
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=BS)
    prompt = ids(21, 1)
    sid = llm.open_session(prompt)
    turns = []
    stream = list(prompt)
    # lengths chosen so pins end mid-block, on a block boundary, and across several blocks
    appends = [ids(7, 2), ids(13, 3), ids(5, 4)]
    max_tokens = [10, 12, 9, 6]
    for k, m in enumerate(max_tokens):
        before = prefilled(llm)
        out = llm.generate_session(sid, turn_params(100 + k, m))[0]
        grew = prefilled(llm) - before
        if k == 0:
            assert grew == len(prompt)
        else:
            assert grew == len(appends[k - 1]) + 1, (k, grew)  # appended ids + the last sampled token
            assert out.num_cached_tokens == len(stream) - len(appends[k - 1]) - 1
        toks, lps = sampled(out)
        assert len(toks) == m
        turns.append((len(stream), toks, lps))
        stream += toks
        assert llm.session_token_ids(sid) == stream
        eng = llm.engine
        eng.block_manager.check_invariants([], eng.sessions.pins())
        if k < len(appends):
            llm.append_to_session(sid, appends[k])
            stream += appends[k]
    assert_matches_full_forward(model, stream, turns)
    assert llm.stats()["session_pinned_blocks"] == (len(stream) - 1 + BS - 1) // BS
    llm.close_session(sid)
    assert_all_free(llm)


def test_group_forks_share_one_prompt_prefill(ckpt):
    path, model = ckpt
    llm = LLM(path, dtype="float32", num_kv_blocks=96, block_size=BS)
    prompt = ids(40, 5)
    root = llm.open_session(prompt)
    group = [root, *llm.fork_session(root, 3)]
    before = prefilled(llm)
    outs = llm.generate_session(group, turn_params(7, 8))
    assert prefilled(llm) - before == len(prompt)  # one request, n = 4: the prompt computed once
    firsts = [sampled(o) for o in outs]
    assert len({tuple(t) for t, _ in firsts}) == 4, "members must sample independently"
    tails = [ids(3 + i, 10 + i) for i in range(4)]
    for sid, tail in zip(group, tails):
        llm.append_to_session(sid, tail)
    before = prefilled(llm)
    seconds = llm.generate_session(group, turn_params(8, 6))
    assert prefilled(llm) - before == sum(len(t) + 1 for t in tails)
    for i, (sid, out) in enumerate(zip(group, seconds)):
        t1, l1 = firsts[i]
        t2, l2 = sampled(out)
        stream = prompt + t1 + tails[i] + t2
        assert llm.session_token_ids(sid) == stream
        assert_matches_full_forward(model, stream, [(len(prompt), t1, l1), (len(prompt) + len(t1) + len(tails[i]), t2, l2)])
    with pytest.raises(ValueError, match="diverged"):
        llm.engine.add_session_turn("x", group[:2], turn_params(1, 2))
    for sid in group:
        llm.close_session(sid)
    assert_all_free(llm)


@pytest.mark.parametrize("host_blocks", [None, 64])
def test_pins_survive_pool_pressure_that_evicts_other_cache(ckpt, host_blocks):
    """Also with the KV tiers on: evicted cache goes down to the host tier, pinned blocks never do."""
    path, model = ckpt
    llm = LLM(path, dtype="float32", num_kv_blocks=20, block_size=BS, max_session_kv_blocks=8, num_host_kv_blocks=host_blocks)
    prompt = ids(50, 20)
    sid = llm.open_session(prompt)
    t1, l1 = sampled(llm.generate_session(sid, turn_params(1, 8))[0])
    pinned = list(llm.engine.sessions.get(sid).pinned_blocks)
    evictions = llm.engine.block_manager.pool.num_evictions
    # other traffic through the 16 unpinned blocks: their cached blocks are evicted again and again
    for k in range(4):
        llm.generate([ids(120, 30 + k)], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert llm.engine.block_manager.pool.num_evictions > evictions + 8
    assert llm.engine.sessions.get(sid).pinned_blocks == pinned
    if host_blocks:
        assert llm.stats()["kv_offloaded_blocks"] > 0
    tail = ids(6, 40)
    llm.append_to_session(sid, tail)
    before = prefilled(llm)
    t2, l2 = sampled(llm.generate_session(sid, turn_params(2, 5))[0])
    assert prefilled(llm) - before == len(tail) + 1
    stream = prompt + t1 + tail + t2
    assert_matches_full_forward(model, stream, [(len(prompt), t1, l1), (len(prompt) + len(t1) + len(tail), t2, l2)])
    llm.close_session(sid)
    assert_all_free(llm)


def test_weight_update_drops_pins_and_recomputes(ckpt):
    path, model = ckpt
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=BS)
    prompt = ids(30, 50)
    sid = llm.open_session(prompt)
    t1, l1 = sampled(llm.generate_session(sid, turn_params(3, 6))[0])
    assert llm.stats()["session_pinned_blocks"] > 0
    # the same weights under a new version: a reuse of the old KV would be invisible in the numbers,
    # so the counter is what shows the history is computed again
    same = [(n, p.detach().clone()) for n, p in llm.engine.runner.model.named_parameters()]
    assert llm.update_weights(same) == 1
    assert llm.stats()["session_pinned_blocks"] == 0
    tail = ids(4, 51)
    llm.append_to_session(sid, tail)
    before = prefilled(llm)
    out = llm.generate_session(sid, turn_params(4, 5))[0]
    stream = prompt + t1 + tail
    assert prefilled(llm) - before == len(stream)  # the whole stream, none of it reused
    assert out.num_cached_tokens == 0 and out.metrics["weight_version"] == 1
    t2, l2 = sampled(out)
    assert_matches_full_forward(model, stream + t2, [(len(prompt), t1, l1), (len(stream), t2, l2)])
    llm.close_session(sid)
    assert_all_free(llm)


def test_abort_keeps_session_and_close_releases_everything(ckpt):
    path, _ = ckpt
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=BS)
    eng = llm.engine
    sid = llm.open_session(ids(20, 60))
    llm.generate_session(sid, turn_params(5, 4))
    before = llm.session_token_ids(sid)
    pins = list(eng.sessions.get(sid).pinned_blocks)
    llm.append_to_session(sid, [7, 8, 9])
    eng.add_session_turn("t-abort", [sid], turn_params(6, 50))
    for _ in range(3):
        eng.step()
    out = eng.abort_request("t-abort")
    assert out.outputs[0].finish_reason == "abort"
    assert llm.session_token_ids(sid) == before + [7, 8, 9]  # the aborted turn's tokens are not kept
    assert eng.sessions.get(sid).pinned_blocks == pins
    eng.block_manager.check_invariants([], eng.sessions.pins())
    eng.add_session_turn("t-2", [sid], turn_params(6, 50))
    with pytest.raises(ValueError, match="turn in flight"):
        eng.append_to_session(sid, [1])
    with pytest.raises(ValueError, match="already has a turn in flight"):
        eng.add_session_turn("t-3", [sid], turn_params(6, 50))
    eng.step()
    closed = eng.close_session(sid)  # closing mid-turn aborts the turn
    assert closed is not None and closed.outputs[0].finish_reason == "abort"
    assert not eng.has_unfinished_requests()
    assert_all_free(llm)
    # a finished turn of a closed session leaves nothing either
    sid = llm.open_session(ids(9, 61))
    llm.generate_session(sid, turn_params(1, 3))
    llm.close_session(sid)
    assert_all_free(llm)


def test_limits_are_refused_by_name_and_the_engine_serves_on(ckpt):
    path, _ = ckpt
    llm = LLM(path, dtype="float32", num_kv_blocks=32, block_size=BS, max_sessions=2, max_session_kv_blocks=6)
    a = llm.open_session(ids(20, 70))
    b = llm.open_session(ids(20, 71))
    with pytest.raises(ValueError, match=r"max_sessions \(2\)"):
        llm.open_session(ids(5, 72))
    with pytest.raises(ValueError, match=r"max_sessions \(2\)"):
        llm.fork_session(a, 1)
    llm.generate_session(a, turn_params(1, 4))  # 2 blocks pinned
    with pytest.raises(ValueError, match=r"max_session_kv_blocks is 6"):
        llm.generate_session(b, turn_params(2, 100))  # could pin 8 more
    assert not llm.engine.has_unfinished_requests() and llm.engine.sessions.get(b).request is None
    with pytest.raises(ValueError, match="is not open"):
        llm.generate_session("session-nope", turn_params(1, 2))
    with pytest.raises(ValueError, match=r"n \(3\) must be 1 or the number of sessions"):
        llm.engine.add_session_turn("r", [a], SamplingParams(n=3, max_tokens=2))
    small = LLM(path, dtype="float32", num_kv_blocks=32, block_size=BS, max_num_seqs=2)
    group = [small.open_session(ids(8, 75))]
    group += small.fork_session(group[0], 2)
    with pytest.raises(ValueError, match=r"a turn of 3 sessions \(forked siblings run together\) exceeds max_num_seqs \(2\)"):
        small.generate_session(group, turn_params(1, 2))
    # a truncated prompt would drop the history the session keeps (and disagree with its pins)
    with pytest.raises(ValueError, match="truncate_prompt_tokens is not supported for session turns"):
        llm.generate_session(a, SamplingParams(max_tokens=2, truncate_prompt_tokens=5))
    assert len(llm.session_token_ids(a)) == 20 + 4 and not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="token ids must be integers"):
        llm.append_to_session(a, [10**9])
    with pytest.raises(ValueError, match="max_session_kv_blocks"):
        LLM(path, dtype="float32", num_kv_blocks=8, max_session_kv_blocks=8)
    # the engine keeps serving plain requests and the open sessions
    out = llm.generate([ids(30, 73)], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    llm.generate_session(b, turn_params(2, 4))
    # a request that cannot fit beside the pins is stopped with an error naming them, not waited on forever
    with pytest.raises(RuntimeError, match=r"sessions pin 4 of 32 \(max_session_kv_blocks 6\)"):
        llm.generate([ids(480, 74)], SamplingParams(max_tokens=20), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.close_session(a)
    llm.close_session(b)
    assert_all_free(llm)
    assert len(llm.generate([ids(480, 74)], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids) == 20


def test_async_engine_streams_session_turns(ckpt):
    path, model = ckpt
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=BS)
    aeng = AsyncEngine(llm.engine)
    aeng.start()
    prompt, tail = ids(25, 80), ids(6, 81)

    async def main():
        sid = await aeng.open_session(prompt)
        p = SamplingParams(temperature=1.0, seed=9, max_tokens=7, ignore_eos=True, logprobs=0, output_kind=RequestOutputKind.DELTA)
        got = []
        async for out in await aeng.session_turn("a1", sid, p):
            got += [(t, d[t].logprob) for d, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
        await aeng.append_to_session(sid, tail)
        before = aeng.engine.stats()["prefill_tokens_computed"]
        second = []
        async for out in await aeng.session_turn("a2", sid, p):
            second += [(t, d[t].logprob) for d, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
        grew = aeng.engine.stats()["prefill_tokens_computed"] - before
        stream = await aeng.session_token_ids(sid)
        await aeng.close_session(sid)
        return got, second, grew, stream

    try:
        got, second, grew, stream = asyncio.run(main())
    finally:
        aeng.shutdown()
    assert grew == len(tail) + 1
    t1, t2 = [t for t, _ in got], [t for t, _ in second]
    assert stream == prompt + t1 + tail + t2
    assert_matches_full_forward(model, stream, [(len(prompt), t1, [l for _, l in got]),
                                                (len(prompt) + len(t1) + len(tail), t2, [l for _, l in second])])
    assert_all_free(llm)


def test_a_preempted_turn_comes_back_from_its_pins(ckpt):
    path, model = ckpt
    llm = LLM(path, dtype="float32", num_kv_blocks=12, block_size=BS, max_session_kv_blocks=6)
    eng = llm.engine
    prompt = ids(20, 90)
    sid = llm.open_session(prompt)
    t1, l1 = sampled(llm.generate_session(sid, turn_params(1, 6))[0])
    pinned = list(eng.sessions.get(sid).pinned_blocks)
    tail = ids(5, 91)
    llm.append_to_session(sid, tail)
    # a plain request admitted first grows to 10 blocks beside the pins and the turn: the turn,
    # admitted last, is preempted (its blocks freed, its pins kept) and admitted again later
    eng.add_request("plain", ids(100, 92), SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    eng.add_session_turn("turn", [sid], turn_params(2, 40))
    outs = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = out
        assert eng.sessions.get(sid).pinned_blocks == pinned or "turn" in outs
    assert eng.scheduler.num_preemptions > 0
    t2, l2 = sampled(outs["turn"])
    stream = prompt + t1 + tail + t2
    assert llm.session_token_ids(sid) == stream
    assert_matches_full_forward(model, stream, [(len(prompt), t1, l1), (len(prompt) + len(t1) + len(tail), t2, l2)])
    llm.close_session(sid)
    assert_all_free(llm)


def test_forked_siblings_preempted_after_sibling_0_ended_come_back_from_their_own_pins(ckpt):
    """A group turn (forked siblings, one request with n = 3) whose siblings 1 and 2 are preempted
    and come back only after sibling 0 has finished, i.e. after session 0 pinned sibling 0's own
    stream: each comes back from its own session's pins (the pre-turn stream), not session 0's.
    (They took session 0's: sibling 0's sampled KV under their tokens, or a step of 0 tokens.)
    Every sibling's logprobs equal a full forward over its stream, and its tokens those of the
    same turn run without preemption."""
    path, model = ckpt

    def group_turn(preempt: bool) -> tuple[list, list[list[int]], LLM]:
        llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
        eng = llm.engine
        root = llm.open_session(ids(10, 40))
        llm.generate_session(root, turn_params(41, 3))
        group = llm.fork_session(root, 3)
        llm.close_session(root)
        streams = [llm.session_token_ids(sid) for sid in group]
        eng.add_session_turn("turn", group, turn_params(42, 12))
        outs = []
        while not outs:
            outs = [o for o in eng.step() if o.finished]
            seqs = eng.requests["turn"].seqs if "turn" in eng.requests else []
            if preempt and len(seqs) == 3 and all(s.num_output_tokens == 4 for s in seqs):
                sched = eng.scheduler
                for s in seqs[1:]:
                    sched.running.remove(s)
                    sched._preempt(s, SchedulerOutput())
                assert [s.status.value for s in seqs[1:]] == ["waiting", "waiting"]
                seats, sched.max_num_seqs = sched.max_num_seqs, 1  # sibling 0 alone, to its end
                while seqs[0].num_output_tokens < 12:
                    eng.step()
                assert eng.sessions.get(group[0]).request is None  # session 0 now pins sibling 0's stream
                sched.max_num_seqs = seats
                preempt = False
        assert "turn" not in eng.requests or not eng.has_unfinished_requests()
        return outs[0].outputs, streams, llm

    plain, streams, _ = group_turn(False)
    outs, streams2, llm = group_turn(True)
    assert streams == streams2 and llm.engine.scheduler.num_preemptions == 2
    for c_plain, c, stream in zip(plain, outs, streams):
        toks, lps = list(c.token_ids), [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
        assert toks == list(c_plain.token_ids)
        assert_matches_full_forward(model, stream + toks, [(len(stream), toks, lps)])
    for sid in llm.engine.sessions.table.copy():
        llm.close_session(sid)
    assert_all_free(llm)


def test_a_request_that_cannot_fit_beside_the_pins_raises_instead_of_spinning(ckpt):
    """A request accepted by add_request (it fits max_model_len) can need more blocks than the
    pool less the blocks sessions pin: stepping can never free them. `generate` and
    `update_weights(in_flight="finish")` say so, naming the pins, instead of stepping forever;
    the failed update leaves the weights as they were, and closing the session lets it finish."""
    path, _ = ckpt
    llm = LLM(path, dtype="float32", num_kv_blocks=32, block_size=4)
    eng = llm.engine
    sid = llm.open_session(ids(26, 60))
    llm.generate_session(sid, turn_params(61, 1))
    assert eng.sessions.pinned_block_count() == 7
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    with pytest.raises(RuntimeError, match=r"cannot get KV blocks: sessions pin 7 of 32"):
        llm.generate([ids(10, 62)], long)
    assert not eng.has_unfinished_requests()
    eng.add_request("long", ids(10, 62), long)
    name, w = next(iter(eng.runner.model.named_parameters()))
    before = w.detach().clone()
    with pytest.raises(RuntimeError, match=r"sessions pin 7 of 32.*weights were not updated"):
        llm.update_weights([(name, before + 1.0)], in_flight="finish")
    assert torch.equal(w.detach(), before) and eng.weight_version == 0
    llm.close_session(sid)
    outs = llm.engine.update_weights([(name, before + 1.0)], in_flight="finish")
    assert [o.request_id for o in outs] == ["long"] and len(outs[0].outputs[0].token_ids) == 100
    assert eng.weight_version == 1
    assert_all_free(llm)


def test_async_engine_waits_instead_of_spinning_on_pins_and_refuses_a_finish_update(ckpt):
    """Behind the server: a request that cannot fit beside the session pins waits without the
    engine thread stepping flat out (it used to keep a core busy for nothing, beside the agents'
    tools), a finish-mode weight update raises naming the pins instead of draining forever (its
    drain used to block the thread, and with it the close_session that would have freed the
    blocks), and closing the session lets the request finish."""
    import time

    path, _ = ckpt
    llm = LLM(path, dtype="float32", num_kv_blocks=32, block_size=4)
    aeng = AsyncEngine(llm.engine)
    aeng.start()

    async def main():
        sid = await aeng.open_session(ids(26, 60))
        async for _ in await aeng.session_turn("t", sid, turn_params(61, 1)):
            pass
        assert aeng.engine.sessions.pinned_block_count() == 7
        stream = await aeng.add("long", ids(10, 62), SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
        await asyncio.sleep(0.3)  # the loop finds the request stalled
        cpu = time.process_time()
        await asyncio.sleep(1.0)
        busy = time.process_time() - cpu  # measured: 1.01 CPU s stepping flat out, 0.005 now
        name, w = next(iter(aeng.engine.runner.model.named_parameters()))
        with pytest.raises(RuntimeError, match=r"sessions pin 7 of 32.*weights were not updated"):
            await asyncio.wait_for(aeng.update_weights([(name, w.detach() + 1.0)], in_flight="finish"), 30)
        await asyncio.wait_for(aeng.close_session(sid), 10)
        outs = [o async for o in stream]
        return busy, outs[-1]

    try:
        busy, last = asyncio.run(main())
    finally:
        aeng.shutdown()
    assert busy < 0.5, busy  # CPU seconds of the whole process over that second
    assert last.finished and len(last.outputs[0].token_ids) == 100
    assert llm.engine.weight_version == 0
    assert_all_free(llm)
