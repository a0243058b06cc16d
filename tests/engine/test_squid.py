"""Squid document caching through the engine: exact against the dense oracle (transformers with the
squid mask and positions), each document computed once, cache identity, no leaks, bad input."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuttle.engine import LLM, SamplingParams
from helpers import make_checkpoint
from squid_oracle import dense_greedy

NEW = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=5)


def _docs(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    out = {}
    for arch in ("qwen3", "llama", "qwen3_moe"):
        path = str(tmp_path_factory.mktemp(f"squid-{arch}"))
        out[arch] = (path, make_checkpoint(path, arch, seed=21))
    return out


def _check_against_oracle(out, model, prefix, docs, query, convention):
    ref, rows = dense_greedy(model, prefix, docs, query, convention, NEW)
    c = out.outputs[0]
    assert c.token_ids == ref
    for t, lp, row in zip(c.token_ids, c.logprobs, rows):
        assert abs(lp[t].logprob - row[t].item()) <= 1e-5
        for tok, l in lp.items():  # the top-5 too: the whole logits row, not just the argmax
            assert abs(l.logprob - row[tok].item()) <= 1e-5


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe"])
@pytest.mark.parametrize("convention", ["shared", "concat"])
def test_squid_equals_the_dense_forward_with_its_mask(models, arch, convention):
    """Documents of 16 (a whole block), 37 and 5 tokens (mid-block ends), computed as document
    jobs, then served from the cache to a second request in another order; chunked prefill
    (budget 24 tokens) splits documents and query. `concat` is exact without a prefix."""
    path, model = models[arch]
    llm = LLM(path, dtype="float32", num_kv_blocks=96, max_num_batched_tokens=24, squid_positions=convention,
              logprobs_mode="raw")
    prefix = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25] if convention == "shared" else []
    docs = _docs(1, [16, 37, 5])
    query = [30, 31, 32, 33, 34, 35]
    first = llm.generate({"prefix": prefix, "documents": docs, "prompt": query}, GREEDY, use_tqdm=False)[0]
    _check_against_oracle(first, model, prefix, docs, query, convention)
    computed = llm.stats()["document_tokens_computed"]
    assert computed == len(prefix) + sum(map(len, docs))
    order = [docs[2], docs[0], docs[1]]
    second = llm.generate({"prefix": prefix, "documents": order, "prompt": query}, GREEDY, use_tqdm=False)[0]
    _check_against_oracle(second, model, prefix, order, query, convention)
    assert llm.stats()["document_tokens_computed"] == computed  # nothing recomputed
    assert second.num_cached_tokens >= len(prefix) + sum(map(len, docs))


def test_embedded_model_is_exact_under_shared(tmp_path):
    import transformers

    from cuttle.engine.default_model import default_model_path

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", num_kv_blocks=128, squid_positions="shared", logprobs_mode="raw")
    tok = llm.get_tokenizer()
    docs = [tok.encode("def add(a, b):\n    return a + b\n"), tok.encode("import os\n\nPATH = os.getcwd()\n")]
    query = tok.encode("print(add(")
    out = llm.generate({"documents": docs, "prompt": query}, GREEDY, use_tqdm=False)[0]
    _check_against_oracle(out, model, [], docs, query, "shared")


def test_shared_is_order_invariant_bit_for_bit(models):
    path, _ = models["qwen3"]
    llm = LLM(path, dtype="float32", num_kv_blocks=128, squid_positions="shared")
    docs = _docs(2, [9, 20, 33, 4])
    query = [40, 41, 42]
    outs = []
    for perm in ([0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0]):
        o = llm.generate({"prefix": [5, 6], "documents": [docs[i] for i in perm], "prompt": query}, GREEDY, use_tqdm=False)[0]
        outs.append((o.outputs[0].token_ids, [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]))
    assert outs[0] == outs[1] == outs[2]


def test_each_document_is_computed_once_across_requests(models):
    """8 requests over random subsets and orders of 6 documents, submitted together: every
    document (and the prefix) is computed exactly once; a second use computes none of its tokens."""
    path, _ = models["qwen3"]
    llm = LLM(path, dtype="float32", num_kv_blocks=256, squid_positions="concat")
    docs = _docs(3, [12, 30, 17, 8, 25, 19])
    rng = random.Random(0)
    prompts = []
    for i in range(8):
        subset = rng.sample(range(6), rng.randrange(2, 6))
        prompts.append({"prefix": [3, 4, 5], "documents": [docs[j] for j in subset], "prompt": [50 + i, 51]})
    used = {j for p in prompts for d in p["documents"] for j in range(6) if docs[j] == d}
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    s = llm.stats()
    assert s["documents_computed"] == len(used) + 1  # + the prefix
    assert s["document_tokens_computed"] == 3 + sum(len(docs[j]) for j in used)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert llm.stats()["document_tokens_computed"] == s["document_tokens_computed"]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_weight_update_and_edits_miss_the_cache(models):
    path, model = models["qwen3"]
    llm = LLM(path, dtype="float32", num_kv_blocks=128, squid_positions="shared")
    docs = _docs(4, [21, 14])
    p = {"documents": docs, "prompt": [60, 61]}
    llm.generate(p, SamplingParams(max_tokens=2), use_tqdm=False)
    n = llm.stats()["documents_computed"]
    edited = [docs[0][:-1] + [docs[0][-1] % 200 + 1], docs[1]]
    llm.generate({"documents": edited, "prompt": [60, 61]}, SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.stats()["documents_computed"] == n + 1  # only the edited one
    llm.update_weights([(k, v.clone()) for k, v in model.state_dict().items()])
    llm.generate(p, SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.stats()["documents_computed"] == n + 3  # both again, under the new version


def test_preemption_and_small_pools_keep_squid_exact(models):
    """A pool too small for everything at once: queries and document jobs are preempted and
    recomputed, documents evicted and computed again; outputs still equal the oracle."""
    path, model = models["qwen3"]
    llm = LLM(path, dtype="float32", num_kv_blocks=14, max_num_batched_tokens=32, squid_positions="shared",
              logprobs_mode="raw")
    docs = _docs(5, [20, 18, 26])
    reqs = [{"documents": [docs[i % 3], docs[(i + 1) % 3]], "prompt": [70 + i, 71]} for i in range(4)]
    outs = llm.generate(reqs, GREEDY, use_tqdm=False)
    for r, o in zip(reqs, outs):
        _check_against_oracle(o, model, [], r["documents"], r["prompt"], "shared")
    assert llm.stats()["preemptions"] > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_document_job_whose_prefix_was_evicted_waits_for_it_to_be_computed_again(models):
    """A document job is preempted and the query's pins are given back (what a full pool does);
    the prefix then leaves the cache and its blocks are reused (here: taken, filled with junk KV,
    freed). Readmitted, the job must not attend to those blocks: it parks on a new prefix job and
    the answer equals the oracle. (It used to pin the prefix's old blocks -- another document's,
    found partly pinned by the tier fuzzing -- and cache a document computed on junk.)"""
    from cuttle.engine.scheduler import SchedulerOutput

    path, model = models["qwen3"]
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=32, max_num_batched_tokens=4, squid_positions="shared",
              logprobs_mode="raw")
    engine = llm.engine
    prefix, docs, query = [7, 8, 9, 10, 11, 12], _docs(8, [9]), [40, 41, 42]
    engine.add_request("r", {"prefix": prefix, "documents": docs, "prompt": query}, GREEDY)
    job = None
    while job is None or job.seq not in engine.scheduler.running or not job.seq.num_computed_tokens:
        engine.step()
        job = next(iter(engine.squid.jobs.values()), None)
        if job is not None and job.prefix is None:
            job = None  # the prefix's own job
    old_blocks = list(job.prefix.blocks)
    engine.scheduler.running.remove(job.seq)
    engine.scheduler._preempt(job.seq, SchedulerOutput())
    assert engine.squid.unpin_parked()
    pool = engine.block_manager.pool
    taken = [pool.take() for _ in range(pool.num_free)]  # evicts every cached block, the prefix's too
    assert set(old_blocks) <= set(taken) and not engine.block_manager.document_index.entries
    for k, v in engine.runner.kv.layers:
        k[old_blocks] = 1e3
        v[old_blocks] = -1e3
    for bid in taken:
        pool.unref(bid)
    computed = llm.stats()["document_tokens_computed"]
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    _check_against_oracle(outs["r"], model, prefix, docs, query, "shared")
    assert llm.stats()["document_tokens_computed"] == computed + len(prefix) + len(docs[0])  # the prefix again, then the document
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.squid.jobs and not engine.squid.pins


@pytest.mark.parametrize("prompt,match", [
    ({"documents": [[]], "prompt": [5]}, r"documents\[0\] is empty"),
    ({"documents": [[5, 6]], "prompt": []}, "prompt must not be empty"),
    ({"documents": [[5]] * 9, "prompt": [5]}, r"limit is 8 \(max_documents\)"),
    ({"documents": [list(range(3, 200))] * 2, "prompt": [5]}, r"prefix \+ documents \+ prompt is 395 positions.*max_model_len 256"),
    ({"documents": [[5] * 300], "prompt": [5]}, r"documents\[0\] is 300 tokens.*exceeds max_model_len \(256\)"),
    ({"documents": [[5, 6]], "prompt": [5], "suffix": [1]}, "unknown field"),
    ({"documents": "abc", "prompt": [5]}, "documents must be a list"),
    ({"documents": [[5, 999]], "prompt": [5]}, r"documents\[0\] token ids must be integers"),
    ({"documents": [[5, 6]]}, "'prompt'.*is required"),
])
def test_bad_document_input_is_refused_naming_the_field(models, prompt, match):
    path, _ = models["qwen3"]
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=256, max_documents=8)
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    ok = llm.generate({"documents": [[5, 6, 7]], "prompt": [8]}, SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 2


def test_documents_that_cannot_fit_the_pool_are_refused_and_the_queue_moves(models):
    """Each document starts blocks of its own, so documents within max_model_len can still need
    more blocks than the pool has: such a request is refused at admission, naming the blocks, the
    pool and what to change (it used to wait for blocks forever, holding up every request queued
    behind it); the default max_tokens is capped to what the pool leaves."""
    path, _ = models["qwen3"]
    # "shared": the documents share positions, so max_model_len is far from binding
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=20, max_model_len=80, squid_positions="shared")
    docs = _docs(40, [22, 22, 22])  # 31 positions with the rest, but 1 + 3 x 6 + 3 = 22 blocks
    big = {"prefix": [3, 4, 5, 6], "documents": docs, "prompt": [7, 8, 9, 10, 11]}
    with pytest.raises(ValueError, match=r"need 22 KV blocks of 4 tokens .* the pool's 20 \(num_kv_blocks\)"):
        llm.generate([[5, 6, 7], big], SamplingParams(max_tokens=4), use_tqdm=False)
    fits = {"prefix": [3, 4, 5, 6], "documents": _docs(41, [20, 20, 20]), "prompt": [7, 8, 9, 10, 11]}  # 16 blocks + own
    with pytest.raises(ValueError, match=r"need 21 KV blocks"):  # decode growth past the pool: refused too
        llm.generate(fits, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    outs = llm.generate([[5, 6, 7], fits], [SamplingParams(max_tokens=3, ignore_eos=True),
                                            SamplingParams(max_tokens=None, ignore_eos=True)], use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 3
    assert len(outs[1].outputs[0].token_ids) == 11  # max_tokens=None: 4 blocks of 4 beside the documents, less the prompt's 5
    # (max_model_len alone would have allowed 80 - 29 = 51)
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_prompt_logprobs_with_documents_is_refused(models):
    path, _ = models["qwen3"]
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="prompt_logprobs is not supported"):
        llm.generate({"documents": [[5, 6]], "prompt": [7]}, SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)


def test_documents_beside_a_backend_without_segmented_steps_are_refused(models):
    """flashinfer (GPU) does not take segmented steps: documents beside it are refused at
    admission naming why (they were admitted and failed inside the step, failing every request in
    flight), the batch is not queued, and the engine serves on. Stood in for here by the torch
    backend told it takes none (the engine reads only `takes_segments`)."""
    path, _ = models["qwen3"]
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    llm.engine.runner.backend.takes_segments = False
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with pytest.raises(ValueError, match="documents need an attention backend that takes segmented steps; the torch backend"):
        llm.generate([[5, 6, 7], {"documents": [[5, 6]], "prompt": [7]}], greedy, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids) == 2
    from cuttle.attention.flashinfer_backend import FlashInferAttentionBackend

    assert FlashInferAttentionBackend.takes_segments is False


ACTIONS = st.lists(st.tuples(st.sampled_from(["add", "add", "step", "step", "abort"]), st.integers(0, 10**6)), min_size=1, max_size=40)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(ACTIONS)
def test_no_leaks_under_interleavings(models, actions):
    """Requests sharing documents, aborted at random points (parked, running, mid-job), in a pool
    small enough to preempt and evict: every block is free at the end, no negative counts."""
    path, _ = models["qwen3"]
    llm = _leak_llm(path)
    engine = llm.engine
    docs = _docs(6, [10, 23, 7, 17])
    live: list[str] = []
    for i, (op, r) in enumerate(actions):
        if op == "add":
            rid = f"h{i}"
            pick = [docs[(r >> k) % 4] for k in range(1 + r % 3)]
            engine.add_request(rid, {"prefix": [3] * (r % 5), "documents": pick, "prompt": [90, 91 + r % 7]},
                               SamplingParams(max_tokens=1 + r % 6, n=1 + r % 2, seed=r))
            live.append(rid)
        elif op == "step":
            engine.step()
        elif op == "abort" and live:
            engine.abort_request(live.pop(r % len(live)))
        engine.block_manager.check_invariants(_live_seqs(engine), pins=engine.squid.held_pins())
    while engine.has_unfinished_requests():
        engine.step()
    bm = engine.block_manager
    bm.check_invariants([], pins=[])
    assert bm.num_free_blocks == bm.num_blocks
    assert engine.squid.jobs == {} and engine.squid.pins == {}


_LEAK_LLMS: dict[str, LLM] = {}


def _leak_llm(path: str) -> LLM:
    if path not in _LEAK_LLMS:
        _LEAK_LLMS[path] = LLM(path, dtype="float32", num_kv_blocks=12, max_num_batched_tokens=20, squid_positions="concat")
    llm = _LLM_reset(_LEAK_LLMS[path])
    return llm


def _LLM_reset(llm: LLM) -> LLM:
    for rid in list(llm.engine.requests):
        llm.engine.abort_request(rid)
    return llm


def _live_seqs(engine) -> list:
    seen, out = set(), []
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        if id(seq) not in seen:
            seen.add(id(seq))
            out.append(seq)
    for req in engine.requests.values():
        for seq in req.seqs:
            if id(seq) not in seen and not seq.is_finished:
                seen.add(id(seq))
                out.append(seq)
    return out


def test_only_the_first_piece_gets_the_tokenizers_special_tokens():
    """A BOS-adding tokenizer (Llama-3 style): the prefix text gets the BOS, documents and the
    query never do; with no prefix the BOS alone is the prefix; token ids are taken as given."""
    from cuttle.engine.squid import parse_prompt

    BOS = 1

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        return ([BOS] if add_special_tokens else []) + [ord(c) for c in text]

    def check(ids: list[int], field: str) -> None:
        pass

    layout, query, text = parse_prompt({"prefix": "s", "documents": ["ab", "c"], "prompt": "q"}, encode, check, "concat", 8)
    assert (layout.prefix, layout.documents, query, text) == ([BOS, ord("s")], [[97, 98], [99]], [ord("q")], "q")
    layout, query, _ = parse_prompt({"documents": ["ab"], "prompt": "q"}, encode, check, "shared", 8)
    assert (layout.prefix, layout.documents, query) == ([BOS], [[97, 98]], [ord("q")])
    layout, query, _ = parse_prompt({"documents": [[5, 6]], "prompt": [7]}, encode, check, "shared", 8)
    assert (layout.prefix, layout.documents, query) == ([], [[5, 6]], [7])
