"""Decode steps over segments (squid's documents, a shared prefix) replayed from kernel graphs
(engine/step_graphs.py `_stage_segments`): one virtual row per part, the parts' tables, lengths,
rotations and merge grouping written into the graph's SegmentBatch each step.

- Tokens and logprobs equal the eager engine's bit for bit: both conventions (`concat` turns the
  query for documents placed away from where they were encoded), several requests with different
  numbers of documents beside one without, a document used twice, `n` samples sharing pins,
  random sampling, bf16 and fp32, and an MLA model (its rotary dims first).
- Each staged step's inputs equal the ones `prepare` builds, step after step.
- A window that cuts a part's keys sends the step to the eager path (a windowed plan is made per
  step), and outputs still equal eager; more structures than MAX_SEGMENT_GRAPHS evict the least
  recently used.
"""
from __future__ import annotations

import pytest
import torch

from cuttle.attention import native
from cuttle.engine import LLM, SamplingParams
from cuttle.engine.step_graphs import MAX_SEGMENT_GRAPHS
from helpers import each_scheduled_step, save_checkpoint, tiny_mistral
from moe_families import randomize_

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernel library not built (no C compiler)")

DOCS = [[3 + (7 * i + 3) % 250 for i in range(29)], [3 + (11 * i + 5) % 250 for i in range(22)],
        [3 + (13 * i + 1) % 250 for i in range(37)], [3 + (17 * i + 2) % 250 for i in range(9)]]
PREFIX = [5, 6, 7]


def _requests() -> list:
    return [
        {"prefix": PREFIX, "documents": [DOCS[0], DOCS[1]], "prompt": [40, 41, 42, 43]},
        {"prefix": PREFIX, "documents": [DOCS[2], DOCS[1], DOCS[0], DOCS[1]], "prompt": [50, 51]},  # DOCS[1] twice
        [60, 61, 62, 63, 64],  # no documents, in the same steps
        {"documents": [DOCS[3]], "prompt": [70, 71, 72]},
    ]


def _params() -> list[SamplingParams]:
    # different lengths: the batch (and the structure of its parts) changes as requests end
    return [SamplingParams(temperature=0, max_tokens=34, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.9, top_p=0.9, seed=5, n=2, max_tokens=30, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0, max_tokens=44, ignore_eos=True, logprobs=2)]


def _run(path: str, dtype: str, positions: str, eager: bool, **kw):
    llm = LLM(path, dtype=dtype, block_size=4, num_kv_blocks=256, max_model_len=256, squid_positions=positions,
              enforce_eager=eager, **kw)
    outs = llm.generate(_requests(), _params(), use_tqdm=False)
    return [[(c.token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs]) for c in o.outputs]
            for o in outs], llm


def _qwen3():
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=1, bos_token_id=None)
    return randomize_(transformers.Qwen3ForCausalLM(cfg).float().eval(), 0.15, seed=3)


def _deepseek_v3():
    import transformers

    cfg = transformers.DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                                        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=1, bos_token_id=None,
                                        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                        topk_group=2, first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8,
                                        qk_nope_head_dim=16, q_lora_rank=24, v_head_dim=16)
    return randomize_(transformers.DeepseekV3ForCausalLM(cfg).float().eval(), 0.15, seed=11)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    models = {"qwen3": _qwen3, "deepseek_v3": _deepseek_v3, "mistral": lambda: tiny_mistral(48, layers=2, head_dim=16, max_positions=512)}
    return {name: save_checkpoint(str(tmp_path_factory.mktemp(name)), make())[0] for name, make in models.items()}


@pytest.mark.parametrize("positions", ["concat", "shared"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_over_documents_replays_graphs_as_eager(paths, dtype, positions):
    eager, _ = _run(paths["qwen3"], dtype, positions, True)
    graphed, llm = _run(paths["qwen3"], dtype, positions, False)
    graphs = llm.engine.runner.graphs
    held = [k for k in graphs._graphs if k[4] is not None]
    assert held and graphs.counters["graph_steps"] > 20, graphs.counters
    if positions == "concat":
        assert any(k[4][1] > 0 for k in held)  # a graph that turns the query for moved documents
    assert graphed == eager


def test_mla_decode_over_documents_replays_graphs_as_eager(paths):
    eager, _ = _run(paths["deepseek_v3"], "bfloat16", "concat", True)
    graphed, llm = _run(paths["deepseek_v3"], "bfloat16", "concat", False)
    graphs = llm.engine.runner.graphs
    assert any(k[4] is not None for k in graphs._graphs) and graphs.counters["graph_steps"] > 20, graphs.counters
    assert graphed == eager


def test_a_window_that_cuts_a_part_runs_eagerly(paths):
    """Mistral with a 48-position window: decode steps whose rows reach no part's key 48 back
    replay, later ones (the window cutting the documents) run eagerly; outputs equal eager."""
    eager, _ = _run(paths["mistral"], "float32", "concat", True)
    graphed, llm = _run(paths["mistral"], "float32", "concat", False)
    graphs = llm.engine.runner.graphs
    assert any(k[4] is not None for k in graphs._graphs), graphs.counters
    assert graphed == eager
    # step by step: a step in which the window cuts some part (a row 48 or more positions past a
    # part's first key) never replays; steps over documents it does not cut do
    engine = llm.engine
    for i, (r, p) in enumerate(zip(_requests(), _params())):
        engine.add_request(f"again{i}", r, p)
    steps, pending = [], None  # (window cuts a part, over documents, replayed)
    for sched in each_scheduled_step(engine):
        if pending is not None:  # the previous step has run
            steps.append((pending[0], pending[1], graphs.counters["graph_steps"] > pending[2]))
        segmented = [seq for seq, _ in sched.scheduled if seq.shared]
        cut = any(seq.pos_base + seq.num_computed_tokens - part.pos_base >= 48 for seq in segmented for part in seq.shared)
        pending = (cut, bool(segmented), graphs.counters["graph_steps"])
    steps.append((pending[0], pending[1], graphs.counters["graph_steps"] > pending[2]))
    assert any(cut for cut, _, _ in steps)
    assert not any(cut and replayed for cut, _, replayed in steps)
    assert any(docs and not cut and replayed for cut, docs, replayed in steps)


def test_staged_segment_inputs_equal_the_prepared_ones(paths):
    """Once a structure's graph is trusted, each decode step's parts are written straight into its
    tensors: they must be exactly what `prepare` builds (tables compared up to each part's width)."""
    llm = LLM(paths["qwen3"], dtype="float32", block_size=4, num_kv_blocks=256, max_model_len=256, squid_positions="concat")
    engine, runner = llm.engine, llm.engine.runner
    graphs = runner.graphs
    for i, (r, p) in enumerate(zip(_requests(), _params())):
        engine.add_request(f"r{i}", r, p)
    staged_steps = 0
    for sched in each_scheduled_step(engine):
        runner.graphs = None
        ref = runner.prepare(sched.scheduled)
        runner.graphs = graphs
        staged = graphs.stage(sched.scheduled, host_tier=False) if sched.scheduled else None
        if staged is not None and ref.meta.segments is not None:
            staged_steps += 1
            a, b = staged.meta.segments, ref.meta.segments
            assert staged.input_ids.tolist() == ref.input_ids.tolist()
            assert staged.positions.tolist() == ref.positions.tolist()
            assert staged.meta.seq_lens.tolist() == ref.meta.seq_lens.tolist()
            assert staged.meta.slot_mapping.tolist() == ref.meta.slot_mapping.tolist()
            for name in ("kv_lens", "causal", "row_index", "merge_ptr", "merge_idx", "rot_rows", "query_start_loc"):
                x, y = getattr(a, name), getattr(b, name)
                assert (x is None) == (y is None) and (x is None or x.tolist() == y.tolist()), name
            if b.rot_cos is not None:
                assert torch.equal(a.rot_cos, b.rot_cos) and torch.equal(a.rot_sin, b.rot_sin)
            for p, n in enumerate(b.kv_lens_cpu):
                nb = -(-n // 4)
                assert a.block_tables[p, :nb].tolist() == b.block_tables[p, :nb].tolist()
            for name in ("seq_ids_cpu", "query_lens_cpu", "kv_lens_cpu", "causal_cpu", "deltas_cpu", "key_pos_cpu",
                         "query_pos_cpu", "max_query_len", "max_kv_len"):
                assert getattr(a, name) == getattr(b, name), name
    assert staged_steps > 5 and graphs.counters["graph_steps"] >= staged_steps


def test_more_structures_than_the_bound_evict_the_least_recent(paths):
    """One request at a time over 1 .. MAX_SEGMENT_GRAPHS + 2 documents: a structure each, the
    oldest graphs dropped; every output equals eager."""
    def run(eager: bool):
        llm = LLM(paths["qwen3"], dtype="bfloat16", block_size=4, num_kv_blocks=512, max_model_len=512,
                  squid_positions="shared", enforce_eager=eager)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
        out = []
        for n in range(1, MAX_SEGMENT_GRAPHS + 3):
            docs = [[3 + (5 * i + 7 * j) % 250 for i in range(6 + j)] for j in range(n)]
            o = llm.generate([{"documents": docs, "prompt": [40, 41]}], params, use_tqdm=False)[0].outputs[0]
            out.append((o.token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.logprobs]))
        return out, llm

    eager, _ = run(True)
    graphed, llm = run(False)
    graphs = llm.engine.runner.graphs
    assert sum(1 for k in graphs._graphs if k[4] is not None) <= MAX_SEGMENT_GRAPHS
    assert graphs.counters["graph_evictions"] >= 2, graphs.counters
    assert graphed == eager


def test_one_structure_serves_other_documents(paths):
    """Requests one after another with the same structure (a prefix and two documents) but other
    documents, lengths and placements: the one graph replays them all, its parts' tables,
    lengths and query turns staged per step (a stale one would answer for the first request's)."""
    def run(eager: bool):
        llm = LLM(paths["qwen3"], dtype="float32", block_size=4, num_kv_blocks=256, max_model_len=256,
                  squid_positions="concat", enforce_eager=eager)
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
        out = []
        for docs in ([DOCS[0], DOCS[1]], [DOCS[2], DOCS[3]], [DOCS[1], DOCS[0]], [DOCS[3], DOCS[2]]):
            o = llm.generate([{"prefix": PREFIX, "documents": docs, "prompt": [40, 41]}], params, use_tqdm=False)[0].outputs[0]
            out.append((o.token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.logprobs]))
        return out, llm

    eager, _ = run(True)
    graphed, llm = run(False)
    graphs = llm.engine.runner.graphs
    assert [k[4] for k in graphs._graphs] == [(4, 1)]  # prefix, two documents (the second moved), its own and graphs.counters["graph_captures"] == 1, graphs._graphs.keys()
    assert graphs.counters["graph_steps"] >= 4 * 7, graphs.counters
    assert graphed == eager
