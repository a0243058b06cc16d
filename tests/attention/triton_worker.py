"""Runs the Triton backend on every attention case and prints one JSON line per case and dtype:
max error against the torch backend and the naive oracle, and whether the cache writes are exact.
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

from attention_cases import CASES, Case, build_batch, cache_matches, naive_attention  # noqa: E402
from cuttle.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from cuttle.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from cuttle.attention.triton_kernels import INTERPRETED  # noqa: E402


def compare(case: Case, dtype: torch.dtype, device: torch.device) -> dict[str, object]:
    ref_batch = build_batch(case, junk=None, dtype=dtype)
    torch_backend = TorchAttentionBackend()
    torch_backend.begin_step(ref_batch.meta)
    # The reference sees the same (rounded) inputs but computes in float32.
    ref = torch_backend.forward(
        ref_batch.q.float(), ref_batch.k.float(), ref_batch.v.float(),
        ref_batch.k_cache.float(), ref_batch.v_cache.float(), ref_batch.meta, ref_batch.scale,
    )
    batch = build_batch(case, junk=float("nan"), dtype=dtype).to(device)
    backend = TritonAttentionBackend(**case.triton)
    backend.begin_step(batch.meta)
    out = backend.forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    result: dict[str, object] = {
        "case": case.name,
        "dtype": str(dtype).removeprefix("torch."),
        "err_vs_torch": (out.float().cpu() - ref).abs().max().item(),
        "cache_exact": cache_matches(batch),
        "shape_ok": out.shape == batch.q.shape and out.dtype == batch.q.dtype,
    }
    if dtype == torch.float32:
        result["err_vs_naive"] = (out.double().cpu() - naive_attention(batch)).abs().max().item()
    return result


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


if __name__ == "__main__":
    torch.set_num_threads(1)
    run([a for a in sys.argv[1:] if a != "--cuda"])
