"""Decode steps replayed from kernel graphs (engine/step_graphs.py) give the eager engine's tokens
and logprobs bit for bit, across batch sizes, block boundaries, architectures, MXFP8 weights and
weight updates; a graph that would be wrong is caught and that batch size stays eager."""
from __future__ import annotations

import logging

import pytest

from cuttle.attention import native
from cuttle.attention.metadata import HOST_BLOCK
from cuttle.attention.native.graph import KernelGraph
from cuttle.engine import LLM, SamplingParams
from cuttle.engine.step_graphs import DecodeGraphs
from helpers import each_scheduled_step

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernel library not built (no C compiler)")

PROMPTS = [[5 + i, 17, 33 + 3 * i, 9, 100 + i][: 2 + i % 4] * (1 + i % 3) for i in range(7)]
MAX_TOKENS = [5, 40, 13, 22, 31, 9, 27]  # requests end at different steps: the batch size moves


def _generate(path: str, eager: bool, **kw) -> tuple[list, LLM]:
    llm = LLM(path, block_size=4, max_num_seqs=3, enable_prefix_caching=False, enforce_eager=eager, **kw)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=3) for m in MAX_TOKENS]
    params[3] = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=22, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], llm


@pytest.mark.parametrize("arch, dtype, kw", [
    ("qwen3", "bfloat16", {}),
    ("qwen3", "float32", {}),
    ("llama", "bfloat16", {}),
    ("qwen3_moe", "bfloat16", {}),
    ("qwen3_moe", "float32", {}),
    ("qwen3", "bfloat16", {"quantization": "mxfp8", "quantize_lm_head": True}),
    ("qwen3_moe", "bfloat16", {"quantization": "mxfp8", "moe_quant": "mxfp8"}),
], ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()) or "plain")
def test_replayed_decode_equals_eager(checkpoints, arch: str, dtype: str, kw: dict) -> None:
    path = checkpoints[arch]["path"]
    eager, llm_e = _generate(path, True, dtype=dtype, **kw)
    graphed, llm = _generate(path, False, dtype=dtype, **kw)
    assert llm_e.engine.runner.graphs is None
    assert graphed == eager
    counters = llm.engine.stats()
    assert counters["graph_captures"] >= 3 and counters["graph_steps"] > 40, counters  # batch 3, 2 and 1 replayed
    assert llm_e.engine.stats()["graph_steps"] == 0


def test_weight_update_drops_the_graphs(checkpoints) -> None:
    path = checkpoints["qwen3"]["path"]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    runs = []
    for eager in (True, False):
        llm = LLM(path, block_size=4, max_num_seqs=3, enforce_eager=eager)
        before = llm.generate(PROMPTS, greedy, use_tqdm=False)
        graphs = llm.engine.runner.graphs
        captures = graphs.counters["graph_captures"] if graphs else 0
        w = dict(llm.engine.runner.model.named_parameters())["layers.0.attn.o_weight"]
        llm.update_weights([("layers.0.attn.o_weight", w.detach() * 1.5)])
        after = llm.generate(PROMPTS, greedy, use_tqdm=False)
        if graphs:
            assert graphs.counters["graph_captures"] > captures  # captured anew on the new weights
        runs.append([[(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out] for out in (before, after)])
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]  # the update changed the outputs


def test_a_graph_holding_a_stale_input_is_caught_and_the_size_stays_eager(checkpoints, monkeypatch, caplog) -> None:
    path = checkpoints["qwen3"]["path"]
    eager, _ = _generate(path, True)
    real_fill = DecodeGraphs._fill

    def stale_positions(self, g, inputs):  # a graph that keeps its capture step's positions
        keep = g.positions.clone()
        real_fill(self, g, inputs)
        if g.graph is not None:
            g.positions.copy_(keep)

    monkeypatch.setattr(DecodeGraphs, "_fill", stale_positions)
    with caplog.at_level(logging.WARNING, logger="cuttle.engine.step_graphs"):
        graphed, llm = _generate(path, False)
    assert graphed == eager
    assert "differs from the eager step" in caplog.text
    assert llm.engine.runner.graphs.counters["graph_steps"] == 0


def _diverge_every(monkeypatch, k: int) -> list[int]:
    """Every k-th replay "diverges" halfway (as a kernel answering differently would): it runs the
    first half of its calls and answers False. Returns the list that counts replays."""
    replays: list[int] = []
    real = KernelGraph.replay

    def diverging(self) -> bool:
        replays.append(1)
        if len(replays) % k:
            return real(self)
        calls = self._calls
        self._calls = calls[: len(calls) // 2]
        try:
            real(self)
        finally:
            self._calls = calls
        return False

    monkeypatch.setattr(KernelGraph, "replay", diverging)
    return replays


def test_a_diverging_replay_reruns_the_step_eagerly(checkpoints, monkeypatch) -> None:
    path = checkpoints["qwen3_moe"]["path"]
    eager, _ = _generate(path, True)
    replays = _diverge_every(monkeypatch, 2)
    graphed, llm = _generate(path, False)
    assert graphed == eager and len(replays) > 20


def test_switches_and_bad_values(checkpoints) -> None:
    path = checkpoints["qwen3"]["path"]
    assert LLM(path, cpu_graph_max_batch=0).engine.runner.graphs is None
    assert LLM(path, enforce_eager=True).engine.runner.graphs is None
    assert LLM(path, cpu_graph_max_batch=2).engine.runner.graphs.max_batch == 2
    assert LLM(path, cpu_graph_hot_batches=0).engine.runner.graphs.hot_batches == 0
    for bad in (-1, True, "8", 2.5):
        with pytest.raises(ValueError, match="cpu_graph_max_batch"):
            LLM(path, cpu_graph_max_batch=bad)
        with pytest.raises(ValueError, match="cpu_graph_hot_batches"):
            LLM(path, cpu_graph_hot_batches=bad)


# six requests: the decode batch is 6 for ~27 steps, 5 for 3 (fewer than HOT_STEPS below), 4 for
# ~20, 3 for ~20
HOT_TOKENS = [70, 70, 70, 50, 30, 27]


def _generate_hot(path: str, eager: bool, **kw) -> tuple[list, LLM]:
    llm = LLM(path, block_size=4, max_num_seqs=6, enable_prefix_caching=False, enforce_eager=eager,
              cpu_graph_max_batch=2, cpu_graph_hot_batches=2, **kw)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2) for m in HOT_TOKENS]
    params[1] = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=HOT_TOKENS[1], ignore_eos=True, logprobs=2)
    outs = llm.generate(PROMPTS[:6], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], llm


@pytest.mark.parametrize("arch, kw", [("qwen3", {}), ("qwen3_moe", {"quantization": "mxfp8", "moe_quant": "mxfp8"})],
                         ids=["qwen3", "qwen3_moe-mxfp8"])
def test_recurring_batch_sizes_above_the_bound_get_graphs(checkpoints, monkeypatch, arch: str, kw: dict) -> None:
    """Above cpu_graph_max_batch, a batch size is captured once it has recurred HOT_STEPS times
    (6, 4 and 3 here; 5 passes through in 3 steps and stays eager), at most cpu_graph_hot_batches
    are held (capturing 3 drops 6, the least recently replayed), and the outputs are the eager
    engine's bit for bit."""
    from cuttle.engine import step_graphs

    monkeypatch.setattr(step_graphs, "HOT_STEPS", 4)
    path = checkpoints[arch]["path"]
    eager, _ = _generate_hot(path, True, **kw)
    graphed, llm = _generate_hot(path, False, **kw)
    assert graphed == eager
    graphs = llm.engine.runner.graphs
    held = sorted(k[0] for k in graphs._graphs if k[0] > 2)
    assert held == [3, 4], held
    assert graphs.counters["graph_evictions"] == 1
    assert graphs.counters["graph_steps"] > 40, graphs.counters


def test_prompt_logprob_steps_and_shared_prefix_decodes_equal_eager(checkpoints) -> None:
    """Steps with prompt logprobs (which a graph does not take) and decode steps over a shared
    prefix (graphs of their own, test_step_graphs_segments.py) answer as the eager engine does."""
    path = checkpoints["qwen3"]["path"]
    p = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=12, ignore_eos=True, prompt_logprobs=1, logprobs=1)
    outs = []
    for eager in (True, False):
        llm = LLM(path, block_size=4, enforce_eager=eager)
        o = llm.generate([PROMPTS[2] * 3, PROMPTS[2] * 3 + [8]], p, use_tqdm=False)
        outs.append([[(c.token_ids, c.logprobs) for c in r.outputs] + [r.prompt_logprobs] for r in o])
    assert outs[0] == outs[1]


def test_staged_decode_inputs_equal_the_prepared_ones(checkpoints) -> None:
    """Once a batch size's graph is trusted, a decode step's inputs are written straight into the
    graph's tensors (`DecodeGraphs.stage`): they must be exactly what `prepare` builds, step after
    step, across block boundaries and a batch whose size changes."""
    path = checkpoints["qwen3"]["path"]
    llm = LLM(path, block_size=4, max_num_seqs=3, enable_prefix_caching=False)
    engine, runner = llm.engine, llm.engine.runner
    graphs = runner.graphs
    for i, m in enumerate(MAX_TOKENS[:3]):
        engine.add_request(f"r{i}", PROMPTS[i], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    staged_steps = 0
    for sched in each_scheduled_step(engine):
        runner.graphs = None
        ref = runner.prepare(sched.scheduled)  # the usual inputs
        runner.graphs = graphs
        staged = graphs.stage(sched.scheduled, host_tier=False)
        if staged is not None:
            staged_steps += 1
            B, width = ref.meta.num_seqs, ref.meta.block_tables.shape[1]
            assert staged.input_ids.tolist() == ref.input_ids.tolist()
            assert staged.positions.tolist() == ref.positions.tolist()
            assert staged.meta.seq_lens.tolist() == ref.meta.seq_lens.tolist()
            assert staged.meta.slot_mapping.tolist() == ref.meta.slot_mapping.tolist()
            assert staged.meta.block_tables[:, :width].tolist() == ref.meta.block_tables.tolist()
            assert staged.meta.seq_lens_cpu == ref.meta.seq_lens_cpu and staged.meta.max_seq_len == ref.meta.max_seq_len
            assert staged.logit_rows.tolist() == list(range(B)) and staged.sample_seqs == ref.sample_seqs
    assert staged_steps > 20 and graphs.counters["graph_steps"] >= staged_steps


def test_steps_a_graph_does_not_take_are_not_staged(checkpoints) -> None:
    """A prefill, a sequence with a host-tier block in its table, or a table wider than the
    graph's: `stage` declines and the step is prepared the usual way."""
    path = checkpoints["qwen3"]["path"]
    llm = LLM(path, block_size=4, max_num_seqs=1, enable_prefix_caching=False)
    engine, graphs = llm.engine, llm.engine.runner.graphs
    engine.add_request("r", PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    sched = engine.scheduler.schedule()
    assert graphs.stage(sched.scheduled, host_tier=False) is None  # the prefill
    for _ in range(4):
        engine.step()
    sched = engine.scheduler.schedule()
    assert graphs.stage(sched.scheduled, host_tier=False) is not None
    seq = sched.scheduled[0][0]
    table = list(seq.block_table)
    seq.block_table[0] = table[0] | HOST_BLOCK
    try:
        assert graphs.stage(sched.scheduled, host_tier=True) is None
    finally:
        seq.block_table[0] = table[0]
    seq.block_table.extend([table[0]] * graphs.table_width)
    try:
        assert graphs.stage(sched.scheduled, host_tier=False) is None
    finally:
        del seq.block_table[len(table):]
    assert graphs.stage(sched.scheduled, host_tier=False) is not None


def _greedy_runs(path: str, eager: bool, params: list[SamplingParams], monkeypatch=None) -> tuple[list, int]:
    """Tokens of PROMPTS under `params`, and how many sample() calls got a replay's greedy pick."""
    import cuttle.engine.llm_engine as llm_engine

    picks = []
    real = llm_engine.sample

    def counting(logits, rows, mode="processed", mask=None, greedy=None):
        picks.append(greedy is not None)
        return real(logits, rows, mode, mask, greedy)

    llm = LLM(path, block_size=4, max_num_seqs=3, enable_prefix_caching=False, enforce_eager=eager)
    if monkeypatch is not None:
        monkeypatch.setattr(llm_engine, "sample", counting)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], sum(picks)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_plain_greedy_steps_take_the_replays_pick(checkpoints, monkeypatch, arch: str) -> None:
    """Plain-greedy decode steps get their argmax from the replay (recorded after the logits,
    run when the step asks): the same tokens as the eager engine; a batch with a sampled row or
    logprobs does not ask, and its tokens are right too."""
    path = checkpoints[arch]["path"]
    plain = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    eager, _ = _greedy_runs(path, True, plain)
    graphed, picks = _greedy_runs(path, False, plain, monkeypatch)
    assert graphed == eager and picks > 20
    mixed = list(plain)
    mixed[1] = SamplingParams(temperature=0.8, seed=5, max_tokens=MAX_TOKENS[1], ignore_eos=True)
    mixed[2] = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[2], ignore_eos=True, logprobs=1)
    assert _greedy_runs(path, False, mixed)[0] == _greedy_runs(path, True, mixed)[0]


def test_a_diverging_replay_drops_its_greedy_pick(checkpoints, monkeypatch) -> None:
    """A replay that stops halfway never reaches the recorded argmax: the step reruns eagerly and
    the sampler picks from the eager logits, not from the previous step's pick."""
    path = checkpoints["qwen3"]["path"]
    plain = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    eager, _ = _greedy_runs(path, True, plain)
    replays = _diverge_every(monkeypatch, 3)
    graphed, picks = _greedy_runs(path, False, plain, monkeypatch)
    assert graphed == eager and len(replays) > 20 and picks > 10


@pytest.mark.parametrize("params, pick", [
    (SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), True),
    (SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0), False),
    (SamplingParams(temperature=0.7, seed=1, max_tokens=12, ignore_eos=True), False),
    (SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.2), False),
    (SamplingParams(temperature=0, max_tokens=12, min_tokens=10), False),  # still below min_tokens at step 4
    (SamplingParams(temperature=0, max_tokens=12, min_tokens=2), True),
    (SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, allowed_token_ids=list(range(50))), False),
])
def test_a_staged_step_asks_for_the_pick_only_when_every_row_is_plain_greedy(checkpoints, params, pick) -> None:
    path = checkpoints["qwen3"]["path"]
    llm = LLM(path, block_size=4, max_num_seqs=1, enable_prefix_caching=False)
    engine, graphs = llm.engine, llm.engine.runner.graphs
    engine.add_request("r", PROMPTS[1], params)
    for _ in range(5):
        engine.step()
    staged = graphs.stage(engine.scheduler.schedule().scheduled, host_tier=False)
    assert staged is not None
    assert (staged.greedy is not None) == pick and staged.graph.np_want[0] == int(pick)
