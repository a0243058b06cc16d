"""EngineSampler: callers on several threads at once get exactly what LLM.generate gives for the
same prompts and seeds (the engine batches them together), and a weight update between steps
lets the turns in flight finish under the version they started with."""
from __future__ import annotations

import threading
import time

import pytest

from cuttle.engine import LLM, SamplingParams
from cuttle.rl.engine_sampler import EngineSampler
from cuttle.rl.rollout import generate_tokens


def test_threads_sharing_the_sampler_get_what_the_engine_gives_alone(moe_path, random_prompts):
    prompts = random_prompts(6, 17, seed=2)
    params = [SamplingParams(temperature=1.0, seed=10 + i, n=2, max_tokens=12, ignore_eos=True) for i in range(6)]
    alone = LLM(moe_path, dtype="float32", num_kv_blocks=128)
    want = [generate_tokens(alone, [p], sp)[0] for p, sp in zip(prompts, params)]
    sampler = EngineSampler(LLM(moe_path, dtype="float32", num_kv_blocks=128))
    got: dict[int, list] = {}
    try:
        def run(i: int) -> None:
            got[i] = sampler.generate_tokens([prompts[i]], params[i])[0]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i in range(6):
            assert [s.token_ids for s in got[i]] == [s.token_ids for s in want[i]]
            for a, b in zip(got[i], want[i]):
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5) and a.weight_version == 0
        stats = sampler.stats()
        # several callers' requests decoded in the same steps: fewer steps than one caller at a time
        assert stats["generated_tokens"] == 6 * 2 * 12 and stats["steps"] < 6 * 12
        assert stats["num_requests_running"] == 0

        with pytest.raises(ValueError, match="prompts"):
            sampler.generate([prompts[0]], [params[0], params[1]])
        # an update while a turn runs: the turn finishes under version 0, the next one samples with 1
        weights = [(n, p.detach().clone()) for n, p in sampler.engine.runner.model.named_parameters()]
        box: dict[str, list] = {}
        long = SamplingParams(temperature=1.0, seed=1, max_tokens=40, ignore_eos=True)
        t = threading.Thread(target=lambda: box.setdefault("s", sampler.generate_tokens([prompts[0]], long)[0]))
        t.start()
        deadline = time.monotonic() + 30
        while sampler.stats()["num_requests_running"] == 0:  # the turn is admitted and decoding
            assert time.monotonic() < deadline, "the turn never started"
            time.sleep(0.01)
        assert sampler.update_weights(weights) == 1
        t.join(60)
        [s] = box["s"]
        assert (s.weight_version, s.finish_reason, len(s.token_ids)) == (0, "length", 40)
        assert sampler.generate_tokens([prompts[1]], params[1])[0][0].weight_version == 1
    finally:
        sampler.close()


def test_a_reload_lets_the_turn_in_flight_finish_and_stream(moe_path, random_prompts):
    """reload_weights while a turn decodes: the turn is stepped to its end under version 0 and its
    caller gets it (the engine thread delivers it, as for update_weights), then the next samples
    with version 1."""
    sampler = EngineSampler(LLM(moe_path, dtype="float32", num_kv_blocks=128))
    try:
        prompt = random_prompts(1, 17, seed=3)[0]
        box: dict[str, list] = {}
        long = SamplingParams(temperature=1.0, seed=1, max_tokens=40, ignore_eos=True)
        t = threading.Thread(target=lambda: box.setdefault("s", sampler.generate_tokens([prompt], long)[0]))
        t.start()
        deadline = time.monotonic() + 30
        while sampler.stats()["num_requests_running"] == 0:
            assert time.monotonic() < deadline, "the turn never started"
            time.sleep(0.01)
        assert sampler.reload_weights() == 1
        t.join(60)
        assert not t.is_alive(), "the turn in flight was never delivered"
        [s] = box["s"]
        assert (s.weight_version, s.finish_reason, len(s.token_ids)) == (0, "length", 40)
        assert sampler.generate_tokens([prompt], long)[0][0].weight_version == 1
    finally:
        sampler.close()
