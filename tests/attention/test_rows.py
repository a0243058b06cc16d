"""`native.rows` (csrc/rows.c): row gathers, row scatters and bf16 widening equal the torch ops
they replace, byte for byte, and refuse out-of-range indices without writing anything."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cuttle.attention.native import available, rows

pytestmark = pytest.mark.skipif(not available(), reason="native CPU kernel library not built (no C compiler)")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_gather_is_embedding_byte_for_byte(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    table = torch.randn(300, 48, generator=g).to(dtype)
    idx = torch.tensor([0, 299, 7, 7, 150])
    ref = F.embedding(idx, table) if dtype != torch.float8_e4m3fn else table[idx]
    assert torch.equal(_bits(rows.gather(table, idx)), _bits(ref))


def test_gather_of_rope_tables_and_empty_index() -> None:
    cos = torch.randn(64, 8).bfloat16()
    pos = torch.tensor([5, 63, 0])
    assert torch.equal(rows.gather(cos, pos), cos[pos])
    assert rows.gather(cos, torch.empty(0, dtype=torch.int64)).shape == (0, 8)
    cube = torch.randn(10, 3, 4)
    assert torch.equal(rows.gather(cube, pos % 10), cube[pos % 10])


def test_gather_out_of_range_raises() -> None:
    table = torch.randn(10, 4)
    for bad in ([10], [-1], [3, 11]):
        with pytest.raises(IndexError, match="out of range"):
            rows.gather(table, torch.tensor(bad))


def test_gather_under_autograd_takes_torch() -> None:
    table = torch.randn(10, 4, requires_grad=True)
    rows.gather(table, torch.tensor([1, 2])).sum().backward()
    assert table.grad is not None and table.grad[1].eq(1).all() and table.grad[0].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_equals_index_copy_from_strided_rows(dtype: torch.dtype) -> None:
    """K rows as the model hands them: a view into the fused qkv rows (row stride > row size)."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(3, 4 * 16 + 2 * 2 * 16, generator=g).to(dtype)
    k = qkv[:, 64:96].view(3, 2, 16)
    cache = torch.randn(5, 4, 2, 16, generator=g).to(dtype)
    ref = cache.clone()
    slots = torch.tensor([19, 0, 6])
    ref.view(-1, 2, 16).index_copy_(0, slots, k)
    rows.scatter_(cache.view(-1, 2, 16), slots, k)
    assert torch.equal(_bits(cache), _bits(ref))


def test_scatter_out_of_range_writes_nothing() -> None:
    cache = torch.zeros(8, 4)
    with pytest.raises(IndexError, match="out of range"):
        rows.scatter_(cache, torch.tensor([2, 8]), torch.ones(2, 4))
    assert cache.eq(0).all()


def test_to_float_widens_every_bf16_value_exactly() -> None:
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(256, 256)
    got = rows.to_float(every)
    assert got.dtype == torch.float32 and torch.equal(_bits(got), _bits(every.float()))  # NaN payloads, inf, subnormals
    strided = every[:, :100]
    assert torch.equal(_bits(rows.to_float(strided)), _bits(strided.float()))
    x = torch.randn(3, 5)
    assert rows.to_float(x) is x  # fp32 stays itself, as .float() does
