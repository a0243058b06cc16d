"""Speculative decoding by n-gram prompt lookup (engine/spec_decode.py): the proposer, the config,
and the engine's outputs. With batch-invariant kernels every output (tokens, logprobs, top
logprobs, finish reasons) is bit-identical with and without drafts, for greedy and seeded random
sampling, penalties, min_tokens, stop strings and n > 1; drafts are kept (the counters say how
many), never preempt anyone, leave no block behind and hash only kept tokens into the prefix cache."""
from __future__ import annotations

import os
import random

import pytest

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.default_model import DEFAULT_MODEL_DIR
from cuttle.engine.sampling_params import StructuredOutputsParams
from cuttle.engine.spec_decode import NgramIndex, SpecConfig

HAVE_DEFAULT = os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, "config.json"))
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}  # drafts at every batch size
CODE = ["def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
        "class Queue:\n    def __init__(self, maxsize=0):\n        self.maxsize = maxsize\n        self.items = []\n\n",
        "for key, value in sorted(items):\n    print(key, value)\nfor key, value in sorted(items):\n"]


# ---- the proposer --------------------------------------------------------------------------

def test_proposes_what_followed_the_latest_longest_match():
    idx = NgramIndex(1, 3)
    #        0  1  2  3  4  5  6  7  8  9
    toks = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2]
    assert idx.propose(toks + [5, 6, 7], 4) == [1, 2, 5, 6]  # "5 6 7" last seen at 5: what followed it
    idx = NgramIndex(1, 3)
    assert idx.propose([1, 2, 3, 4, 2, 3, 9, 3], 2) == [9, 3]  # only "3" recurs: its latest earlier place is 5
    idx = NgramIndex(2, 3)
    assert idx.propose([1, 2, 3, 4, 5], 3) == []  # no earlier occurrence of "4 5" or "3 4 5"
    assert idx.propose([1, 2, 3, 4, 5, 1, 2], 3) == [3, 4, 5]  # grown since: updated, not rebuilt
    assert idx.propose([7], 3) == []


def test_incremental_index_equals_a_fresh_one():
    rng = random.Random(0)
    for _ in range(200):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        want = rng.randint(1, 6)  # the configured draft length: occurrences with that many followers first
        toks = [rng.randint(0, 4) for _ in range(rng.randint(1, 40))]
        grown = NgramIndex(lo, hi, want)
        for end in range(1, len(toks) + 1):
            k = rng.randint(1, want)
            got = grown.propose(toks[:end], k)
            assert got == NgramIndex(lo, hi, want).propose(toks[:end], k) == _brute(toks[:end], lo, hi, k, want)


def _brute(toks: list[int], lo: int, hi: int, k: int, want: int) -> list[int]:
    L = len(toks)
    for n in range(min(hi, L - 1), lo - 1, -1):
        starts = [j for j in range(L - n - 1, -1, -1) if toks[j:j + n] == toks[L - n:]]
        full = [j for j in starts if j + n + want <= L]
        if starts:
            j = full[0] if full else starts[0]
            return toks[j + n:j + n + k]
    return []


def test_a_short_loop_proposes_whole_drafts():
    # the latest "1 2" (at 4) is followed by one token; the one at 2 by all four
    assert NgramIndex(2, 2, 4).propose([1, 2, 1, 2, 1, 2, 1, 2], 4) == [1, 2, 1, 2]
    assert NgramIndex(2, 2, 1).propose([1, 2, 1, 2, 1, 2, 1, 2], 4) == [1, 2]


@pytest.mark.parametrize("spec, match", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in \\[1, 16\\], got 0"),
    ({"num_speculative_tokens": 17}, "in \\[1, 16\\], got 17"),
    ({"num_speculative_tokens": True}, "got True"),
    ({}, "num_speculative_tokens is required"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "draft"}, "speculative_config.model is a draft model's"),
    ({"num_speculative_tokens": 2, "draft_model": "d"}, "unsupported key\\(s\\) draft_model"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min \\(5\\) exceeds prompt_lookup_max \\(3\\)"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max must be an integer in \\[1, 32\\]"),
    ("ngram", "must be a dict"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size must be None \\(never\\) or an integer >= 1"),
])
def test_bad_configs_are_refused_naming_the_field(spec, match):
    with pytest.raises(ValueError, match=match):
        SpecConfig.parse(spec)


def test_config_defaults():
    assert SpecConfig.parse({"num_speculative_tokens": 3}) == SpecConfig("ngram", 3, 4, 2, 4)
    assert SpecConfig.parse({"num_speculative_tokens": 3, "prompt_lookup_max": 1}) == SpecConfig("ngram", 3, 1, 1, 4)
    assert SpecConfig.parse({"num_speculative_tokens": 3, "disable_by_batch_size": None}).disable_by_batch_size is None
    assert SpecConfig.parse(None) is None


# ---- the engine ----------------------------------------------------------------------------

def _outputs(llm: LLM, prompts, sp):
    out = []
    for r in llm.generate(prompts, sp, use_tqdm=False):
        for c in r.outputs:
            out.append((c.token_ids, c.text, c.finish_reason, c.cumulative_logprob,
                        None if c.logprobs is None else [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in c.logprobs]))
    return out


def _pair(dtype: str, **kw):
    common = dict(dtype=dtype, num_kv_blocks=256, batch_invariant=True, **kw)
    return LLM(DEFAULT_MODEL_DIR, **common), LLM(DEFAULT_MODEL_DIR, speculative_config=SPEC, **common)


@pytest.mark.skipif(not HAVE_DEFAULT, reason="the embedded default model has not been trained yet")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_outputs_bit_identical_with_and_without_drafts(dtype):
    base, spec = _pair(dtype)
    cases = [
        SamplingParams(temperature=0, max_tokens=48, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=48, logprobs=2, n=2),
        SamplingParams(temperature=1.0, seed=5, max_tokens=40, repetition_penalty=1.3, frequency_penalty=0.4, logprobs=0),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=12, stop=["\n\n"], logprobs=0),
        SamplingParams(temperature=0.7, seed=2, max_tokens=33, ignore_eos=True),
    ]
    for sp in cases:
        assert _outputs(spec, CODE, sp) == _outputs(base, CODE, sp), sp
    stats = spec.engine.stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_draft_tokens"] > stats["spec_accepted_tokens"]
    assert spec.engine.counters["steps"] < base.engine.counters["steps"]  # kept drafts saved steps
    assert base.engine.stats()["spec_draft_tokens"] == 0
    for llm in (base, spec):  # every block back, nothing held for a draft
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.skipif(not HAVE_DEFAULT, reason="the embedded default model has not been trained yet")
def test_kept_drafts_reach_the_prefix_cache_as_tokens():
    """Blocks hashed after a step with drafts hold only kept tokens: a later request whose prompt
    is an earlier one's prompt + output hits them and continues exactly as without drafts."""
    base, spec = _pair("float32", block_size=4)
    sp = SamplingParams(temperature=0, max_tokens=40)
    first = [spec.generate(CODE[:1], sp, use_tqdm=False)[0], base.generate(CODE[:1], sp, use_tqdm=False)[0]]
    assert first[0].outputs[0].token_ids == first[1].outputs[0].token_ids
    follow = first[0].prompt_token_ids + list(first[0].outputs[0].token_ids)
    hit = spec.generate([follow], sp, use_tqdm=False)[0]
    assert hit.num_cached_tokens >= len(follow) - 4
    assert hit.outputs[0].token_ids == base.generate([follow], sp, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.skipif(not HAVE_DEFAULT, reason="the embedded default model has not been trained yet")
def test_drafts_never_preempt_and_controls_are_not_drafted():
    """A pool too small for everyone's drafts: drafts take free blocks only, so the preemptions are
    those of decoding without them; a structured-output request beside drafted ones is sampled
    under its mask, undrafted."""
    common = dict(dtype="float32", num_kv_blocks=40, block_size=4, batch_invariant=True, max_num_seqs=6)
    base = LLM(DEFAULT_MODEL_DIR, **common)
    spec = LLM(DEFAULT_MODEL_DIR, speculative_config=SPEC, **common)
    sp = SamplingParams(temperature=0, max_tokens=24)
    prompts = CODE * 2
    assert _outputs(spec, prompts, sp) == _outputs(base, prompts, sp)
    assert spec.engine.stats()["preemptions"] <= base.engine.stats()["preemptions"]
    assert spec.engine.block_manager.num_free_blocks == spec.engine.block_manager.num_blocks
    choice = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    mixed = [(p, sp) for p in CODE] + [("Answer: ", choice)]
    got = spec.generate([m[0] for m in mixed], [m[1] for m in mixed], use_tqdm=False)
    assert got[-1].outputs[0].text in ("yes", "no")
    assert [r.outputs[0].token_ids for r in got[:-1]] == [r.outputs[0].token_ids for r in base.generate(CODE, sp, use_tqdm=False)]


@pytest.mark.skipif(not HAVE_DEFAULT, reason="the embedded default model has not been trained yet")
def test_documents_host_tier_and_session_turns_bit_identical():
    """The other paths a decode takes: squid documents (segmented steps), a host KV tier under a
    small pool, and agent session turns (a turn continues from the session's pinned KV)."""
    common = dict(dtype="bfloat16", num_kv_blocks=128, block_size=4, batch_invariant=True, num_host_kv_blocks=64)
    base, spec = LLM(DEFAULT_MODEL_DIR, **common), LLM(DEFAULT_MODEL_DIR, speculative_config=SPEC, **common)
    sp = SamplingParams(temperature=0.9, seed=3, max_tokens=40, logprobs=1)
    doc = {"prefix": "# repo\n", "documents": ["def f(x):\n    return x * 2\n", "def g(y):\n    return f(y) + 1\n"],
           "prompt": "def h(z):\n    return g("}
    for prompts in ([doc], CODE * 3):
        assert _outputs(spec, prompts, sp) == _outputs(base, prompts, sp)

    def turns(llm: LLM) -> list:
        eng, tok = llm.engine, llm.get_tokenizer()
        sid = eng.open_session(tok.encode(CODE[0]))
        got = []
        for turn in range(3):
            eng.add_session_turn(f"turn-{turn}", [sid], SamplingParams(temperature=0, max_tokens=20, logprobs=0))
            outs = []
            while eng.has_unfinished_requests():
                outs += eng.step()
            c = [o for o in outs if o.finished][-1].outputs[0]
            got.append((list(c.token_ids), [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]))
            eng.append_to_session(sid, tok.encode("\n# next\n"))
        return got

    assert turns(spec) == turns(base)
    assert spec.engine.stats()["spec_accepted_tokens"] > 0


def test_greedy_tokens_equal_without_batch_invariance(tmp_path):
    """The default kernels: a step of k + 1 rows rounds as a prefill chunk does, so logprobs may
    differ in the last bits; on a tiny fp32 model the greedy tokens are the same."""
    from helpers import make_checkpoint

    path = str(tmp_path / "m")
    make_checkpoint(path, "qwen3", seed=4)
    base = LLM(path, dtype="float32", num_kv_blocks=128, skip_tokenizer_init=True)
    spec = LLM(path, dtype="float32", num_kv_blocks=128, skip_tokenizer_init=True, speculative_config=SPEC)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9]]
    sp = SamplingParams(temperature=0, max_tokens=40, logprobs=0, ignore_eos=True)
    a, b = base.generate(prompts, sp, use_tqdm=False), spec.generate(prompts, sp, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for da, db, t in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, x.outputs[0].token_ids):
            assert abs(da[t].logprob - db[t].logprob) <= 1e-4
    assert spec.engine.stats()["spec_accepted_tokens"] > 0


def test_sparse_attention_is_refused(tmp_path):
    from helpers import make_checkpoint

    path = str(tmp_path / "m")
    make_checkpoint(path, "qwen3", seed=1)
    with pytest.raises(ValueError, match="speculative_config is not supported with sparse attention"):
        LLM(path, dtype="float32", num_kv_blocks=64, speculative_config=SPEC,
            sparse_attention="topk:budget=64,block=16,dense_layers=1")


@pytest.mark.skipif(not HAVE_DEFAULT, reason="the embedded default model has not been trained yet")
def test_served_streams_and_counts_drafts():
    """Over the server: several tokens a step stream as deltas that add up to the whole text; the
    Prometheus counters (vLLM's spec_decode_num_*_tokens) report drafts proposed and kept."""
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families
    from server_fixture import LiveServer

    with LiveServer(DEFAULT_MODEL_DIR, dtype="float32", num_kv_blocks=256, batch_invariant=True, speculative_config=SPEC) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        kw = dict(model="test-model", prompt=CODE[0], max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
        whole = client.completions.create(**kw).choices[0].text
        chunks = list(client.completions.create(stream=True, **kw))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
        totals = {s.name: s.value for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)
                  for s in f.samples if s.name.startswith("cuttle_spec_decode")}
    assert totals["cuttle_spec_decode_num_accepted_tokens_total"] > 0
    assert totals["cuttle_spec_decode_num_draft_tokens_total"] >= totals["cuttle_spec_decode_num_accepted_tokens_total"]
    base = LLM(DEFAULT_MODEL_DIR, dtype="float32", num_kv_blocks=256, batch_invariant=True)
    assert base.generate([CODE[0]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0].outputs[0].text == whole


def test_cli_takes_vllms_json():
    import argparse

    from cuttle.engine.cli import _engine_args, _json_dict

    p = argparse.ArgumentParser()
    _engine_args(p)
    args = p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    for bad in ("[1, 2]", "{nope"):
        with pytest.raises(argparse.ArgumentTypeError):
            _json_dict(bad)


def test_draft_length_follows_what_is_kept():
    from types import SimpleNamespace

    from cuttle.engine.spec_decode import Proposer

    p = Proposer(SpecConfig.parse({"num_speculative_tokens": 5}), 1000)
    seq = SimpleNamespace(draft_len=0)
    p.update(seq, 5, 2)
    assert seq.draft_len == 4  # one fewer after a step that did not keep them all
    for _ in range(10):
        p.update(seq, seq.draft_len, 0)
    assert seq.draft_len == 1  # never below one
    p.update(seq, 1, 1)
    p.update(seq, 3, 3)
    assert seq.draft_len == 5  # two more after each step that kept all, up to k


@pytest.mark.skipif(not HAVE_DEFAULT, reason="the embedded default model has not been trained yet")
def test_no_drafts_above_disable_by_batch_size():
    common = dict(dtype="float32", num_kv_blocks=256, batch_invariant=True)
    sp = SamplingParams(temperature=0, max_tokens=24)
    capped = LLM(DEFAULT_MODEL_DIR, speculative_config={**SPEC, "disable_by_batch_size": 2}, **common)
    capped.generate(CODE, sp, use_tqdm=False)  # three at once: above the cap until one finishes
    three = capped.engine.stats()["spec_draft_tokens"]
    capped.generate(CODE[:2], sp, use_tqdm=False)
    assert capped.engine.stats()["spec_draft_tokens"] > three  # two at once: drafted
    free = LLM(DEFAULT_MODEL_DIR, speculative_config=SPEC, **common)
    free.generate(CODE, sp, use_tqdm=False)
    assert free.engine.stats()["spec_draft_tokens"] > three


def _run_bounded(llm: LLM, prompt, sp, max_steps: int = 200):
    """Step a request to its end (a bound, not a hang, if it never finishes)."""
    eng = llm.engine
    eng.add_request(f"r{eng.counters['steps']}", prompt, sp)
    outs = []
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        outs += eng.step()
    assert not eng.has_unfinished_requests(), "the request never finished"
    return [(c.index, list(c.token_ids), c.finish_reason, c.cumulative_logprob) for o in outs if o.finished for c in o.outputs]


@pytest.mark.skipif(not HAVE_DEFAULT, reason="the embedded default model has not been trained yet")
def test_n_samples_fork_when_the_last_prompt_token_runs_alone():
    """An n > 1 prompt whose last token is computed alone (a one-token last chunk; a prefix copied
    in from a KV tier) is not drafted: its samples fork from that row (drafting it skipped the
    fork: wrong samples, or a request that never finished)."""
    common = dict(dtype="float32", num_kv_blocks=256, batch_invariant=True)
    tok = LLM(DEFAULT_MODEL_DIR, **common).get_tokenizer()
    for text in ["for i in range(10):\n    print(i)\n", "a = 1\nb = 2\n"]:
        ids = tok.encode(text) * 3
        for sp in (SamplingParams(temperature=1.0, seed=7, max_tokens=6, n=2, logprobs=0),
                   SamplingParams(temperature=0.05, seed=3, max_tokens=2, n=2)):
            got = [_run_bounded(LLM(DEFAULT_MODEL_DIR, speculative_config=spec, max_num_batched_tokens=len(ids) - 1, **common),
                                ids, sp) for spec in (None, SPEC)]
            assert got[0] == got[1]

    def tier_loaded(spec):
        llm = LLM(DEFAULT_MODEL_DIR, dtype="float32", num_kv_blocks=24, block_size=4, batch_invariant=True,
                  num_host_kv_blocks=64, kv_read_in_place="never", speculative_config=spec)
        base = tok.encode("def add(a, b):\n    return a + b\n")
        p = base * 3 + base[:4]
        p = p[: (len(p) - 1) // 4 * 4 + 1]  # whole blocks and one token: all but the last may hit
        llm.generate([p], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        for i in range(3):  # push p's blocks out of the device pool into the host tier
            llm.generate([tok.encode(f"filler {i} " * 12)], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        out = _run_bounded(llm, p, SamplingParams(temperature=1.0, seed=7, max_tokens=6, n=2))
        assert llm.engine.stats()["kv_copy_in_runs"] >= 1
        return out

    assert tier_loaded(SPEC) == tier_loaded(None)


def test_draft_blocks_never_evict_the_prefix_cache():
    """Reserving draft slots takes only free blocks that cache nothing, and a trimmed one goes
    back to the head of the free list: cycles of rejected drafts leave cached blocks alone."""
    from cuttle.engine.block_manager import BlockManager
    from cuttle.engine.sequence import Request

    bm = BlockManager(8, 4, True)
    a = Request("A", list(range(100, 109)), SamplingParams(max_tokens=1)).seqs[0]
    bm.allocate(a)
    a.num_computed_tokens = 9
    bm.hash_computed_blocks(a)
    bm.deallocate(a)  # two full blocks, cached, free
    b = Request("B", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=100)).seqs[0]
    bm.allocate(b)
    reserved = 0
    for _ in range(6):  # each step's drafts cross a block boundary and are all rejected
        b.num_computed_tokens = len(b.token_ids) - 1
        bm.append_slot(b)
        reserved += bm.reserve_draft_slots(b, 4)
        b.token_ids.append(0)
        b.num_computed_tokens += 1
        bm.trim(b)
    assert reserved > 0 and bm.pool.num_evictions == 0
    assert len(bm.match_prefix(Request("A2", list(range(100, 109)), SamplingParams()).seqs[0])) == 2


@pytest.mark.skipif(not HAVE_DEFAULT, reason="the embedded default model has not been trained yet")
def test_drafts_leave_every_running_sequence_its_token():
    """Under a tight token budget, drafts take what is left after one token for each sequence still
    to schedule: every decoding sequence runs every step, as without drafts."""
    llm = LLM(DEFAULT_MODEL_DIR, dtype="float32", num_kv_blocks=256, batch_invariant=True, max_num_batched_tokens=5,
              speculative_config=SPEC)
    eng = llm.engine
    schedule, steps = eng.scheduler.schedule, []

    def logged():
        out = schedule()
        steps.append({s.request.request_id for s, _ in out.scheduled})
        return out

    eng.scheduler.schedule = logged
    ids = llm.get_tokenizer().encode("x=1\n") * 6
    for r in "ABC":
        eng.add_request(r, ids, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    decoding = [s for s in steps[len(steps) // 3 : 2 * len(steps) // 3]]  # all three decoding by then
    assert all(s == {"A", "B", "C"} for s in decoding) and eng.stats()["spec_accepted_tokens"] > 0


@pytest.mark.skipif(not HAVE_DEFAULT, reason="the embedded default model has not been trained yet")
def test_kept_drafts_over_documents_host_tier_and_raw_logprobs():
    """Greedy runs that keep drafts on the paths the sampled test mostly rejects them on: squid
    documents, a small pool over a host tier, and logprobs_mode="raw"."""
    doc = {"prefix": "# repo\n", "documents": ["def f(x):\n    return x * 2\n\n\ndef f(x):\n", "def g(y):\n    return f(y) + 1\n"],
           "prompt": "def h(z):\n    return g("}
    sp = SamplingParams(temperature=0, max_tokens=40, logprobs=2)
    for kw, prompts in ((dict(num_kv_blocks=128), [doc]), (dict(num_kv_blocks=40, num_host_kv_blocks=64), CODE * 2),
                        (dict(num_kv_blocks=128, logprobs_mode="raw"), CODE)):
        common = dict(dtype="bfloat16", block_size=4, batch_invariant=True, **kw)
        base, spec = LLM(DEFAULT_MODEL_DIR, **common), LLM(DEFAULT_MODEL_DIR, speculative_config=SPEC, **common)
        assert _outputs(spec, prompts, sp) == _outputs(base, prompts, sp), kw
        assert spec.engine.stats()["spec_accepted_tokens"] > 0, kw
