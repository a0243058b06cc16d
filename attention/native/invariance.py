"""The batch-invariant switch of the CPU kernels: whether a call must give each row the result it
would get alone, whatever the other rows of the call and however many there are.

Why: an engine batches whatever requests are in flight, so with kernels whose summation order
depends on the row count a request's logprobs (and at a near tie its greedy tokens) change with
the traffic beside it, with prefill chunking and with preemption. RL samplers and evaluations want
a sample to be a function of its prompt, seed and weights only.

Which kernels already are, and what the switch changes (tests/attention/test_batch_invariance.py:
each kernel at row counts 1..64 against the rows alone; tests/engine/test_batch_invariance.py: the
engine):

- invariant at every setting: the packed bf16 GEMM (AVX512-BF16: every linear of a bf16 model),
  the routed-expert dot tiles (bf16 and MXFP8 experts on bf16 activations there), the attention,
  NSA and top-k kernels (per row), the fused norms / RoPE, the gates' sigmoid (`fused.sigmoid`)
  and the sampler;
- fp32 linear layers: 1..4 rows stream in `small_m_linear`, more go to torch's GEMM, whose
  blocking follows the row count. Switched on: `small_m_linear` at every row count (one order per
  row; slower in prefill than torch's GEMM);
- the widening bf16 GEMM (`w16_gemm.c`, AVX2 CPUs without a bf16 dot instruction): two extra
  FMA chains at one row. Switched on: one row sums as in every other pass;
- the routed-expert panel tiles (fp32 experts, bf16 experts on AVX2, MXFP8 panels): even / odd
  k split at tiles of <= 2 rows, and on AVX2 an MXFP8 tile of one row sums in a third order (the
  one-row tile). Switched on: no split, no one-row tile;
- the MXFP8 linear: a decode loop up to 12 rows (bf16 activations; 8 for fp32), which sums every
  row in one order, and a tile loop above it, which sums in another; on AVX2 one or two rows take
  the placed loop, with orders of their own. Switched on: the decode loop at every row count (in
  passes of 8 rows; the bf16 one decodes each group of weight rows once), no placed loop;
- SiLU-mul (`fused.silu_mul`): a scalar exp at the tails of torch's thread ranges, whose places in
  the batch follow its row count. Switched on: the tail at each row's end;
- attention prefill (`torch_backend`): chunks of more than 256 tokens go to SDPA, which tiles by the
  chunk's length. Switched on: every chunk takes the native rows.

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
