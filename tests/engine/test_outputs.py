"""Streamed outputs: cumulative, delta and final-only carry the same request, and deltas hand each
token and character out exactly once (a stream costs O(L), not O(L^2))."""
from __future__ import annotations

import pytest

from cuttle.engine import LLM, RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def llm(qwen3_path) -> LLM:
    return LLM(qwen3_path, dtype="float32", num_kv_blocks=128)


def _stream(llm: LLM, params: SamplingParams, prompt=(5, 9, 13, 21)) -> list:
    engine = llm.engine
    rid = f"s-{id(params)}"
    engine.add_request(rid, list(prompt), params, stream=True)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(o for o in engine.step() if o.request_id == rid)
    return outs


@pytest.mark.parametrize("n,stop", [(1, []), (3, []), (1, ["w1", "w3 w"]), (2, ["w"])])
def test_delta_outputs_concatenate_to_the_cumulative_result(llm, n, stop):
    base = dict(temperature=0.8, seed=7, max_tokens=24, n=n, stop=stop, logprobs=1)
    cum = _stream(llm, SamplingParams(**base))
    delta = _stream(llm, SamplingParams(**base, output_kind=RequestOutputKind.DELTA))
    final = cum[-1]
    assert delta[-1].finished and final.finished
    for c in final.outputs:
        parts = [o.outputs[c.index] for o in delta if c.index < len(o.outputs)]
        assert "".join(p.text for p in parts) == c.text
        assert [t for p in parts for t in p.token_ids] == c.token_ids
        assert [lp for p in parts for lp in p.logprobs] == c.logprobs
        assert parts[-1].finish_reason == c.finish_reason
        assert parts[-1].cumulative_logprob == pytest.approx(c.cumulative_logprob)
    # each token is handed out once: the deltas' total size is the output's size
    assert sum(len(o.outputs[0].token_ids) for o in delta) == len(final.outputs[0].token_ids)


def test_delta_never_sends_text_that_a_stop_string_removes(llm):
    probe = _stream(llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[-1].outputs[0].text
    assert len(probe) > 8
    stop = probe[5:9]  # a stop string that appears mid-output, spanning tokens
    outs = _stream(llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop],
                                       output_kind=RequestOutputKind.DELTA))
    text = "".join(o.outputs[0].text for o in outs)
    assert text == probe[: probe.index(stop)]
    assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].outputs[0].stop_reason == stop


def test_final_only_streams_nothing_until_the_end(llm):
    outs = _stream(llm, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs[0].token_ids) == 10


def test_output_kind_is_validated():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")
