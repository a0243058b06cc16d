"""NSA (natively sparse attention, arXiv 2502.11089): its configuration and the naive torch
reference of its three branches, the oracle every NSA kernel is tested against and the math the
training path differentiates through.

Owns: `NSAConfig` (l, d, l', n with the forced initial and local blocks, w, the compression
function phi) and its validation; phi itself (`compress`, `compress_windows`); the score
transform of Eq. 9 (`eq9_matrix`, `selection_scores`); block selection (`select_blocks`); and one
sequence's gated three-branch attention (`nsa_attend`; `nsa_branches`, `nsa_attend_parts` and
`nsa_attend_segments` for rows over several parts). Everything here is per sequence, dense and
plain torch (masks over all keys), so it is obviously right rather than fast; it never touches
the paged cache (`nsa_backend.py` does) and imports nothing from the engine.

Conventions (0-based token indices; a query at index t sees keys 0..t):
- compressed entry i summarises keys i*d .. i*d + l - 1 and is visible to t iff i*d + l - 1 <= t,
  so a query at t sees nc(t) = max(0, (t + 1 - l) // d + 1) entries (the paper's Eq. 7);
- selection block j holds keys j*l' .. (j+1)*l' - 1; t may select blocks 0 .. t // l' only, and
  inside its own block only keys <= t count;
- the window is the last w keys: t - w + 1 .. t (w = 0: an empty branch);
- a branch with no key contributes 0 (its softmax is empty, not NaN).

Parts (squid documents, docs/nsa.md "Squid documents under NSA"): a row whose keys are several
segments (a prefix, documents, its own tokens) applies every rule above to each segment on its own
keys, indexed from the segment's first key (a segment the row sees whole: as if the row sat at its
last key), and each branch is the log-sum-exp merge of the parts' branches (`nsa_branches`,
`nsa_attend_parts`); then the gates.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cuttle.attention.dense_segments import segment_parts
from cuttle.attention.merge import merge_lse_rows

COMPRESS_FNS = ("linear", "mean")


@dataclass(frozen=True, slots=True)
class NSAConfig:
    """The three branches' shapes (defaults: the paper's Section 4.1).

    compress_fn (phi) -- "linear" (default): per KV head, a learned linear map of the l keys of a
    block, with its own D x D matrix for every intra-block position (W [kv_heads, l*D, D]): the
    paper's "learnable MLP with intra-block position encoding" reduced to one layer, as
    XunhaoLai's `linear_compress` does (its additive position embedding is dropped: before a
    linear map it only adds a constant, the per-position matrices already encode position).
    lucidrains uses a two-layer MLP over the flattened block (l*D -> l*D -> D, ~l^2 D^2 weights
    per head); fla-org uses parameter-free mean pooling with l = d = l', which is "mean" here.
    Keys and values have separate phi weights. phi reads the cached keys, i.e. after RoPE at
    their own positions (XunhaoLai compresses pre-RoPE keys and rotates the result at i*d): so a
    compressed entry is a function of the raw paged cache alone, and the engine can build it as
    tokens arrive without keeping pre-RoPE keys.
    """

    compress_block: int = 32  # l
    compress_stride: int = 16  # d
    select_block: int = 64  # l'
    top_n: int = 16  # n, the forced initial and local blocks included
    init_blocks: int = 1  # always-selected blocks at the start
    local_blocks: int = 2  # always-selected blocks ending at the query's own block
    window: int = 512  # w
    compress_fn: str = "linear"

    def __post_init__(self) -> None:
        def bad(name: str, value: object, why: str) -> ValueError:
            return ValueError(f"nsa.{name} = {value!r}: {why}")

        for name in ("compress_block", "compress_stride", "select_block", "top_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, value, "must be an integer >= 1")
        for name in ("init_blocks", "local_blocks", "window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise bad(name, value, "must be an integer >= 0")
        l, d, lp = self.compress_block, self.compress_stride, self.select_block
        if d > l:
            raise bad("compress_stride", d, f"must be <= compress_block ({l}), or tokens between blocks are never compressed")
        if l % d:
            raise bad("compress_stride", d, f"must divide compress_block ({l}) (Eq. 9 needs d | l)")
        if lp % l:
            raise bad("select_block", lp, f"must be a multiple of compress_block ({l}) (Eq. 9 needs l | l' here)")
        if self.init_blocks + self.local_blocks > self.top_n:
            raise bad("top_n", self.top_n, f"must be >= init_blocks + local_blocks ({self.init_blocks} + {self.local_blocks})")
        if self.compress_fn not in COMPRESS_FNS:
            raise bad("compress_fn", self.compress_fn, f"must be one of {', '.join(COMPRESS_FNS)}")

    def check_context(self, max_positions: int) -> None:
        """Refuse a top-n that no context of this model can fill (more blocks than it ever has)."""
        blocks = -(-max_positions // self.select_block)
        if self.top_n > blocks:
            raise ValueError(
                f"nsa.top_n = {self.top_n}: larger than the number of selection blocks ({blocks}) in "
                f"max_position_embeddings = {max_positions} with select_block = {self.select_block}"
            )

    def num_compressed(self, num_keys: int) -> int:
        """Compressed entries complete in a prefix of `num_keys` keys: nc(num_keys - 1)."""
        l, d = self.compress_block, self.compress_stride
        return (num_keys - l) // d + 1 if num_keys >= l else 0


def compress_windows(windows: torch.Tensor, weight: torch.Tensor | None, cfg: NSAConfig) -> torch.Tensor:
    """phi over E blocks of l keys: windows [E, Hkv, l, D] -> [E, Hkv, D] in windows' dtype.
    `weight` [Hkv, l*D, D] for "linear", None for "mean"."""
    if cfg.compress_fn == "mean":
        return windows.mean(2)
    assert weight is not None, "phi 'linear' needs its weight"
    e, h, l, dim = windows.shape
    # [Hkv, E, l*D] @ [Hkv, l*D, D]: one batched matmul over the KV heads
    return torch.bmm(windows.permute(1, 0, 2, 3).reshape(h, e, l * dim), weight.to(windows.dtype)).transpose(0, 1)


def compress(x: torch.Tensor, weight: torch.Tensor | None, cfg: NSAConfig) -> torch.Tensor:
    """Every compressed entry of one sequence's keys (or values) x [S, Hkv, D]: [nc(S-1), Hkv, D]."""
    n = cfg.num_compressed(x.shape[0])
    if n == 0:
        return x.new_zeros(0, *x.shape[1:])
    windows = x.unfold(0, cfg.compress_block, cfg.compress_stride)[:n]  # [n, Hkv, D, l]
    return compress_windows(windows.permute(0, 1, 3, 2), weight, cfg)


def eq9_matrix(num_compressed: int, num_blocks: int, cfg: NSAConfig) -> torch.Tensor:
    """W [num_compressed, num_blocks] fp32 with p_slc = p_cmp @ W (Eq. 9, 0-based):
    p_slc[j] = sum_{m < l'/d} sum_{n < l/d} p_cmp[(l'/d) j + m - n]. W[i, j] counts the stride-d
    units that compressed block i shares with selection block j (1, 2, 2, 2, 1 for 32/16/64)."""
    d = cfg.compress_stride
    per_block, per_entry = cfg.select_block // d, cfg.compress_block // d
    w = torch.zeros(num_compressed, num_blocks)
    for j in range(num_blocks):
        for m in range(per_block):
            for n in range(per_entry):
                i = per_block * j + m - n
                if 0 <= i < num_compressed:
                    w[i, j] += 1.0
    return w


def selection_scores(p_cmp: torch.Tensor, group: int, num_blocks: int, cfg: NSAConfig) -> torch.Tensor:
    """Block importance from the compression branch's probabilities p_cmp [M, H, Nc]: Eq. 9, then
    summed over the `group` query heads of each KV head (Eq. 10) -> [M, Hkv, num_blocks] fp32."""
    m, h, nc = p_cmp.shape
    per_kv = p_cmp.float().reshape(m, h // group, group, nc).sum(2)
    return per_kv @ eq9_matrix(nc, num_blocks, cfg).to(per_kv.device)


def select_blocks(scores: torch.Tensor, q_pos: torch.Tensor, cfg: NSAConfig) -> torch.Tensor:
    """Top-n blocks per (query row, KV head) from scores [M, Hkv, Nb]: the first `init_blocks` and
    the `local_blocks` ending at the query's block are forced; the rest go by score, ties to the
    lower block; never a block after the query's. Returns [M, Hkv, top_n] int64 in rank order,
    padded with -1 when fewer blocks exist."""
    nb = scores.shape[-1]
    j = torch.arange(nb, device=scores.device)
    cur = (q_pos // cfg.select_block)[:, None, None]
    valid = j <= cur
    forced = valid & ((j < cfg.init_blocks) | (j > cur - cfg.local_blocks))
    key = torch.where(forced, float("inf"), scores.float()).masked_fill(~valid, float("-inf"))
    n = min(cfg.top_n, nb)
    # a stable descending sort keeps the lower index first among equal scores
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :n]
    picked = torch.where(torch.gather(key, -1, order) == float("-inf"), -1, order)
    if n < cfg.top_n:
        pad = picked.new_full((*picked.shape[:-1], cfg.top_n - n), -1)
        picked = torch.cat([picked, pad], dim=-1)
    return picked


def _attend_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [M, H, D] against k, v [L, Hkv, D] where mask [M, Hkv, L] allows: (o [M, H, D], lse [M, H]
    of the scaled scores; -inf where a row has no key, whose o is 0). Computed in q's dtype (fp32
    in the tests and the oracle); differentiable."""
    m, h, dim = q.shape
    hkv = k.shape[1]
    g = h // hkv
    qg = q.reshape(m, hkv, g, dim)
    s = torch.einsum("mhgd,lhd->mhgl", qg, k.to(q.dtype)) * scale
    p, lse = _softmax_masked(s, mask[:, :, None, :])
    return torch.einsum("mhgl,lhd->mhgd", p, v.to(q.dtype)).reshape(m, h, dim), lse.reshape(m, h)


def _softmax_masked(s: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of s over its last dim where mask allows, and its log-sum-exp (-inf, with all-zero
    probabilities, where nothing is allowed)."""
    if s.shape[-1] == 0:  # no key at all (a sequence shorter than one compressed block)
        return s, s.new_full(s.shape[:-1], float("-inf"))
    s = s.masked_fill(~mask, float("-inf"))
    mx = s.amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx)).detach()
    e = torch.exp(s - mx)
    den = e.sum(-1, keepdim=True)
    # fp32 whatever s is (bf16 under autocast), as the engine's kernels keep it: a log-sum-exp
    # weights the merge over squid parts, and rounding it to bf16 adds up to half a bf16 step
    # (0.06 nats at 16..32) to what the bf16 scores already carry
    denf = den.float()
    lse = torch.where(denf > 0, mx.float() + torch.log(torch.where(denf > 0, denf, torch.ones_like(denf))), float("-inf"))
    return e / torch.where(den > 0, den, torch.ones_like(den)), lse.squeeze(-1)


def compressed_probs(q: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor, cfg: NSAConfig, scale: float) -> torch.Tensor:
    """The compression branch's attention probabilities p_cmp [M, H, Nc] of query rows q [M, H, D]
    at indices q_pos over compressed keys ck [Nc, Hkv, D] (entries a row cannot see, and every
    entry of a row that sees none, get 0). Also the input of the selection scores."""
    return _compressed_softmax(q, ck, q_pos, cfg, scale)[0]


def _compressed_softmax(q: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor, cfg: NSAConfig,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    group = q.shape[1] // ck.shape[1]
    t = q_pos.to(q.device)[:, None]
    nc_vis = torch.clamp(torch.div(t + 1 - cfg.compress_block, cfg.compress_stride, rounding_mode="floor") + 1, min=0)
    cmask = torch.arange(ck.shape[0], device=q.device)[None, :] < nc_vis  # [M, Nc]
    s = torch.einsum("mhd,nhd->mhn", q, ck.to(q.dtype).repeat_interleave(group, 1)) * scale
    return _softmax_masked(s, cmask[:, None, :])


def nsa_branches(
    q: torch.Tensor,  # [M, H, D] query rows of one sequence (or one squid part), RoPE applied
    k: torch.Tensor,  # [L, Hkv, D] its keys 0 .. L-1 (L > every q_pos)
    v: torch.Tensor,
    ck: torch.Tensor,  # [Nc, Hkv, D] compressed keys (Nc >= nc(max q_pos)); extra entries are masked
    cv: torch.Tensor,
    q_pos: torch.Tensor,  # [M] int64 index of each query row among the keys
    cfg: NSAConfig,
    scale: float,
    block_indices: torch.Tensor | None = None,  # [M, Hkv, n] override the selection (-1 = padding)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three branches apart, before the gates: o [M, H, 3, D] (compressed, selected, window;
    softmax-normalised, 0 for a branch with no key) in q's dtype, their log-sum-exps lse [M, H, 3]
    (-inf for a branch with no key), and the selected blocks [M, Hkv, top_n] (-1 padded; given
    ones are returned as they came). A row's branch over several key sets (squid parts) is these
    results merged by the log-sum-exp (`nsa_attend_parts`)."""
    m, h, _ = q.shape
    num_keys, hkv = k.shape[0], k.shape[1]
    group = h // hkv
    lp = cfg.select_block
    t = q_pos.to(q.device)[:, None]
    # compression branch
    p_cmp, lse_cmp = _compressed_softmax(q, ck, q_pos, cfg, scale)
    o_cmp = torch.einsum("mhn,nhd->mhd", p_cmp, cv.to(q.dtype).repeat_interleave(group, 1))
    # selection branch: Eq. 9 + 10 scores, top-n, then attention over the chosen blocks' keys
    num_blocks = -(-num_keys // lp)
    if block_indices is None:
        block_indices = select_blocks(selection_scores(p_cmp.detach(), group, num_blocks, cfg), q_pos, cfg)
    chosen = torch.zeros(m, hkv, num_blocks + 1, dtype=torch.bool, device=q.device)
    chosen.scatter_(2, torch.where(block_indices < 0, num_blocks, block_indices).clamp(max=num_blocks), True)
    key = torch.arange(num_keys, device=q.device)
    causal = key[None, :] <= t  # [M, L]
    smask = chosen[:, :, key // lp] & causal[:, None, :]
    o_slc, lse_slc = _attend_masked(q, k, v, smask, scale)
    # sliding window
    wmask = (causal & (key[None, :] > t - cfg.window))[:, None, :].expand(m, hkv, num_keys)
    o_win, lse_win = _attend_masked(q, k, v, wmask, scale)
    lse = torch.stack([lse_cmp.reshape(m, h), lse_slc, lse_win], dim=-1)
    return torch.stack([o_cmp, o_slc, o_win], dim=2), lse, block_indices


def gate_branches(o: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Eq. 5: the branches o [M, H, 3, D] weighted by the gates [M, H, 3] -> [M, H, D] in o's dtype."""
    g = gates.to(o.dtype)
    return g[..., 0:1] * o[:, :, 0] + g[..., 1:2] * o[:, :, 1] + g[..., 2:3] * o[:, :, 2]


def nsa_attend(
    q: torch.Tensor,  # [M, H, D] query rows of one sequence, RoPE applied
    k: torch.Tensor,  # [L, Hkv, D] the sequence's keys 0 .. L-1 (L > every q_pos)
    v: torch.Tensor,
    ck: torch.Tensor,  # [Nc, Hkv, D] compressed keys (Nc >= nc(max q_pos)); extra entries are masked
    cv: torch.Tensor,
    gates: torch.Tensor,  # [M, H, 3] in [0, 1]: (compressed, selected, window)
    q_pos: torch.Tensor,  # [M] int64 index of each query row in the sequence
    cfg: NSAConfig,
    scale: float,
    block_indices: torch.Tensor | None = None,  # [M, Hkv, n] override the selection (-1 = padding)
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's NSA output (Eq. 5): o [M, H, D] in q's dtype, and the selected blocks
    [M, Hkv, top_n] (-1 padded; given ones are returned as they came)."""
    o, _, block_indices = nsa_branches(q, k, v, ck, cv, q_pos, cfg, scale, block_indices)
    return gate_branches(o, gates), block_indices


def nsa_attend_parts(
    o: torch.Tensor,  # [N, H, 3, D] the parts' branches (`nsa_branches`), one row per (query row, part)
    lse: torch.Tensor,  # [N, H, 3]
    rows: torch.Tensor,  # [N] int64: the query row each belongs to
    gates: torch.Tensor,  # [M, H, 3]
) -> torch.Tensor:
    """Rows whose keys are several parts (squid: a prefix, documents, their own tokens), each part
    attended by the rule on its own keys (`nsa_branches`): every branch merged over the row's parts
    by the log-sum-exp, then gated. o [M, H, D] fp32 (a row with no part gets 0); differentiable."""
    n, h, _, dim = o.shape
    merged, _ = merge_lse_rows(o.reshape(n, h * 3, dim), lse.reshape(n, h * 3), rows, gates.shape[0])
    return gate_branches(merged.view(gates.shape[0], h, 3, dim), gates.float())


def nsa_attend_segments(
    q: torch.Tensor,  # [S, H, D] one row's queries, RoPE applied
    k: torch.Tensor,  # [S, Hkv, D]
    v: torch.Tensor,
    gates: torch.Tensor,  # [S, H, 3]
    mask: torch.Tensor,  # [S, S] bool: True where token i attends to token j
    segment_ids: torch.Tensor,  # [S] int64: the segment of each token
    compress_kv,  # (k, v) [n, Hkv, D] of one segment -> its compressed (ck, cv)
    cfg: NSAConfig,
    scale: float,
    shifts: torch.Tensor | None = None,  # [S] int64: how far each token's segment sits from where it was encoded
    unshift=None,  # (x [n, H, D], shift) -> x rotated by -shift (RoPE); needed where a shift is not 0
) -> torch.Tensor:
    """One row made of segments (squid's dense row: a prefix, documents, prefix copies, the query;
    packed documents), each segment a part of its own (the convention above): o [S, H, D] in q's
    dtype; differentiable. The mask must show each token, of each segment, nothing, all of it, or
    (its own segment) exactly its keys up to itself; anything else is refused (a ValueError), since
    NSA's rules are defined per whole segment.

    A segment with a shift (squid's `concat`: a document placed `shift` positions after where it
    was encoded, its keys rotated at the placed positions in this row) is attended in its encoded
    frame, as the engine attends its cached copy: its keys and every query row reading it rotated
    by -shift. Attention scores do not change (RoPE depends on differences), but the compressed
    entries do when phi is learned ("linear"): they are what the engine cached, phi of the keys
    where the document was encoded."""
    outs, lses, rows_of = [], [], []  # per segment, only the rows that read it
    for part in segment_parts(q, k, v, mask, segment_ids, shifts, unshift):
        ck, cv = compress_kv(part.k, part.v)
        o, lse, _ = nsa_branches(part.q, part.k, part.v, ck, cv, part.pos, cfg, scale)
        outs.append(o)
        lses.append(lse)
        rows_of.append(part.rows)
    return nsa_attend_parts(torch.cat(outs), torch.cat(lses), torch.cat(rows_of), gates).to(q.dtype)
