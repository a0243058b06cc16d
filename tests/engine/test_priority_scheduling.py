"""vLLM's priority scheduling (`scheduling_policy="priority"`, `--scheduling-policy priority`,
the `priority` request field): waiting requests run in (priority, arrival) order, lower values
first; preemption takes the last of that order; outputs are those of running alone; "fcfs" keeps
arrival order and refuses a priority other than 0."""
from __future__ import annotations

import httpx
import pytest

from cuttle.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def _finish_order(engine) -> list[str]:
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    return order


@pytest.mark.parametrize("policy,want", [("priority", ["c", "a", "d", "b"]), ("fcfs", ["a", "b", "c", "d"])])
def test_waiting_requests_run_in_priority_order(qwen3_path, policy, want):
    llm = LLM(qwen3_path, dtype="float32", num_kv_blocks=64, max_num_seqs=1, scheduling_policy=policy)
    prios = {"a": 0, "b": 5, "c": -1, "d": 0} if policy == "priority" else dict.fromkeys("abcd", 0)
    for rid, p in prios.items():  # all waiting before the first step; one runs at a time
        llm.engine.add_request(rid, [5, 6, 7], GREEDY, priority=p)
    assert _finish_order(llm.engine) == want


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_preemption_takes_the_last_in_priority_order(qwen3_path, policy):
    """B (priority 1) is admitted before A (priority 0); when the pool runs out, fcfs preempts
    the most recently admitted (A), priority preempts B; every output equals the one running alone."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = {"b": list(range(10, 30)), "a": list(range(40, 60))}
    alone = {rid: LLM(qwen3_path, dtype="float32", num_kv_blocks=64).generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
             for rid, p in prompts.items()}
    llm = LLM(qwen3_path, dtype="float32", num_kv_blocks=7, block_size=16, scheduling_policy=policy, enable_prefix_caching=False)
    eng = llm.engine
    prio = {"b": 1, "a": 0} if policy == "priority" else {"b": 0, "a": 0}
    eng.add_request("b", prompts["b"], params, priority=prio["b"])
    outs = {o.request_id: o for o in eng.step()}
    eng.add_request("a", prompts["a"], params, priority=prio["a"])
    finished = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
            if o.finished:
                finished.append(o.request_id)
    assert eng.stats()["preemptions"] > 0
    assert finished == (["a", "b"] if policy == "priority" else ["b", "a"])
    assert {rid: outs[rid].outputs[0].token_ids for rid in prompts} == alone


def test_priority_is_refused_where_it_cannot_be_kept(qwen3_path):
    llm = LLM(qwen3_path, dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="^priority 3 needs the priority scheduling policy"):
        llm.engine.add_request("x", [5, 6], GREEDY, priority=3)
    llm.engine.add_request("ok", [5, 6], GREEDY, priority=0)  # 0 is every request's priority under fcfs
    prio = LLM(qwen3_path, dtype="float32", num_kv_blocks=32, scheduling_policy="priority")
    for bad in (True, 1.5, "1", 2**63):
        with pytest.raises(ValueError, match="^priority must be an integer"):
            prio.engine.add_request(f"bad-{bad!r}", [5, 6], GREEDY, priority=bad)
    with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
        prio.generate([[5], [6]], GREEDY, use_tqdm=False, priority=[1])
    outs = prio.generate([[5, 6], [7, 8]], GREEDY, use_tqdm=False, priority=[3, -2])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        LLM(qwen3_path, dtype="float32", num_kv_blocks=32, scheduling_policy="lifo")


def test_server_priority_field(qwen3_path):
    from server_fixture import LiveServer

    with LiveServer(qwen3_path, dtype="float32", num_kv_blocks=32, max_model_len=64, scheduling_policy="priority") as srv:
        for path, body in [("/v1/completions", {"prompt": [5, 6]}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})]:
            r = httpx.post(srv.url + path, json={"model": "test-model", **body, "max_tokens": 2, "priority": -7}, timeout=60)
            assert r.status_code == 200, r.text
            bad = httpx.post(srv.url + path, json={"model": "test-model", **body, "max_tokens": 2, "priority": "high"}, timeout=60)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
    with LiveServer(qwen3_path, dtype="float32", num_kv_blocks=32, max_model_len=64) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "test-model", "prompt": [5], "max_tokens": 1, "priority": 2}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority" and "--scheduling-policy priority" in r.json()["error"]["message"]
