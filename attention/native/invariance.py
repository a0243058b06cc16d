"""The batch-invariant switch of the CPU kernels: whether a call must give each row the result it
would get alone, whatever the other rows of the call and however many there are.

Why: an engine batches whatever requests are in flight, so with kernels whose summation order
depends on the row count a request's logprobs (and at a near tie its greedy tokens) change with
the traffic beside it, with prefill chunking and with preemption. RL samplers and evaluations want
a sample to be a function of its prompt, seed and weights only.

Which kernels already are, and what the switch changes (measured in tests/attention/
test_batch_invariance.py, every row count 1..64 against the rows alone):

- invariant at every setting: the packed bf16 GEMM (AVX512-BF16: every linear of a bf16 model),
  the routed-expert dot tiles (bf16 and MXFP8 experts on bf16 activations there), the MXFP8
  bf16 tile loop, the attention kernels, the fused norms / RoPE / SiLU and the sampler;
- fp32 linear layers: 1..4 rows stream in `small_m_linear`, more go to torch's GEMM, whose
  blocking follows the row count. Switched on: `small_m_linear` at every row count (one order per
  row; slower in prefill than torch's GEMM);
- the widening bf16 GEMM (`w16_gemm.c`, AVX2 CPUs without a bf16 dot instruction): two extra
  FMA chains at one row. Switched on: one row sums as in every other pass;
- the routed-expert panel tiles (fp32 experts, bf16 experts on AVX2, MXFP8 panels): even / odd
  k split at tiles of <= 2 rows. Switched on: no split;
- the MXFP8 linear: a decode loop up to 8 rows (its own summation order) and a tile loop above.
  Switched on: bf16 activations take the bf16 tile loop at every row count (the packed GEMM's
  order), fp32 activations the fp32 decode loop in passes of 8 rows.

The switch is a context variable (each thread its own), set by the engine's model runner around
every forward of an engine built with `batch_invariant=True`, so engines of either kind can share
a process; kernel graphs record the flag with the calls it was passed to.
"""
from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Iterator

_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("cuttle_batch_invariant", default=False)


def on() -> bool:
    """Whether the calls made now must be batch-invariant."""
    return _ON.get()


@contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Run the block with the switch set to `enabled` (restored after)."""
    token = _ON.set(bool(enabled))
    try:
        yield
    finally:
        _ON.reset(token)
