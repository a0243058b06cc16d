"""Attention interface v2: KV segments and the (o, lse) contract.

- `AttentionMetadata.build`: one causal segment per sequence gives exactly the classic metadata
  (and no segment batch); the segment batch's fields; every malformed layout is refused clearly.
- The torch backend (native kernel and plain torch) on segmented batches against a float64 oracle
  over the concatenated keys, o and lse within 1e-5 in fp32: GQA 4, MHA, MQA, groups of 3,
  documents ending mid-block, contexts shorter than a block, empty segments, a document shared
  by sequences at different offsets, decode rows beside chunked prefill rows; bf16 too.
- lse on the one-segment cases of attention_cases.py.
- Rotating the query by -delta for a segment equals rotating that segment's cached keys to their
  new positions (keys rotated by the model's RotaryEmbedding, fp32).
- Refusals: a host-pool segment without the host pool's caches, an unknown pool, a segmented step on flashinfer, a rope type whose
  angle is not linear in position.
"""
from __future__ import annotations


import pytest
import torch

from attention_cases import CASES, Case, build_batch, naive_attention, naive_lse
from segment_cases import SEG_CASES, SegCase, build_seg_batch, rotate_keys, seg_oracle
from cuttle.attention import native_attention
from cuttle.attention.flashinfer_backend import FlashInferAttentionBackend
from cuttle.attention.metadata import AttentionMetadata, KVSegment, SeqLayout
from cuttle.attention.rope import RotaryEmbedding
from cuttle.attention.torch_backend import TorchAttentionBackend

NATIVE = [True, False] if native_attention.available() else [False]


def _run(backend, batch) -> tuple[torch.Tensor, torch.Tensor]:
    backend.begin_step(batch.meta)
    return backend.forward(3, batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale)


def _lse_err(lse: torch.Tensor, ref: torch.Tensor) -> float:
    """Max error of the finite entries; -inf entries must match exactly."""
    assert lse.dtype == torch.float32 and lse.shape == ref.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref)), "an empty row's lse must be -inf, and only those"
    fin = torch.isfinite(ref)
    return (lse.double() - ref)[fin].abs().max().item() if fin.any() else 0.0


# ---------------------------------------------------------------- the builder


def _one_segment_layouts(meta: AttentionMetadata) -> list[SeqLayout]:
    bs = meta.block_size
    return [
        SeqLayout(ql, [KVSegment(meta.block_tables[b, : -(-sl // bs)].tolist(), sl, causal=True)])
        for b, (ql, sl) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu))
    ]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_build_with_one_segment_each_is_the_classic_metadata(case: Case) -> None:
    meta = build_batch(case, junk=0.0).meta
    built = AttentionMetadata.build(_one_segment_layouts(meta), meta.block_size, "cpu")
    assert built.segments is None and not built.has_rope_deltas
    for name in ("query_start_loc", "seq_lens", "slot_mapping"):
        assert torch.equal(getattr(built, name), getattr(meta, name)), name
    for b, sl in enumerate(meta.seq_lens_cpu):
        nb = -(-sl // meta.block_size)
        assert torch.equal(built.block_tables[b, :nb], meta.block_tables[b, :nb])
    assert (built.query_lens_cpu, built.seq_lens_cpu) == (meta.query_lens_cpu, meta.seq_lens_cpu)
    assert (built.max_query_len, built.max_seq_len, built.block_size) == (meta.max_query_len, meta.max_seq_len, meta.block_size)
    assert built.block_tables.dtype == torch.int32 and built.slot_mapping.dtype == torch.int64


def test_build_segment_batch_fields() -> None:
    """Two sequences, block size 4: b0 = a 6-token document moved by +3, a 2-token empty-ish
    document, then 5 own tokens of which 2 are new (the causal segment ends mid-block); b1 = 3 own
    tokens, all new."""
    rope = RotaryEmbedding(8, 32, 10000.0, None, torch.device("cpu"))
    seqs = [
        SeqLayout(2, [KVSegment([7, 2], 6, False, rope_delta=3), KVSegment([5], 2, False), KVSegment([9, 4], 5, True)]),
        SeqLayout(3, [KVSegment([1], 3, True)]),
    ]
    meta = AttentionMetadata.build(seqs, 4, "cpu", rope)
    assert meta.query_lens_cpu == [2, 3] and meta.seq_lens_cpu == [5, 3]
    assert meta.slot_mapping.tolist() == [9 * 4 + 3, 4 * 4 + 0, 4, 5, 6]  # tokens 3, 4 of b0; 0..2 of b1
    assert meta.block_tables.tolist() == [[9, 4], [1, 0]]
    sb = meta.segments
    assert sb is not None and meta.has_rope_deltas
    assert sb.seq_ids_cpu == [0, 0, 0, 1] and sb.kv_lens_cpu == [6, 2, 5, 3] and sb.causal_cpu == [False, False, True, True]
    assert sb.query_lens_cpu == [2, 2, 2, 3] and sb.deltas_cpu == [3, 0, 0, 0]
    assert sb.query_start_loc.tolist() == [0, 2, 4, 6, 9] and sb.num_rows == 9 and sb.num_parts == 4
    assert sb.row_index.tolist() == [0, 1, 0, 1, 0, 1, 2, 3, 4]
    assert sb.block_tables.tolist() == [[7, 2], [5, 0], [9, 4], [1, 0]]
    assert sb.causal.tolist() == [0, 0, 1, 1] and sb.kv_lens.tolist() == [6, 2, 5, 3]
    assert sb.rot_rows.tolist() == [0, 1] and sb.rot_cos.shape == (2, 1, 4)
    angle = 3 * rope.inv_freq  # rotate q by -3 positions
    assert torch.equal(sb.rot_cos[0, 0], angle.cos()) and torch.equal(sb.rot_sin[1, 0], -angle.sin())
    assert (sb.max_query_len, sb.max_kv_len) == (3, 6)


def _seg(n: int, causal: bool, **kw) -> KVSegment:
    return KVSegment(list(range(-(-n // 4))), n, causal, **kw)


@pytest.mark.parametrize(
    "seqs, error, match",
    [
        ([SeqLayout(1, [])], ValueError, "no KV segment"),
        ([SeqLayout(0, [_seg(3, True)])], ValueError, "query_len"),
        ([SeqLayout(1, [_seg(3, False)])], ValueError, "only the last segment"),
        ([SeqLayout(1, [_seg(3, True), _seg(3, True)])], ValueError, "only the last segment"),
        ([SeqLayout(4, [_seg(3, True)])], ValueError, "cannot hold"),
        ([SeqLayout(1, [KVSegment([0], 5, True)])], ValueError, "do not fit"),
        ([SeqLayout(1, [_seg(4, True, rope_delta=2)])], ValueError, "rope_delta must be 0"),
        ([SeqLayout(1, [_seg(4, False, rope_delta=2), _seg(1, True)])], ValueError, "RotaryEmbedding"),
        ([SeqLayout(1, [_seg(4, False, pool=1), _seg(1, True)])], ValueError, "no host_kv"),  # host pool, none given
        ([SeqLayout(1, [_seg(4, False, pool=2), _seg(1, True)])], ValueError, "pools are 0"),
        ([], ValueError, "at least one"),
    ],
)
def test_build_refuses_malformed_layouts(seqs: list[SeqLayout], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        AttentionMetadata.build(seqs, 4, "cpu")


def test_rope_types_not_linear_in_position_are_refused() -> None:
    rope = RotaryEmbedding(8, 32, 10000.0, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16}, torch.device("cpu"))
    rope.delta_tables([5])  # llama3 only rescales frequencies: fine
    rope.rope_type = "dynamic"
    with pytest.raises(NotImplementedError, match="not linear in position"):
        AttentionMetadata.build([SeqLayout(1, [_seg(4, False, rope_delta=2), _seg(1, True)])], 4, "cpu", rope)


# ---------------------------------------------------------------- backends vs the oracle


@pytest.mark.parametrize("native", NATIVE, ids=lambda n: "native" if n else "torch")
@pytest.mark.parametrize("case", SEG_CASES, ids=lambda c: c.name)
def test_torch_backend_segments_match_oracle_fp32(case: SegCase, native: bool) -> None:
    batch = build_seg_batch(case, junk=None)
    backend = TorchAttentionBackend(native=native)
    assert backend.native == native
    o, lse = _run(backend, batch)
    ref_o, ref_lse = seg_oracle(batch)
    assert o.shape == batch.q.shape and o.dtype == torch.float32
    assert (o.double() - ref_o).abs().max().item() <= 1e-5
    assert _lse_err(lse, ref_lse) <= 1e-5
    # this step's K/V went into the causal segments' slots
    flat = batch.k_cache.view(-1, *batch.k_cache.shape[2:])
    assert torch.equal(flat[batch.meta.slot_mapping], batch.k)


@pytest.mark.parametrize("native", NATIVE, ids=lambda n: "native" if n else "torch")
@pytest.mark.parametrize("case", SEG_CASES, ids=lambda c: c.name)
def test_sliding_windows_over_segments_match_oracle_fp32(case: SegCase, native: bool) -> None:
    """Windows by position over parts: documents wholly before a row's window (neutral in its
    merge), partly inside it, rows of one chunk seeing different parts; a window of 1 (each row
    its own key only) up to one no row reaches past (the plan without a window)."""
    batch = build_seg_batch(case, junk=None)
    reach = max(p[-1] + own.shape[0] for p, own in zip(batch.seq_pos, batch.own_k))
    full_o, full_lse = _run(TorchAttentionBackend(native=native), batch)
    for window in (1, 3, 8, 17, 30, reach):
        backend = TorchAttentionBackend(native=native)
        backend.set_windows({3: window})
        o, lse = _run(backend, batch)
        ref_o, ref_lse = seg_oracle(batch, window)
        assert (o.double() - ref_o).abs().max().item() <= 1e-5, window
        assert _lse_err(lse, ref_lse) <= 1e-5, window
        if window == 3:  # the window is real: a narrow one changes the output
            assert not torch.allclose(o, full_o, atol=1e-3)
    assert torch.equal(o, full_o) and torch.equal(lse, full_lse)  # one no row reaches past: the plan without it


@pytest.mark.parametrize("case", SEG_CASES, ids=lambda c: c.name)
def test_native_segments_bf16(case: SegCase, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 cache and q: fp32 math from bf16 inputs; the rotated q of a moved segment is rounded to
    bf16 once more and the output once, so o is within 2^-7 (relative, 1 below) of the float64
    oracle over the same rounded K/V/q, and lse within 2^-7 * max(1, |lse|)."""
    if not native_attention.available():
        pytest.skip("the native kernel is not built here")
    calls: list[int] = []
    real = native_attention.paged_attention_rows
    monkeypatch.setattr(native_attention, "paged_attention_rows", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    batch = build_seg_batch(case, junk=None, dtype=torch.bfloat16)
    o, lse = _run(TorchAttentionBackend(native=True), batch)
    assert o.dtype == torch.bfloat16 and calls == [1]
    ref_o, ref_lse = seg_oracle(batch)
    assert ((o.double() - ref_o).abs() / ref_o.abs().clamp_min(1.0)).max().item() <= 2**-7
    fin = torch.isfinite(ref_lse)
    assert (((lse.double() - ref_lse).abs() / ref_lse.abs().clamp_min(1.0))[fin]).max().item() <= 2**-7


@pytest.mark.parametrize("native", NATIVE, ids=lambda n: "native" if n else "torch")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_torch_backend_lse_one_segment(case: Case, native: bool) -> None:
    batch = build_batch(case, junk=None)
    o, lse = _run(TorchAttentionBackend(native=native), batch)
    assert (o.double() - naive_attention(batch)).abs().max().item() <= 1e-5
    assert _lse_err(lse, naive_lse(batch)) <= 1e-5


@pytest.mark.parametrize("native", NATIVE, ids=lambda n: "native" if n else "torch")
def test_segmented_step_equals_one_segment_step_without_extra_segments(native: bool) -> None:
    """A segmented step whose sequences are only their causal segments gives what the fast path
    gives (the same attention, through the parts machinery and the merge)."""
    batch = build_batch(CASES[0], junk=None)
    o1, l1 = _run(TorchAttentionBackend(native=native), batch)
    layouts = _one_segment_layouts(batch.meta)
    layouts[1].segments.insert(0, KVSegment([], 0, causal=False))  # an empty segment forces the segmented path
    batch.meta = AttentionMetadata.build(layouts, batch.meta.block_size, "cpu")
    assert batch.meta.segments is not None
    o2, l2 = _run(TorchAttentionBackend(native=native), batch)
    assert (o1 - o2).abs().max().item() <= 1e-6 and (l1 - l2).abs().max().item() <= 1e-6


# ---------------------------------------------------------------- RoPE: rotate q, not the keys


@pytest.mark.parametrize("native", NATIVE, ids=lambda n: "native" if n else "torch")
@pytest.mark.parametrize("rotary_dim", [32, 16])
@pytest.mark.parametrize("delta", [7, -5, 23])
def test_query_rotation_equals_rerotated_keys(native: bool, rotary_dim: int, delta: int) -> None:
    """A document's raw keys rotated by the model's RotaryEmbedding at positions c = 0..n-1 and cached
    once, attended with rope_delta = delta, equals the same document cached with its keys rotated at
    c + delta and attended with no delta (fp32, within 1e-5), for a decode row and a prefill chunk.
    Positions stay small so the fp32 angles p * inv_freq of the two computations agree to ~1e-6."""
    g = torch.Generator().manual_seed(abs(delta) + rotary_dim)
    hkv, h, d, bs, n = 2, 4, 32, 8, 13
    rope = RotaryEmbedding(rotary_dim, 128, 10000.0, None, torch.device("cpu"))

    def rotate(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = rope.tables(pos, torch.float32)
        r = rotary_dim // 2
        x1, x2 = x[..., :r], x[..., r:rotary_dim]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]), dim=-1)

    raw_k, doc_v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    base = 40  # the query's own tokens sit after the document's new place
    own_raw_k = torch.randn(6, hkv, d, generator=g)
    own_v = torch.randn(6, hkv, d, generator=g)
    q_raw = torch.randn(5, h, d, generator=g)
    own_pos = torch.arange(base, base + 6)
    own_k = rotate(own_raw_k, own_pos)
    q = rotate(q_raw, torch.cat([own_pos[-1:], own_pos[2:6]]))  # b0 decodes token 5; b1 prefills tokens 2..5

    outs = []
    for moved in (True, False):
        k_cache = torch.zeros(8, bs, hkv, d)
        v_cache = torch.zeros(8, bs, hkv, d)
        doc_k = rotate(raw_k, torch.arange(n) + 10) if moved else rotate(raw_k, torch.arange(n) + 10 + delta)
        flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
        flat_k[bs * 3 : bs * 3 + n], flat_v[bs * 3 : bs * 3 + n] = doc_k, doc_v  # blocks 3, 4 (ends mid-block)
        for own_blocks in ([0], [1]):
            s = own_blocks[0] * bs
            flat_k[s : s + 6], flat_v[s : s + 6] = own_k, own_v
        doc = KVSegment([3, 4], n, causal=False, rope_delta=delta if moved else 0)
        seqs = [SeqLayout(1, [doc, KVSegment([0], 6, True)]), SeqLayout(4, [doc, KVSegment([1], 6, True)])]
        meta = AttentionMetadata.build(seqs, bs, "cpu", rope)
        k_new = torch.cat([own_k[5:], own_k[2:]])
        v_new = torch.cat([own_v[5:], own_v[2:]])
        backend = TorchAttentionBackend(native=native)
        backend.begin_step(meta)
        outs.append(backend.forward(0, q, k_new, v_new, k_cache, v_cache, meta, d**-0.5))
    (o_q, lse_q), (o_k, lse_k) = outs
    assert (o_q - o_k).abs().max().item() <= 1e-5
    assert (lse_q - lse_k).abs().max().item() <= 1e-5
    # and the oracle agrees that moving keys by delta is rotate_keys
    moved_keys = rotate_keys(rotate(raw_k, torch.arange(n) + 10), delta, rope)
    assert (moved_keys - rotate(raw_k, torch.arange(n) + 10 + delta).double()).abs().max().item() <= 1e-5


# ---------------------------------------------------------------- refusals


def test_flashinfer_refuses_segmented_steps() -> None:
    batch = build_seg_batch(SEG_CASES[0], junk=0.0)
    backend = object.__new__(FlashInferAttentionBackend)  # no CUDA here: only the refusal runs
    with pytest.raises(NotImplementedError, match="segmented"):
        backend.forward(0, batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
