"""Engine-side reliability (issue 12): unsupported checkpoints are refused at load, `n` samples
count against `max_num_seqs`, and a fault in one request's processing ends that request alone."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from cuttle.engine import LLM, SamplingParams
from helpers import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("reliability"))
    make_checkpoint(path, "qwen3", seed=11)
    return path


def _copy_checkpoint(src: str, dst: str) -> str:
    os.makedirs(dst)
    for f in os.listdir(src):
        with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
            b.write(a.read())
    return dst


# ---- finding 3: quantized / foreign checkpoints -------------------------------------------------
def test_fp8_config_over_unquantized_weights_is_refused_naming_the_tensor(ckpt, tmp_path):
    """An FP8 block-scaled config whose weight is not FP8 beside its `weight_scale_inv` used to load
    with the scale dropped as unused; it must be refused, naming the scale (FP8 checkpoints
    themselves load: tests/engine/test_fp8_checkpoint.py)."""
    path = _copy_checkpoint(ckpt, str(tmp_path / "fp8"))
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name.replace("weight", "weight_scale_inv")] = torch.ones(1, 1)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"have no FP8 weight beside them: \['model.layers.0.self_attn.q_proj.weight_scale_inv'\]"):
        LLM(path, dtype="float32", num_kv_blocks=16)


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes", "compressed-tensors"])
def test_any_quantization_config_is_refused(ckpt, tmp_path, method):
    path = _copy_checkpoint(ckpt, str(tmp_path / method))
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["quantization_config"] = {"quant_method": method, "bits": 4}
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match=f"quantization_config.quant_method '{method}'"):
        LLM(path, dtype="float32", num_kv_blocks=16)


def test_unused_checkpoint_tensor_is_an_error(ckpt, tmp_path):
    """A scale tensor without a quantization_config (or an adapter's weights) is not dropped."""
    path = _copy_checkpoint(ckpt, str(tmp_path / "foreign"))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"no place for.*down_proj\.weight_scale_inv"):
        LLM(path, dtype="float32", num_kv_blocks=16)


def test_documented_ignorable_tensor_still_loads(ckpt, tmp_path):
    """`rotary_emb.inv_freq` (saved by older checkpoints) is on the documented ignore list."""
    path = _copy_checkpoint(ckpt, str(tmp_path / "invfreq"))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    ref = LLM(ckpt, dtype="float32", num_kv_blocks=16).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    got = LLM(path, dtype="float32", num_kv_blocks=16).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids


# ---- finding 4: n samples and max_num_seqs ------------------------------------------------------
def test_n_samples_count_against_max_num_seqs(ckpt):
    llm = LLM(ckpt, dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    engine = llm.engine
    params = SamplingParams(temperature=1.0, max_tokens=6, n=4, seed=1, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8], params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
        assert len(engine.scheduler.running) <= 4
    assert peak == 4  # the limit is reached, never exceeded
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_n_above_max_num_seqs_is_refused(ckpt):
    llm = LLM(ckpt, dtype="float32", num_kv_blocks=64, max_num_seqs=2)
    with pytest.raises(ValueError, match=r"n \(8\) exceeds max_num_seqs \(2\)"):
        llm.generate([[5, 6, 7]], SamplingParams(n=8, max_tokens=4), use_tqdm=False)
    # the engine is untouched and keeps serving
    out = llm.generate([[5, 6, 7]], SamplingParams(n=2, max_tokens=4, seed=0), use_tqdm=False)
    assert len(out[0].outputs) == 2


# ---- engine faults: one request's exception ends that request only ------------------------------
class _ExplodingDetok:
    def step(self, token_ids):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected fault")


def test_fault_in_one_requests_processing_fails_only_that_request(ckpt):
    llm = LLM(ckpt, dtype="float32", num_kv_blocks=64)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", [5 + i, 9, 13], params, stream=True)
    engine.requests["r2"].seqs[0].detok = _ExplodingDetok()
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert set(finals) == {"r0", "r1", "r2", "r3"}
    bad = finals["r2"]
    assert bad.error is not None and "injected fault" in bad.error
    assert bad.outputs[0].finish_reason == "abort"
    for rid in ("r0", "r1", "r3"):
        assert finals[rid].error is None
        assert finals[rid].outputs[0].finish_reason == "length"
        assert len(finals[rid].outputs[0].token_ids) == 8
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants([])
    # and the engine keeps serving
    again = llm.generate([[5, 9, 13]], params, use_tqdm=False)
    assert again[0].outputs[0].token_ids == finals["r0"].outputs[0].token_ids


def test_offline_generate_raises_when_a_request_failed(ckpt):
    llm = LLM(ckpt, dtype="float32", num_kv_blocks=64)
    post = llm.engine.post
    real_attach = post.attach_detokenizer

    def attach(seq):
        real_attach(seq)
        seq.detok = _ExplodingDetok()

    post.attach_detokenizer = attach
    with pytest.raises(RuntimeError, match="1 of 1 requests failed.*injected fault"):
        llm.generate([[5, 9, 13]], SamplingParams(max_tokens=4, stop=["x"]), use_tqdm=False)
    post.attach_detokenizer = real_attach
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("fault", [RuntimeError("injected step fault"), KeyboardInterrupt()])
def test_failed_or_interrupted_generate_leaves_nothing_queued(ckpt, fault):
    """A step that raises (or Ctrl-C) inside `LLM.generate`: the call raises, and none of its
    requests stays behind to run (or fail again) in the next call; every block is free and the next
    call generates what a fresh engine does."""
    llm = LLM(ckpt, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate([[5, 9, 13]], params, use_tqdm=False)[0].outputs[0].token_ids
    runner = llm.engine.runner
    real_run, calls = runner.run, []

    def run(inputs):
        calls.append(1)
        if len(calls) == 3:  # mid-decode
            raise fault
        return real_run(inputs)

    runner.run = run
    with pytest.raises(type(fault)):
        llm.generate([[5, 9, 13], [7, 8, 9, 10]], params, use_tqdm=False)
    runner.run = real_run
    assert not llm.engine.has_unfinished_requests()
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants([])
    assert llm.generate([[5, 9, 13]], params, use_tqdm=False)[0].outputs[0].token_ids == want


# ---- a caller that leaves while its command waits for the engine thread ---------------------------
def test_callers_leaving_while_their_commands_wait_do_not_stop_the_engine_thread(ckpt):
    """A client that times out or disconnects while its add (or any engine-thread call) is queued
    cancels the future the command answers on. The command used to run anyway and then fail to set
    its result on the cancelled future, and that exception ended the engine thread: every later
    request hung (seen as ReadTimeouts in the server soak test). Now a command whose caller left
    does not run, the thread serves on, and the left request holds no blocks."""
    import asyncio
    import threading

    from cuttle.engine.async_engine import AsyncEngine

    llm = LLM(ckpt, dtype="float32", num_kv_blocks=32, block_size=16)
    aeng = AsyncEngine(llm.engine)
    aeng.start()
    ran = []

    async def main():
        gate = threading.Event()
        aeng._cmds.put(lambda: gate.wait(10))  # hold the engine thread while the callers come and go
        left = [asyncio.ensure_future(aeng.call(lambda: ran.append("call"))),
                asyncio.ensure_future(aeng.add("gone", [5, 6, 7], SamplingParams(max_tokens=4)))]
        await asyncio.sleep(0.05)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        gate.set()
        assert await asyncio.wait_for(aeng.call(lambda: 42), 10) == 42  # the thread still answers
        stream = await asyncio.wait_for(aeng.add("after", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)), 10)
        outs = [o async for o in stream]
        return outs[-1]

    try:
        last = asyncio.run(main())
    finally:
        aeng.shutdown()
    assert last.finished and len(last.outputs[0].token_ids) == 4
    assert ran == []  # the left call did not run
    assert "gone" not in llm.engine.requests
    assert llm.engine.scheduler.block_manager.num_free_blocks == 32
