"""Squid documents under sliding windows (Mistral's on every layer; gpt-oss's on alternate layers,
with attention sinks), on the torch backend (native kernel and plain torch).

A window is measured in positions, the layout's: a document placed at P + offset sits there for
the query, so a query token at p sees the keys of every segment within W - 1 positions of it
(a document wholly before its window is neutral in its merge), and a document's own tokens, as
it is encoded, see the prefix within their window.

Oracle: one dense forward of the layout's row (`CausalLM.forward_masked` with
`SquidLayout.dense_mask_and_positions`), which masks windowed layers by position. The engine's
logprobs of every sampled token (and the runner-up) equal it in fp32, for documents computed by
the request (chunked, so document rows of one chunk see different parts of the prefix) and found
in the cache by a later request in another order, in both conventions. The documents run well
past the window and the oracle without its window differs, so the window is what is checked.
The Triton backend is held to the same oracle in the interpreter (Mistral, `concat`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import ModelConfig
from cuttle.engine.models.loader import load_model
from cuttle.engine.squid import SquidLayout
from helpers import save_checkpoint, tiny_mistral
from moe_families import randomize_

DOCS = [[3 + (7 * i + 3) % 250 for i in range(29)], [3 + (11 * i + 5) % 250 for i in range(22)],
        [3 + (13 * i + 1) % 250 for i in range(37)]]
PREFIX = [5, 6, 7, 8, 9]
FIRST = {"prefix": PREFIX, "documents": [DOCS[0], DOCS[1]], "prompt": [40, 41, 42, 43]}
SECOND = {"prefix": PREFIX, "documents": [DOCS[2], DOCS[1], DOCS[0]], "prompt": [50, 51]}
NEW = 8


def _gpt_oss():
    import transformers

    cfg = transformers.GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=16, max_position_embeddings=512,
                                    tie_word_embeddings=False, eos_token_id=1, pad_token_id=0,
                                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                     "rope_theta": 150000.0})
    model = randomize_(transformers.GptOssForCausalLM(cfg).float().eval(), 0.15, seed=5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.5, 1.0)
    return model


def _checkpoint(name: str, tmp_path_factory):
    """(path, our model, our model with no window) of a saved checkpoint."""
    path, _ = save_checkpoint(str(tmp_path_factory.mktemp(name)), {"mistral": lambda: tiny_mistral(12, head_dim=16), "gpt_oss": _gpt_oss}[name]())
    mc = ModelConfig.from_pretrained(path)
    assert mc.sliding_window_layers and mc.sliding_window < min(len(d) for d in DOCS)
    ours = load_model(path, mc, torch.float32, torch.device("cpu"))
    unwindowed = ModelConfig.from_pretrained(path)
    unwindowed.sliding_window_layers = ()
    return path, ours, load_model(path, unwindowed, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module", params=["mistral", "gpt_oss"])
def windowed(request, tmp_path_factory):
    return _checkpoint(request.param, tmp_path_factory)


def _run(path: str, positions: str, native: bool, attention_backend: str = "torch"):
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=160, max_model_len=256, squid_positions=positions,
              max_num_batched_tokens=16, attention_backend=attention_backend)
    if native is False and attention_backend == "torch":
        llm.engine.runner.backend.native = False
    assert llm.engine.max_model_len == 256  # past the window: documents are windowed, not capped
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=1)
    outs = [llm.generate([r], params, use_tqdm=False)[0].outputs[0] for r in (FIRST, SECOND)]
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]
    assert st["documents_hit"] >= 2  # the second request read the first one's documents from the cache
    return [(list(c.token_ids), [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]) for c in outs]


def _dense_logprobs(model, request: dict, tokens: list[int], positions: str) -> torch.Tensor:
    layout = SquidLayout(request["prefix"], request["documents"], positions)
    ctx, tail = layout.dense_context(), request["prompt"] + tokens[:-1]
    mask, pos = layout.dense_mask_and_positions(len(tail))
    with torch.no_grad():
        hidden = model.forward_masked(torch.tensor([ctx + tail]), pos[None], mask[None])[0]
        return model.compute_logits(hidden).log_softmax(-1)[len(ctx) + len(request["prompt"]) - 1 :]


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("positions", ["shared", "concat"])
def test_documents_under_windows_equal_one_dense_forward(windowed, positions, native):
    path, model, unwindowed = windowed
    outs = _run(path, positions, native)
    apart = 0.0
    for request, (tokens, lps) in zip([FIRST, SECOND], outs):
        ref = _dense_logprobs(model, request, tokens, positions)
        for step, d in enumerate(lps):
            for t, lp in d.items():
                assert abs(lp - ref[step, t].item()) <= 2e-5, (positions, step, t, lp, ref[step, t].item())
        full = _dense_logprobs(unwindowed, request, tokens, positions)
        apart = max(apart, (full - ref).abs().max().item())
    assert apart > 1e-2  # without its window the oracle says otherwise: the window is what was checked


def test_documents_under_windows_on_triton_interpreted(tmp_path_factory, tmp_path):
    """The Triton backend (in the interpreter, fp32, in a subprocess: TRITON_INTERPRET must be set
    before triton is imported) windows the parts by position too (`gaps`): the same dense oracle.
    Mistral only (the interpreter is slow; the kernel is checked per part layout in
    tests/attention/test_attention_triton.py)."""
    path, model, _ = _checkpoint("mistral", tmp_path_factory)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # helpers, moe_families
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([tests, *filter(None, [env.get("PYTHONPATH")])])
    out = tmp_path / "outs.json"
    proc = subprocess.run([sys.executable, __file__, path, "concat", str(out)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(__file__))
    assert proc.returncode == 0, proc.stderr[-4000:]
    outs = json.loads(out.read_text())
    for request, (tokens, lps) in zip([FIRST, SECOND], outs):
        ref = _dense_logprobs(model, request, tokens, "concat")
        for step, d in enumerate(lps):
            for t, lp in d.items():
                assert abs(lp - ref[step, int(t)].item()) <= 2e-5, (step, t, lp, ref[step, int(t)].item())


if __name__ == "__main__":  # the Triton run of the test above: path, convention, output file
    outs = _run(sys.argv[1], sys.argv[2], native=False, attention_backend="triton")
    with open(sys.argv[3], "w") as f:
        json.dump(outs, f)
