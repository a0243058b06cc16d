"""Squid documents on an NSA model, end to end: every segment of a query (the prefix, each
document, its own tokens) is attended by NSA's rules on its own keys and the branches merge by the
log-sum-exp (tests/attention/test_nsa_segments.py checks that rule per step).

The oracle is one full forward of the reference over the layout's dense row
(`CausalLM.forward_masked` with `SquidLayout.dense_mask_and_positions` and `dense_segments`):
no paging, no cache, no chunking. The engine's log-probabilities of every sampled token (and the
runner-up) equal it in fp32, for documents computed by the request itself and found in the cache
by a later request in another order, under prefill chunks too, on the native kernel and the
torch path, in both position conventions and with both phi. Under `concat` a document is attended
in the frame it was encoded in (the query rotated by -offset), so with the learned "linear" phi its
compressed entries are phi of the keys where it was encoded; the dense row places it at its
offset, and the oracle attends each such piece in its encoded frame (`segment_shifts`).
"""
from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__" and "--triton" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: sparse_helpers

import pytest  # noqa: E402
import torch  # noqa: E402

from cuttle.engine import LLM, SamplingParams  # noqa: E402
from cuttle.engine.squid import SquidLayout  # noqa: E402

from sparse_helpers import TOL, make_nsa_checkpoint  # noqa: E402

NSA = {"compress_block": 8, "compress_stride": 4, "select_block": 8, "top_n": 3, "init_blocks": 1, "local_blocks": 1,
       "window": 8}
DOCS = [[3 + (7 * i + 3) % 250 for i in range(70)], [3 + (11 * i + 5) % 250 for i in range(45)],
        [3 + (13 * i + 1) % 250 for i in range(58)]]
PREFIX = [5, 6, 7, 9, 11]
FIRST = {"prefix": PREFIX, "documents": [DOCS[0], DOCS[1]], "prompt": [40, 41, 42, 43, 44, 45]}
SECOND = {"prefix": PREFIX, "documents": [DOCS[2], DOCS[1], DOCS[0]], "prompt": [50, 51, 52]}
NEW = 10


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for phi in ("linear", "mean"):
        path = str(tmp_path_factory.mktemp(f"nsa-{phi}"))
        out[phi] = (path, make_nsa_checkpoint(path, {**NSA, "compress_fn": phi}, seed=3, max_position_embeddings=512))
    return out


def _run(path: str, positions: str, requests: list[dict], native: bool = True, chunk: int = 4096):
    llm = LLM(path, dtype="float32", block_size=8, num_kv_blocks=200, max_model_len=512, squid_positions=positions,
              max_num_batched_tokens=chunk)
    if not native:
        llm.engine.runner.backend.native = False
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=1)
    outs = []
    for r in requests:  # one at a time: the second request finds the first one's documents cached
        c = llm.generate([r], params, use_tqdm=False)[0].outputs[0]
        outs.append((list(c.token_ids), [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]))
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]
    return outs, st


def _reference(model, request: dict, positions: str, tokens: list[int]) -> torch.Tensor:
    """log-probabilities [len(tokens), vocab] at the query's rows of the layout's dense row."""
    layout = SquidLayout(request.get("prefix", []), request["documents"], positions)
    ctx = layout.dense_context()
    tail = list(request["prompt"]) + tokens[:-1]
    mask, pos = layout.dense_mask_and_positions(len(tail))
    seg, shifts = layout.dense_segments(len(tail))
    with torch.no_grad():
        hidden = model.forward_masked(torch.tensor([ctx + tail]), pos[None], mask[None], segments=seg[None],
                                      segment_shifts=shifts[None])[0]
        lp = model.compute_logits(hidden).log_softmax(-1)
    return lp[len(ctx) + len(request["prompt"]) - 1 :]


@pytest.mark.parametrize("positions,phi", [("shared", "linear"), ("concat", "linear"), ("concat", "mean")])
def test_documents_equal_one_dense_forward(checkpoints, positions, phi):
    path, model = checkpoints[phi]
    runs = {"native": _run(path, positions, [FIRST, SECOND]),
            "torch": _run(path, positions, [FIRST, SECOND], native=False),
            "chunked": _run(path, positions, [FIRST, SECOND], chunk=16)}
    assert runs["native"][1]["documents_hit"] >= 2  # the second request read a and b from the cache
    for name, (outs, _) in runs.items():
        compared = 0
        for request, (tokens, lps) in zip([FIRST, SECOND], outs):
            ref = _reference(model, request, positions, tokens)
            for step, d in enumerate(lps):
                for t, lp in d.items():
                    assert abs(lp - ref[step, t].item()) <= TOL, (name, step, t, lp, ref[step, t].item())
                    compared += 1
        assert compared >= 2 * NEW


def test_the_rule_is_sparse_here(checkpoints):
    """The documents are longer than top_n blocks plus the window, so a query reads a subset of
    each (the case exercises selection, not a budget covering every key); and the squid mask
    without the segments is refused for NSA layers rather than read as one causal row."""
    _, model = checkpoints["linear"]
    layout = SquidLayout(PREFIX, FIRST["documents"], "shared")
    tail = list(FIRST["prompt"])
    ids = torch.tensor([layout.dense_context() + tail])
    mask, pos = layout.dense_mask_and_positions(len(tail))
    seg, _ = layout.dense_segments(len(tail))
    with torch.no_grad():
        per_part = model.forward_masked(ids, pos[None], mask[None], segments=seg[None])
        # one segment per row: the mask alone would be squid's dense attention; NSA refuses it
        with pytest.raises(NotImplementedError, match="segments"):
            model.forward_masked(ids, pos[None], mask[None])
    assert per_part.isfinite().all()
    assert max(len(d) for d in FIRST["documents"]) > (NSA["top_n"] * NSA["select_block"] + NSA["window"])


def test_triton_nsa_kernel_takes_documents_interpreted():
    """Beside the Triton NSA kernel (what a CUDA engine runs), documents go through the same
    per-part plan (tests/attention/test_nsa_segments.py checks the kernel itself): in the
    interpreter, a small engine's tokens and logprobs equal the CPU engine's (fp32)."""
    from sparse_helpers import check_triton_subprocess

    check_triton_subprocess(__file__, {"engine-concat"}, tol=1e-5)


def _triton_engine_error(path: str) -> float:
    small = [{"prefix": PREFIX, "documents": [DOCS[0][:26], DOCS[1][:18]], "prompt": [40, 41, 42]},
             {"prefix": PREFIX, "documents": [DOCS[1][:18], DOCS[0][:26]], "prompt": [50, 51]}]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, dtype="float32", block_size=8, num_kv_blocks=64, max_model_len=256, squid_positions="concat",
                  attention_backend=backend)
        assert llm.engine.runner.backend.kernel == backend
        outs[backend] = [llm.generate([r], params, use_tqdm=False)[0].outputs[0] for r in small]
    err = 0.0
    for a, b in zip(outs["torch"], outs["triton"]):
        if list(a.token_ids) != list(b.token_ids):
            return float("inf")
        err = max([err] + [abs(x[t].logprob - y[t].logprob) for x, y in zip(a.logprobs, b.logprobs) for t in x])
    return err


def test_the_recipes_squid_rows_are_the_engines_segments(checkpoints):
    """The default model's recipe trains NSA on squid rows with each group (prefix, document,
    query) a segment (`train_default_model.token_nll`): the same numbers as the layout's own
    segments (`SquidLayout.dense_segments`, `shared`), the ones the engine was checked against above."""
    from cuttle.engine import train_default_model as recipe

    _, model = checkpoints["linear"]
    docs, query = FIRST["documents"], FIRST["prompt"]
    ids, pos, grp = recipe.squid_row(PREFIX, docs, query, 160)
    n = len(PREFIX) + sum(map(len, docs)) + len(query)
    layout = SquidLayout(PREFIX, docs, "shared")
    mask, lpos = layout.dense_mask_and_positions(len(query))
    seg, _ = layout.dense_segments(len(query))
    assert ids[:n] == layout.dense_context() + query and pos[:n] == lpos.tolist()
    with torch.no_grad():
        nll = recipe.token_nll(model, torch.tensor([ids]), torch.tensor([pos]), torch.tensor([grp]))[0, : n - 1]
        hidden = model.forward_masked(torch.tensor([ids[:n]]), lpos[None], mask[None], segments=seg[None])[0]
        want = torch.nn.functional.cross_entropy(model.compute_logits(hidden[:-1]), torch.tensor(ids[1:n]), reduction="none")
    assert (nll - want).abs().max().item() <= 1e-5


if __name__ == "__main__" and "--triton" in sys.argv:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        make_nsa_checkpoint(d, {**NSA, "compress_fn": "linear"}, seed=3, max_position_embeddings=512)
        print(json.dumps({"case": "engine-concat", "err": _triton_engine_error(d)}), flush=True)
