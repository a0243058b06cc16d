"""Training-free top-k block-sparse attention for ordinary (dense-trained) checkpoints: its
configuration, the per-block key summaries it selects by, and the naive torch reference of one
sequence's attention under it, the oracle the paged backend (`topk_backend.py`) and the native
decode kernel (`csrc/topk_decode.c`) are tested against, and the rule the training path
(`CausalLM.forward_masked(sparse=...)`) computes.

Owns `TopKConfig` (the engine option `sparse_attention`, parsed from a spec string or dict and
validated with errors naming the field), the summaries (`summarize`: Quest's element-wise min/max
of a block's keys, or their mean), block scores, the selection rule and `topk_attend` (and
`topk_attend_segments`, a row of squid segments each under the rule on its own keys). Plain
dense torch, per sequence; never touches the paged cache and imports nothing from the engine.

The rule (0-based indices; a query at t sees keys 0..t; blocks of P = `block` keys, block j holds
keys j*P .. j*P + P - 1; n = budget // P blocks are attended):
- block j is *complete* for t when j*P + P - 1 <= t; only complete blocks have a summary;
- if t // P + 1 <= n every block is attended (plain causal attention);
- otherwise the first `init_blocks` blocks and the `local_blocks` ending at t's own (partial or
  complete) block are always attended, and the rest of the n go to the complete blocks with the
  best score, ties to the lower block;
- score of block j for a KV head: per query head r of its GQA group, s_r[j] = scale * bound(q_r, j)
  with bound = sum_i max(q_i m_i, q_i M_i) (Quest: an upper bound of q.k over the block, from the
  block's min m and max M) or q . mean(k) ("mean"), softmax over the complete blocks, summed over
  the group (NSA's Eq. 10: one selection per KV head, no head's scale dominating);
- attention: softmax over the keys of the chosen blocks (only keys <= t), returning o and the
  log-sum-exp, so a sparse layer is still a backend `(o, lse)`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from cuttle.attention.dense_segments import segment_parts
from cuttle.attention.merge import merge_lse_rows

SUMMARIES = ("quest", "mean")
METHODS = ("topk",)


@dataclass(frozen=True, slots=True)
class TopKConfig:
    """Training-free top-k attention (`sparse_attention="topk:budget=2048,block=64,..."`).

    Defaults follow Quest (arXiv 2406.10774: min/max page summaries, a 2048-token budget at 32k, the
    first two layers dense) with NSA's forced sink and local blocks (1 initial, 2 local)."""

    budget: int = 2048  # keys attended per query row: (budget // block) blocks, forced ones included
    block: int = 64  # keys per block (one summary each)
    dense_layers: int = 2  # the first layers stay dense (Quest: their attention is not sparse)
    summary: str = "mean"  # "mean" (mean-pooled keys) | "quest" (min/max bound): mean recalled better (docs/nsa.md)
    init_blocks: int = 1  # always-attended blocks at the start (the attention sink)
    local_blocks: int = 2  # always-attended blocks ending at the query's own block (>= 1: it sees itself)

    def __post_init__(self) -> None:
        def bad(name: str, value: object, why: str) -> ValueError:
            return ValueError(f"sparse_attention.{name} = {value!r}: {why}")

        for name in ("budget", "block", "local_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, value, "must be an integer >= 1")
        for name in ("dense_layers", "init_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise bad(name, value, "must be an integer >= 0")
        if self.block & (self.block - 1):
            raise bad("block", self.block, "must be a power of two (blocks tile the engine's KV blocks)")
        if self.budget % self.block:
            raise bad("budget", self.budget, f"must be a multiple of block ({self.block})")
        if self.init_blocks + self.local_blocks > self.num_blocks:
            raise bad("budget", self.budget, f"holds {self.num_blocks} blocks of {self.block}, fewer than init_blocks + "
                      f"local_blocks ({self.init_blocks} + {self.local_blocks})")
        if self.summary not in SUMMARIES:
            raise bad("summary", self.summary, f"must be one of {', '.join(SUMMARIES)}")

    @property
    def num_blocks(self) -> int:
        """n: blocks attended per query row."""
        return self.budget // self.block

    @property
    def summary_rows(self) -> int:
        """Vectors per block summary: Quest's min and max, or the mean."""
        return 2 if self.summary == "quest" else 1

    def spec(self) -> str:
        return "topk:" + ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


def parse_sparse_attention(spec: str | dict[str, Any] | TopKConfig | None) -> TopKConfig | None:
    """The engine option: None (dense), a TopKConfig, a string "topk" or "topk:budget=2048,block=64,
    dense_layers=2,summary=quest" (the CLI's form), or a dict {"method": "topk", "budget": 2048, ...}.
    Unknown methods and fields, and bad values, raise ValueError naming them."""
    if spec is None or isinstance(spec, TopKConfig):
        return spec
    known = tuple(f.name for f in fields(TopKConfig))
    if isinstance(spec, str):
        method, _, rest = spec.strip().partition(":")
        raw: dict[str, Any] = {}
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq:
                raise ValueError(f"sparse_attention: {item!r} is not key=value (e.g. 'topk:budget=2048,block=64')")
            if key in raw:
                raise ValueError(f"sparse_attention.{key} given twice")
            raw[key] = value.strip() if key == "summary" else _int(key, value.strip())
    elif isinstance(spec, dict):
        raw = dict(spec)
        method = raw.pop("method", "topk")
    else:
        raise ValueError(f"sparse_attention must be None, a spec string like 'topk:budget=2048' or a dict, got {spec!r}")
    if method not in METHODS:
        raise ValueError(f"sparse_attention.method = {method!r}: must be one of {', '.join(METHODS)}")
    for key in raw:
        if key not in known:
            raise ValueError(f"sparse_attention.{key} is not a field of topk (known: {', '.join(known)})")
    return TopKConfig(**raw)


def _int(key: str, value: str) -> int | str:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"sparse_attention.{key} = {value!r}: must be an integer") from None


def summarize(windows: torch.Tensor, cfg: TopKConfig) -> torch.Tensor:
    """Summaries of E blocks of keys, windows [E, Hkv, P, D] -> [E, R, Hkv, D] in windows' dtype
    (R = 2: min then max; R = 1: mean, computed in fp32)."""
    if cfg.summary == "quest":
        return torch.stack([windows.amin(2), windows.amax(2)], dim=1)
    return windows.float().mean(2).to(windows.dtype)[:, None]


def summarize_sequence(k: torch.Tensor, cfg: TopKConfig) -> torch.Tensor:
    """Summaries of every complete block of one sequence's keys k [S, Hkv, D]: [S // P, R, Hkv, D]."""
    n = k.shape[0] // cfg.block
    windows = k[: n * cfg.block].reshape(n, cfg.block, *k.shape[1:]).transpose(1, 2)  # [n, Hkv, P, D]
    return summarize(windows, cfg)


def block_scores(q: torch.Tensor, summ: torch.Tensor, cfg: TopKConfig, scale: float) -> torch.Tensor:
    """Per query head, scale * bound(q, block) for every summarised block: q [M, H, D], summ
    [Nb, R, Hkv, D] -> [M, H, Nb] fp32. Quest's sum_i max(q_i m_i, q_i M_i) is q+ . M + q- . m."""
    m, h, _ = q.shape
    group = h // summ.shape[2]
    s = summ.float().repeat_interleave(group, 2)  # [Nb, R, H, D]
    qf = q.float()
    if cfg.summary == "quest":
        out = torch.einsum("mhd,nhd->mhn", qf.clamp(min=0), s[:, 1]) + torch.einsum("mhd,nhd->mhn", qf.clamp(max=0), s[:, 0])
    else:
        out = torch.einsum("mhd,nhd->mhn", qf, s[:, 0])
    return out * scale


def select_blocks(scores: torch.Tensor, q_pos: torch.Tensor, cfg: TopKConfig, group: int) -> torch.Tensor:
    """The attended blocks as a mask [M, Hkv, Nb_all] (Nb_all = t_max // P + 1 for the largest
    q_pos) from per-head block scores [M, H, Nb] (Nb summarised blocks), by the module's rule."""
    m, h, nb = scores.shape
    P = cfg.block
    cur = q_pos // P  # [M] the query's own block
    nball = int(cur.max()) + 1
    j = torch.arange(nball, device=scores.device)
    complete = j[None, :] < ((q_pos + 1) // P)[:, None]  # [M, Nb_all]
    valid = j[None, :] <= cur[:, None]
    nb = min(nb, nball)  # blocks past every row's own are never candidates
    sc = scores.float().new_full((m, h, nball), float("-inf"))
    sc[:, :, :nb] = scores[..., :nb].float()
    sc = sc.masked_fill(~complete[:, None, :], float("-inf"))
    mx = sc.amax(-1, keepdim=True)
    e = torch.exp(sc - torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx)))
    den = e.sum(-1, keepdim=True)
    p = e / torch.where(den > 0, den, torch.ones_like(den))
    ps = p.reshape(m, h // group, group, nball).sum(2)  # [M, Hkv, Nb_all]
    forced = valid & ((j[None, :] < cfg.init_blocks) | (j[None, :] > (cur - cfg.local_blocks)[:, None]))
    key = torch.where(forced[:, None, :], float("inf"), ps)
    key = key.masked_fill(~(complete | forced)[:, None, :], float("-inf"))
    n = min(cfg.num_blocks, nball)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :n]
    chosen = torch.zeros(m, h // group, nball + 1, dtype=torch.bool, device=scores.device)
    picked = torch.where(torch.gather(key, -1, order) == float("-inf"), nball, order)
    chosen.scatter_(2, picked, True)
    return chosen[..., :nball]


def topk_attend(
    q: torch.Tensor,  # [M, H, D] query rows of one sequence, RoPE applied
    k: torch.Tensor,  # [L, Hkv, D] the sequence's keys 0 .. L-1 (L > every q_pos)
    v: torch.Tensor,
    q_pos: torch.Tensor,  # [M] int64 index of each query row in the sequence
    cfg: TopKConfig,
    scale: float,
    summ: torch.Tensor | None = None,  # [>= L // P, R, Hkv, D] the blocks' summaries; None: from k
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's top-k attention: o [M, H, D] in q's dtype and lse [M, H] fp32. Computed in
    q's dtype (fp32 in the tests and the oracle); differentiable in q, k, v (not through the choice)."""
    m, h, dim = q.shape
    num_keys, hkv = k.shape[0], k.shape[1]
    group = h // hkv
    P = cfg.block
    if summ is None:
        summ = summarize_sequence(k.detach(), cfg)
    nfull = num_keys // P
    chosen = select_blocks(block_scores(q.detach(), summ[:nfull], cfg, scale), q_pos, cfg, group)  # [M, Hkv, Nb]
    key = torch.arange(num_keys, device=q.device)
    t = q_pos.to(q.device)[:, None]
    blk = (key // P).clamp(max=chosen.shape[-1] - 1)
    mask = chosen[:, :, blk] & (key[None, :] <= t)[:, None, :]  # [M, Hkv, L]
    qg = q.reshape(m, hkv, group, dim)
    s = torch.einsum("mhgd,lhd->mhgl", qg, k.to(q.dtype)) * scale
    s = s.masked_fill(~mask[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(s.float(), dim=-1)  # every row sees at least its own key
    p = torch.exp(s - lse[..., None].to(s.dtype))
    o = torch.einsum("mhgl,lhd->mhgd", p, v.to(q.dtype)).reshape(m, h, dim)
    return o, lse.reshape(m, h)


def topk_attend_chunked(q, k, v, q_pos, cfg: TopKConfig, scale: float, summ=None, rows: int = 256):
    """`topk_attend` over row chunks (bounded memory for long prompts: scores are [rows, H, L])."""
    if summ is None:
        summ = summarize_sequence(k.detach(), cfg)
    outs, lses = [], []
    for i in range(0, q.shape[0], rows):
        o, l = topk_attend(q[i : i + rows], k, v, q_pos[i : i + rows], cfg, scale, summ)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def topk_attend_segments(
    q: torch.Tensor,  # [S, H, D] one row's queries, RoPE applied
    k: torch.Tensor,  # [S, Hkv, D]
    v: torch.Tensor,
    mask: torch.Tensor,  # [S, S] bool
    segment_ids: torch.Tensor,  # [S] int64
    cfg: TopKConfig,
    scale: float,
    shifts: torch.Tensor | None = None,
    unshift=None,
) -> torch.Tensor:
    """One row made of segments (squid's dense row, packed documents), each segment attended by
    the rule on its own keys in its encoded frame (`dense_segments.segment_parts`: a segment seen
    whole is read by rows at its last key), merged per row by the log-sum-exp: what the engine's
    top-k backend computes for squid documents. o [S, H, D] in q's dtype; differentiable in q, k, v."""
    outs, lses, rows_of = [], [], []
    for part in segment_parts(q, k, v, mask, segment_ids, shifts, unshift):
        o, lse = topk_attend_chunked(part.q, part.k, part.v, part.pos, cfg, scale)
        outs.append(o)
        lses.append(lse)
        rows_of.append(part.rows)
    o, _ = merge_lse_rows(torch.cat(outs), torch.cat(lses), torch.cat(rows_of), q.shape[0])
    return o.to(q.dtype)
