"""Runs the Triton backend on every attention case and prints one JSON line per case and dtype:
max error against the torch backend and the naive oracle (output and log-sum-exp), and whether
the cache writes are exact; then the segmented cases of segment_cases.py against their float64
oracle (lines with "segments": true).
Run as a script (test_attention_triton.py starts it in a subprocess) so that TRITON_INTERPRET=1 is
set before triton is imported and never leaks into other tests' process; with --cuda the kernels
are compiled for the GPU instead (and bf16 is checked too).

The Triton run sees NaN in every unwritten cache slot, so reading one shows up as a NaN output;
the torch run sees large finite junk there (its dense decode gather multiplies masked slots by 0).
"""
from __future__ import annotations

import os
import sys

CUDA = "--cuda" in sys.argv
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402

import torch  # noqa: E402

from attention_cases import CASES, Case, build_batch, cache_matches, give_back_behind_window, naive_attention, naive_lse  # noqa: E402
from segment_cases import SEG_CASES, SegCase, build_seg_batch, seg_oracle  # noqa: E402
from cuttle.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from cuttle.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from cuttle.attention.triton_kernels import INTERPRETED  # noqa: E402


def compare(case: Case, dtype: torch.dtype, device: torch.device) -> dict[str, object]:
    ref_batch = build_batch(case, junk=None, dtype=dtype)
    torch_backend = TorchAttentionBackend()
    torch_backend.begin_step(ref_batch.meta)
    # The reference sees the same (rounded) inputs but computes in float32.
    ref, _ = torch_backend.forward(
        0,
        ref_batch.q.float(), ref_batch.k.float(), ref_batch.v.float(),
        ref_batch.k_cache.float(), ref_batch.v_cache.float(), ref_batch.meta, ref_batch.scale,
    )
    batch = build_batch(case, junk=float("nan"), dtype=dtype).to(device)
    backend = TritonAttentionBackend(**case.triton)
    backend.begin_step(batch.meta)
    out, lse = backend.forward(0, batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    result: dict[str, object] = {
        "case": case.name,
        "dtype": str(dtype).removeprefix("torch."),
        "err_vs_torch": (out.float().cpu() - ref).abs().max().item(),
        "cache_exact": cache_matches(batch),
        "shape_ok": out.shape == batch.q.shape and out.dtype == batch.q.dtype,
    }
    if dtype == torch.float32:
        result["err_vs_naive"] = (out.double().cpu() - naive_attention(batch)).abs().max().item()
        result["lse_err_vs_naive"] = _lse_err(lse, naive_lse(batch))
    return result


def _lse_err(lse: torch.Tensor, ref: torch.Tensor) -> float:
    """Max error over finite entries; inf when the -inf pattern differs or lse is not fp32."""
    lse = lse.cpu()
    if lse.dtype != torch.float32 or not torch.equal(torch.isneginf(lse), torch.isneginf(ref)):
        return float("inf")
    fin = torch.isfinite(ref)
    return (lse.double() - ref)[fin].abs().max().item() if fin.any() else 0.0


def compare_segments(case: SegCase, dtype: torch.dtype, device: torch.device) -> dict[str, object]:
    """A segmented step (NaN in every unwritten slot) against the float64 oracle over the same
    rounded inputs."""
    batch = build_seg_batch(case, junk=float("nan"), dtype=dtype).to(device)
    backend = TritonAttentionBackend(**case.triton)
    backend.begin_step(batch.meta)
    out, lse = backend.forward(0, batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    ref_o, ref_lse = seg_oracle(batch)
    flat = batch.k_cache.view(-1, *batch.k_cache.shape[2:])
    return {
        "case": case.name,
        "dtype": str(dtype).removeprefix("torch."),
        "segments": True,
        "err_vs_oracle": (out.double().cpu() - ref_o).abs().max().item(),
        "lse_err_vs_oracle": _lse_err(lse, ref_lse),
        "cache_exact": bool(torch.equal(flat[batch.meta.slot_mapping], batch.k)),
        "shape_ok": out.shape == batch.q.shape and out.dtype == batch.q.dtype,
    }


def compare_window(case: Case, window: int, dtype: torch.dtype, device: torch.device) -> dict[str, object]:
    """A sliding window on layer 0 (NaN in every unwritten slot) against the float64 windowed oracle."""
    batch = build_batch(case, junk=float("nan"), seed=window, dtype=dtype).to(device)
    backend = TritonAttentionBackend(**case.triton)
    backend.set_windows({0: window})
    backend.begin_step(batch.meta)
    out, _ = backend.forward(0, batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    err = (out.double().cpu() - naive_attention(batch, window)).abs().max().item()
    # the same step after the block manager gave back the blocks before each window (NULL_BLOCK
    # entries, their KV NaN): the walk loads nothing from them
    batch = build_batch(case, junk=float("nan"), seed=window, dtype=dtype)
    given = give_back_behind_window(batch, window, float("nan"))
    batch = batch.to(device)
    backend.begin_step(batch.meta)
    out, _ = backend.forward(0, batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    return {"case": case.name, "dtype": str(dtype).removeprefix("torch."), "window": window, "err_vs_oracle": err,
            "given_back": given, "given_back_err_vs_oracle": (out.double().cpu() - naive_attention(batch, window)).abs().max().item()}


def compare_segments_window(case: SegCase, window: int, device: torch.device) -> dict[str, object]:
    """A segmented step under a sliding window on layer 0 (positions per part: documents one after
    another, then the sequence's own tokens) against the float64 windowed oracle, float32."""
    batch = build_seg_batch(case, junk=float("nan"), seed=window).to(device)
    backend = TritonAttentionBackend(**case.triton)
    backend.set_windows({0: window})
    backend.begin_step(batch.meta)
    out, lse = backend.forward(0, batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    ref_o, ref_lse = seg_oracle(batch, window)
    return {"case": case.name, "dtype": "float32", "window": window, "segments": True,
            "err_vs_oracle": (out.double().cpu() - ref_o).abs().max().item(), "lse_err_vs_oracle": _lse_err(lse, ref_lse)}


WINDOW_CASES = ("gqa_mixed", "mha_prefill", "gqa_decode_split")
WINDOWS = (1, 5, 16, 24)
SEG_WINDOWS = (1, 8, 30)


def run(names: list[str]) -> None:
    assert INTERPRETED != CUDA, "triton was imported before TRITON_INTERPRET was set as intended"
    device = torch.device("cuda" if CUDA else "cpu")
    # bf16 cannot run in the interpreter (its tl.dot is wrong there); fp16 takes the same casts.
    dtypes = (torch.float32, torch.float16, torch.bfloat16) if CUDA else (torch.float32, torch.float16)
    for case in CASES:
        if names and case.name not in names:
            continue
        for dtype in dtypes:
            print(json.dumps(compare(case, dtype, device)), flush=True)
    for case in SEG_CASES:
        if names and case.name not in names:
            continue
        for dtype in dtypes:
            print(json.dumps(compare_segments(case, dtype, device)), flush=True)
    for case in CASES:
        if case.name not in WINDOW_CASES or (names and case.name not in names):
            continue
        for window in WINDOWS:
            print(json.dumps(compare_window(case, window, dtypes[0], device)), flush=True)
    for case in SEG_CASES:
        if names and case.name not in names:
            continue
        for window in SEG_WINDOWS:
            print(json.dumps(compare_segments_window(case, window, device)), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    run([a for a in sys.argv[1:] if a != "--cuda"])
