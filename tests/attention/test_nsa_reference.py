"""The NSA torch reference (attention/nsa.py) against dense attention and explicit per-row loops:
issue 16's acceptance 1 (all blocks + w >= T equal dense causal, one-hot gates, order and
padding of the selected indices), 2 (forced blocks, causality of the selection, GQA-shared
selection, Eq. 9's weights) and 6 (bad configs name their field)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cuttle.attention.nsa import NSAConfig, compress, eq9_matrix, nsa_attend, select_blocks, selection_scores

SMALL = NSAConfig(compress_block=8, compress_stride=4, select_block=16, top_n=4, init_blocks=1, local_blocks=2, window=24)


def _inputs(seq: int, heads: int, kv_heads: int, dim: int = 16, seed: int = 0, scale_qk: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(seq, heads, dim, generator=g) * scale_qk
    k = torch.randn(seq, kv_heads, dim, generator=g) * scale_qk
    v = torch.randn(seq, kv_heads, dim, generator=g)
    return q, k, v


def _dense_causal(q, k, v, scale):
    group = q.shape[1] // k.shape[1]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].double(), k.repeat_interleave(group, 1).transpose(0, 1)[None].double(),
        v.repeat_interleave(group, 1).transpose(0, 1)[None].double(), is_causal=True, scale=scale,
    )
    return o[0].transpose(0, 1).float()


def _row_attention(qrow, k, v, keys, scale):
    """One query head against an explicit list of key indices (float64)."""
    if not keys:
        return torch.zeros(v.shape[-1], dtype=torch.float64)
    kk, vv = k[keys].double(), v[keys].double()
    p = torch.softmax(kk @ qrow.double() * scale, 0)
    return p @ vv


def _gates(seq, heads, which):
    g = torch.zeros(seq, heads, 3)
    g[..., which] = 1.0
    return g


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (8, 1)])
def test_all_blocks_and_full_window_equal_dense_causal(heads, kv_heads):
    seq = 77  # 5 selection blocks of 16, the last partial
    cfg = NSAConfig(compress_block=8, compress_stride=4, select_block=16, top_n=5, window=seq)
    q, k, v = _inputs(seq, heads, kv_heads)
    ck, cv = compress(k, None, NSAConfig(**{**_fields(cfg), "compress_fn": "mean"})), compress(v, None, _mean(cfg))
    pos = torch.arange(seq)
    dense = _dense_causal(q, k, v, 0.25)
    o_slc, idx = nsa_attend(q, k, v, ck, cv, _gates(seq, heads, 1), pos, cfg, 0.25)
    o_win, _ = nsa_attend(q, k, v, ck, cv, _gates(seq, heads, 2), pos, cfg, 0.25)
    assert (o_slc - dense).abs().max().item() <= 1e-5
    assert (o_win - dense).abs().max().item() <= 1e-5
    # every causal block really was selected: row t holds exactly blocks 0 .. t // 16
    for t in (0, 15, 16, 40, 76):
        got = sorted(b for b in idx[t, 0].tolist() if b >= 0)
        assert got == list(range(t // 16 + 1))


def _fields(cfg: NSAConfig) -> dict:
    return {f: getattr(cfg, f) for f in NSAConfig.__slots__}


def _mean(cfg: NSAConfig) -> NSAConfig:
    return NSAConfig(**{**_fields(cfg), "compress_fn": "mean"})


def test_one_hot_gates_give_each_branch_and_mixed_gates_their_sum():
    seq, heads, kv_heads, scale = 70, 4, 2, 0.3
    cfg = _mean(SMALL)
    q, k, v = _inputs(seq, heads, kv_heads, seed=1)
    ck, cv = compress(k, None, cfg), compress(v, None, cfg)
    pos = torch.arange(seq)
    outs = [nsa_attend(q, k, v, ck, cv, _gates(seq, heads, b), pos, cfg, scale) for b in range(3)]
    idx = outs[1][1]
    group = heads // kv_heads
    for t in (0, 6, 7, 11, 31, 32, 47, 69):
        nc = max(0, (t + 1 - 8) // 4 + 1)
        blocks = [b for b in idx[t, :].tolist()]
        for h in range(heads):
            want_c = _row_attention(q[t, h], ck[:, h // group], cv[:, h // group], list(range(nc)), scale)
            sel = sorted({x for x in range(t + 1) if x // 16 in blocks[h // group]})
            want_s = _row_attention(q[t, h], k[:, h // group], v[:, h // group], sel, scale)
            want_w = _row_attention(q[t, h], k[:, h // group], v[:, h // group], list(range(max(0, t - 23), t + 1)), scale)
            for (o, _), want in zip(outs, (want_c, want_s, want_w)):
                assert (o[t, h].double() - want).abs().max().item() <= 1e-5
    gates = torch.rand(seq, heads, 3, generator=torch.Generator().manual_seed(3))
    mixed, _ = nsa_attend(q, k, v, ck, cv, gates, pos, cfg, scale)
    want = sum(gates[..., b : b + 1] * outs[b][0] for b in range(3))
    assert (mixed - want).abs().max().item() <= 1e-5
    assert outs[0][0][:7].abs().max().item() == 0.0  # rows before the first complete compressed block


def test_selected_index_order_and_padding_are_inert():
    seq, heads, kv_heads = 90, 4, 2
    cfg = _mean(SMALL)
    q, k, v = _inputs(seq, heads, kv_heads, seed=2)
    ck, cv = compress(k, None, cfg), compress(v, None, cfg)
    pos = torch.arange(seq)
    gates = _gates(seq, heads, 1)
    o, idx = nsa_attend(q, k, v, ck, cv, gates, pos, cfg, 0.25)
    perm = torch.argsort(torch.rand(idx.shape, generator=torch.Generator().manual_seed(4)), dim=-1)
    shuffled = torch.gather(idx, -1, perm)
    assert not torch.equal(shuffled, idx)
    o2, _ = nsa_attend(q, k, v, ck, cv, gates, pos, cfg, 0.25, block_indices=shuffled)
    padded = torch.cat([torch.full((seq, kv_heads, 3), -1), idx], dim=-1)
    o3, _ = nsa_attend(q, k, v, ck, cv, gates, pos, cfg, 0.25, block_indices=padded)
    assert torch.equal(o, o2) or (o - o2).abs().max().item() <= 1e-6
    assert (o - o3).abs().max().item() <= 1e-6
    # and a different set does change the output (the override is really used)
    other = torch.zeros_like(idx)
    o4, _ = nsa_attend(q, k, v, ck, cv, gates, pos, cfg, 0.25, block_indices=other)
    assert (o - o4)[40:].abs().max().item() > 1e-3


def test_forced_blocks_always_selected_and_nothing_after_the_query():
    cfg = NSAConfig(compress_block=8, compress_stride=4, select_block=16, top_n=5, init_blocks=1, local_blocks=2, window=0)
    g = torch.Generator().manual_seed(5)
    rows, kv_heads, nb = 200, 3, 12
    scores = torch.rand(rows, kv_heads, nb, generator=g)
    pos = torch.randint(0, nb * 16, (rows,), generator=g)
    cur = pos // 16
    # make the forced blocks the least attractive and the blocks after the query the most
    j = torch.arange(nb)
    scores = torch.where((j == 0) | (j >= cur[:, None, None] - 1), -1.0 + 0 * scores, scores)
    scores = torch.where(j > cur[:, None, None], 100.0, scores)
    idx = select_blocks(scores, pos, cfg)
    for r in range(rows):
        c = int(cur[r])
        for h in range(kv_heads):
            got = [b for b in idx[r, h].tolist() if b >= 0]
            assert len(got) == len(set(got)) == min(5, c + 1)
            assert max(got) <= c
            assert 0 in got and c in got and (c == 0 or c - 1 in got)
            # the free picks are the best-scored remaining blocks
            free = sorted((b for b in range(1, max(1, c - 1))), key=lambda b: -float(scores[r, h, b]))
            assert sorted(set(got) - {0, c, c - 1}) == sorted(free[: len(got) - len({0, c, max(c - 1, 0)})])


def test_gqa_group_shares_one_selection():
    # head 0 of the group looks for block 1's keys, head 1 for block 3's; one free pick per group
    cfg = NSAConfig(compress_block=8, compress_stride=4, select_block=16, top_n=3, init_blocks=1, local_blocks=1,
                    window=0, compress_fn="mean")
    seq, dim = 80, 16
    q, k, v = _inputs(seq, 2, 1, dim, seed=6)
    k[16:32] += 4.0 * torch.nn.functional.normalize(torch.ones(dim), dim=0)
    k[48:64] -= 4.0 * torch.nn.functional.normalize(torch.ones(dim), dim=0)
    q[:, 0] = 3.0 * torch.nn.functional.normalize(torch.ones(dim), dim=0)
    q[:, 1] = -2.0 * torch.nn.functional.normalize(torch.ones(dim), dim=0)
    ck, cv = compress(k, None, cfg), compress(v, None, cfg)
    pos = torch.arange(seq)
    o, idx = nsa_attend(q, k, v, ck, cv, _gates(seq, 2, 1), pos, cfg, 1.0)
    assert idx.shape == (seq, 1, 3)
    t = 79
    # alone, each head would pick its own block; the group picks one set for both
    alone = []
    for h in range(2):
        o1, i1 = nsa_attend(q[:, h : h + 1], k, v, ck, cv, _gates(seq, 1, 1), pos, cfg, 1.0)
        alone.append(set(i1[t, 0].tolist()))
    assert alone[0] != alone[1]
    shared = set(idx[t, 0].tolist())
    assert shared in alone
    keys = sorted(x for x in range(t + 1) if x // 16 in shared)
    for h in range(2):
        assert (o[t, h].double() - _row_attention(q[t, h], k[:, 0], v[:, 0], keys, 1.0)).abs().max() <= 1e-5


def test_eq9_weights_for_paper_defaults():
    cfg = NSAConfig()  # l=32, d=16, l'=64
    w = eq9_matrix(40, 10, cfg)
    for j in range(1, 9):
        col = w[:, j]
        nz = col.nonzero().flatten().tolist()
        assert nz == list(range(4 * j - 1, 4 * j + 4))
        assert col[nz].tolist() == [1.0, 2.0, 2.0, 2.0, 1.0]
    # through selection_scores: one compressed entry's mass reaches the blocks it overlaps
    p = torch.zeros(1, 2, 40)
    p[0, :, 4 * 3 + 3] = 0.5  # entry 15 covers keys 240..271: half block 3, half block 4
    s = selection_scores(p, 2, 10, cfg)
    assert s[0, 0].nonzero().flatten().tolist() == [3, 4] and torch.allclose(s[0, 0, 3:5], torch.tensor([1.0, 1.0]))


def test_compression_linear_and_mean():
    cfg = NSAConfig(compress_block=8, compress_stride=4, select_block=16, top_n=4, window=8)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(29, 2, 4, generator=g)
    w = torch.randn(2, 8 * 4, 4, generator=g)
    c = compress(x, w, cfg)
    assert c.shape == (6, 2, 4)  # entries 0..5 end at 7, 11, ..., 27 < 29
    for i in range(6):
        for h in range(2):
            want = sum(x[i * 4 + j, h] @ w[h, j * 4 : (j + 1) * 4] for j in range(8))
            assert torch.allclose(c[i, h], want, atol=1e-5)
    m = compress(x, None, _mean(cfg))
    assert torch.allclose(m[2], x[8:16].mean(0), atol=1e-6)
    assert compress(x[:7], w, cfg).shape == (0, 2, 4)


def test_gradients_flow_through_every_input():
    cfg = SMALL
    seq, heads, kv_heads = 40, 4, 2
    q, k, v = _inputs(seq, heads, kv_heads, seed=8)
    w = torch.randn(kv_heads, 8 * 16, 16) * 0.05
    for t in (q, k, v, w):
        t.requires_grad_(True)
    gates = torch.rand(seq, heads, 3).requires_grad_(True)
    o, _ = nsa_attend(q, k, v, compress(k, w, cfg), compress(v, w, cfg), gates, torch.arange(seq), cfg, 0.25)
    o.square().sum().backward()
    for t in (q, k, v, w, gates):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "fields,name",
    [
        (dict(compress_block=32, select_block=48), "select_block"),  # l does not divide l'
        (dict(compress_block=32, compress_stride=12), "compress_stride"),
        (dict(compress_block=16, compress_stride=32, select_block=64), "compress_stride"),
        (dict(window=-1), "window"),
        (dict(top_n=2, init_blocks=1, local_blocks=2), "top_n"),
        (dict(top_n=0), "top_n"),
        (dict(init_blocks=-1), "init_blocks"),
        (dict(compress_fn="mlp3"), "compress_fn"),
        (dict(select_block=2.5), "select_block"),
    ],
)
def test_bad_config_names_the_field(fields, name):
    with pytest.raises(ValueError, match=rf"nsa\.{name}\b"):
        NSAConfig(**fields)


def test_top_n_larger_than_the_blocks_of_any_context():
    with pytest.raises(ValueError, match=r"nsa\.top_n"):
        NSAConfig(top_n=16, select_block=64).check_context(512)  # 8 blocks at most
    NSAConfig(top_n=8, select_block=64).check_context(512)
