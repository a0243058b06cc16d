"""The dense oracle for squid: one transformers forward over the whole layout with the squid mask
and positions (a 4-D additive mask and explicit position ids), and greedy decoding on top of it."""
from __future__ import annotations

import torch


def layout_rows(prefix: list[int], docs: list[list[int]], query: list[int], convention: str) -> tuple[list[int], list[int], list[int]]:
    """Flat tokens, their positions, and their group: -1 prefix, i for document i, -2 query."""
    p = len(prefix)
    tokens, pos, group = list(prefix), list(range(p)), [-1] * p
    at = p
    for i, d in enumerate(docs):
        start = p if convention == "shared" else at
        tokens += d
        pos += list(range(start, start + len(d)))
        group += [i] * len(d)
        at += len(d)
    qstart = (p + max((len(d) for d in docs), default=0)) if convention == "shared" else at
    tokens += query
    pos += list(range(qstart, qstart + len(query)))
    group += [-2] * len(query)
    return tokens, pos, group


def squid_mask(group: list[int]) -> torch.Tensor:
    """[S, S] bool: causal, and a document row sees only the prefix and its own document."""
    g = torch.tensor(group)
    S = len(group)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    key_ok = (g[None, :] == -1) | (g[None, :] == g[:, None]) | (g[:, None] == -2)
    return causal & key_ok


@torch.no_grad()
def dense_logits(model, tokens: list[int], pos: list[int], group: list[int]) -> torch.Tensor:
    mask = squid_mask(group)
    add = torch.zeros(1, 1, *mask.shape)
    add[0, 0][~mask] = float("-inf")
    out = model(torch.tensor([tokens]), attention_mask=add, position_ids=torch.tensor([pos]))
    return out.logits[0].float()


def dense_greedy(model, prefix, docs, query, convention: str, new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation of the query under the squid layout; returns tokens and the log-softmax
    row each was chosen from."""
    tokens, pos, group = layout_rows(prefix, docs, query, convention)
    out, rows = [], []
    for _ in range(new_tokens):
        lp = dense_logits(model, tokens, pos, group)[-1].log_softmax(-1)
        t = int(lp.argmax())
        out.append(t)
        rows.append(lp)
        tokens.append(t)
        pos.append(pos[-1] + 1)
        group.append(-2)
    return out, rows
