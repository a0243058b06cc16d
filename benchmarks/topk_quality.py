"""Training-free top-k attention (`sparse_attention="topk:..."`): how well the block summaries find
the blocks attention actually uses, and what the sparsity costs in model quality.

1. Recall, Quest's min/max bound vs mean-pooled keys, on the embedded model (engine/default_model)
   over long stdlib files and on a tiny random Qwen3: for query positions past the budget, in every
   sparse layer and KV head, the true top-n blocks by exact attention mass (summed over the GQA
   group) against the n the rule selects; also the share of the exact attention mass the selected
   blocks hold.
2. Quality gap vs dense on the embedded model, teacher-forced over the same files (one full forward
   of the torch reference with and without the rule: the engine computes exactly these logits, as
   tests/engine/test_sparse_engine.py asserts): greedy agreement (argmax equal) and mean
   |delta logprob| of the next token at positions past the budget.
3. Retrieval: a name defined in a file (after `--lead` tokens of other code, so that neither the
   forced initial block nor the window holds it) and used again `--gap` tokens later; the
   log-probability and top-1 accuracy of the name's remaining tokens at the use, dense vs top-k,
   and for every `--compare` model too (an NSA model scored with its own attention, a dense one
   dense and under top-k): e.g. the default model, its dense control and the NSA variant of the
   recipe (docs/nsa.md).

4. Over squid documents: a query over a prefix and documents (docs/squid.md), every part attended
   under its own budget (docs/nsa.md, "Squid documents under top-k"), teacher-forced over the
   query's tokens, against dense attention over the same layout; beside it the same tokens as one
   causal sequence, dense and under one budget. The documents are a package's modules (json's
   decoder, encoder and scanner, cut to `--doc-tokens`), the query its `__init__.py`.

    .venv/bin/python benchmarks/topk_quality.py [--tokens 3072] [--files 6] [--budgets 256,512,1024]
    .venv/bin/python benchmarks/topk_quality.py --only documents --budgets 128,256,512
    .venv/bin/python benchmarks/topk_quality.py --only retrieval --lead 128 --gap 320 --budgets 128,256 \
        --compare /tmp/dense_ctrl /tmp/nsa_model
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import sysconfig

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, markdown_table  # noqa: E402

from cuttle.attention.topk import TopKConfig, block_scores, select_blocks, summarize_sequence  # noqa: E402
from cuttle.engine.config import ModelConfig  # noqa: E402
from cuttle.engine.models.loader import load_model  # noqa: E402
from cuttle.engine.models.transformer import Attention  # noqa: E402
from cuttle.engine.squid import SquidLayout  # noqa: E402
from cuttle.engine.tokenizer import Tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(ROOT, "engine", "default_model")
STDLIB_FILES = ["argparse.py", "typing.py", "inspect.py", "subprocess.py", "tarfile.py", "pathlib.py", "dataclasses.py",
                "enum.py", "logging/__init__.py", "ast.py"]


def stdlib_ids(tok: Tokenizer, n_tokens: int, files: int) -> list[list[int]]:
    lib = sysconfig.get_paths()["stdlib"]
    out = []
    for name in STDLIB_FILES:
        path = os.path.join(lib, name)
        if not os.path.isfile(path):
            continue
        ids = tok.encode(open(path).read(), add_special_tokens=False)
        if len(ids) >= n_tokens:
            out.append(ids[:n_tokens])
        if len(out) == files:
            break
    return out


def capture_qk(model, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's RoPE'd q [S, H, D] and k [S, Hkv, D] of one dense causal forward."""
    got: list[tuple[torch.Tensor, torch.Tensor]] = []
    originals = []
    for layer in model.layers:
        attn = layer.attn
        assert type(attn) is Attention
        orig = attn._qkv_dense

        def hook(x, cos, sin, orig=orig):
            q, k, v = orig(x, cos, sin)
            got.append((q[0].detach(), k[0].detach()))
            return q, k, v

        attn._qkv_dense = hook
        originals.append((attn, orig))
    try:
        forward(model, ids, None)
    finally:
        for attn, orig in originals:
            attn._qkv_dense = orig
    return got


def forward(model, ids: list[int], sparse: TopKConfig | None) -> torch.Tensor:
    """log-probabilities [S, vocab] of one causal forward of the torch reference."""
    t = torch.tensor([ids])
    mask = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()[None]
    with torch.no_grad():
        return model.compute_logits(model.forward_masked(t, torch.arange(len(ids))[None], mask, sparse=sparse)[0]).log_softmax(-1)


def recall(qk, cfg: TopKConfig, scale: float, positions: torch.Tensor) -> tuple[float, float]:
    """(mean recall of the true top-n blocks, mean share of exact attention mass selected) over the
    sparse layers, KV heads and query positions."""
    P, n = cfg.block, cfg.num_blocks
    rec, mass = [], []
    for q, k in qk[cfg.dense_layers :]:
        qs = q[positions]
        hkv, group = k.shape[1], q.shape[1] // k.shape[1]
        s = torch.einsum("mhd,lhd->mhl", qs.float(), k.float().repeat_interleave(group, 1)) * scale
        s = s.masked_fill(torch.arange(k.shape[0])[None, None, :] > positions[:, None, None], float("-inf"))
        p = s.softmax(-1)  # [M, H, L]
        nb = int(positions.max()) // P + 1
        pad = nb * P - k.shape[0]
        if pad > 0:
            p = torch.nn.functional.pad(p, (0, pad))
        bm = p[..., : nb * P].reshape(len(positions), hkv, group, nb, P).sum((2, 4)) / group  # [M, Hkv, nb]
        chosen = select_blocks(block_scores(qs, summarize_sequence(k, cfg), cfg, scale), positions, cfg, group)[..., :nb]
        true = torch.zeros_like(chosen)
        true.scatter_(2, bm.topk(n, dim=-1).indices, True)
        rec.append(((chosen & true).sum(-1).float() / n).mean().item())
        mass.append((bm * chosen).sum(-1).mean().item())
    return sum(rec) / len(rec), sum(mass) / len(mass)


def retrieval_prompts(tok: Tokenizer, filler: list[list[int]], gap: int, count: int, lead: int = 0) -> list[tuple[list[int], int]]:
    """(ids, first index of the name's tokens at the use) for `count` made-up names: `lead` tokens
    of code, the definition, `gap` tokens of other code, then the use."""
    rng = random.Random(0)
    words = ["frobnicate", "quaternion", "marmalade", "zeppelin", "halibut", "turmeric", "gondola", "sprocket", "walrus",
             "mandolin", "obsidian", "pumpernickel"]
    out = []
    for i in range(count):
        name = f"{rng.choice(words)}_{rng.choice(words)}_{rng.randrange(10, 99)}"
        head = tok.encode(f"def {name}(value, limit=None):\n    \"\"\"Return value clipped to limit.\"\"\"\n    return value\n\n\n",
                          add_special_tokens=False)
        body = filler[i % len(filler)][:gap]
        before = filler[(i + 1) % len(filler)][-lead:] if lead else []
        use = tok.encode(f"\n\n\nresult = {name}(", add_special_tokens=False)
        pre = tok.encode("\n\n\nresult =", add_special_tokens=False)  # the space goes with the name's first token
        assert use[: len(pre)] == pre, (use, pre)
        out.append((before + head + body + use, len(before) + len(head) + len(body) + len(pre)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=3072)
    ap.add_argument("--files", type=int, default=6)
    ap.add_argument("--budgets", default="256,512,1024")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--dense-layers", type=int, default=1)
    ap.add_argument("--gap", type=int, default=2500, help="tokens between a name's definition and its use")
    ap.add_argument("--lead", type=int, default=0, help="tokens of code before a name's definition (retrieval)")
    ap.add_argument("--names", type=int, default=8, help="made-up names in the retrieval check")
    ap.add_argument("--compare", nargs="*", default=[], metavar="DIR",
                    help="more models (same tokenizer) in the retrieval table: NSA ones with their own attention")
    ap.add_argument("--only", choices=["recall", "gap", "retrieval", "documents"], default=None, help="run one part")
    ap.add_argument("--doc-tokens", type=int, default=768, help="tokens of each document (documents part)")
    ap.add_argument("--query-tokens", type=int, default=512, help="tokens of the query (documents part)")
    args = ap.parse_args()
    torch.manual_seed(0)
    mc = ModelConfig.from_pretrained(args.model)
    model = load_model(args.model, mc, torch.float32, torch.device("cpu")).eval()
    tok = Tokenizer(args.model)
    texts = stdlib_ids(tok, args.tokens, args.files)
    scale = mc.head_dim**-0.5
    budgets = [int(b) for b in args.budgets.split(",")]
    print(f"machine: {machine_info()}\nmodel: {args.model} ({mc.num_layers} layers, {mc.num_heads} q / {mc.num_kv_heads} kv heads, "
          f"head_dim {mc.head_dim}); {len(texts)} stdlib files x {args.tokens} tokens; block {args.block}, "
          f"{args.dense_layers} dense layer(s)\n")

    if args.only in (None, "recall"):
        recall_table(model, texts, budgets, args, scale)
    if args.only in (None, "gap"):
        gap_table(model, texts, budgets, args)
    if args.only in (None, "retrieval"):
        models = {args.model: model}
        for d in args.compare:
            models[d] = load_model(d, ModelConfig.from_pretrained(d), torch.float32, torch.device("cpu")).eval()
        retrieval_table(models, tok, texts, budgets, args)
    if args.only in (None, "documents"):
        documents_table(model, mc, tok, budgets, args)


def recall_table(model, texts, budgets, args, scale) -> None:
    """1. recall, quest vs mean, on the embedded model and on a tiny random Qwen3"""
    qks = [capture_qk(model, ids) for ids in texts]
    rows = []
    for budget in budgets:
        positions = torch.arange(budget + args.block, args.tokens, 7)
        for summary in ("quest", "mean"):
            cfg = TopKConfig(budget=budget, block=args.block, dense_layers=args.dense_layers, summary=summary)
            r = [recall(qk, cfg, scale, positions) for qk in qks]
            rows.append(["embedded", budget, summary, f"{sum(x for x, _ in r) / len(r):.3f}", f"{sum(m for _, m in r) / len(r):.3f}"])
    rand = random_model_qk(args.tokens)
    for budget in budgets:
        positions = torch.arange(budget + args.block, args.tokens, 7)
        for summary in ("quest", "mean"):
            cfg = TopKConfig(budget=budget, block=args.block, dense_layers=args.dense_layers, summary=summary)
            x, m = recall(rand, cfg, 16**-0.5, positions)
            rows.append(["tiny random", budget, summary, f"{x:.3f}", f"{m:.3f}"])
    print("### Recall of the true top-n blocks\n")
    print(markdown_table(["model", "budget", "summary", "recall", "attention mass selected"], rows))



def gap_table(model, texts, budgets, args) -> None:
    """2. quality gap vs dense, teacher-forced"""
    dense = [forward(model, ids, None) for ids in texts]
    rows = []
    for budget in budgets:
        for summary in ("quest", "mean"):
            cfg = TopKConfig(budget=budget, block=args.block, dense_layers=args.dense_layers, summary=summary)
            agree, dlp, n = 0, 0.0, 0
            for ids, lp_d in zip(texts, dense):
                lp_s = forward(model, ids, cfg)
                at = slice(budget, len(ids) - 1)
                nxt = torch.tensor(ids[budget + 1 :])
                agree += int((lp_s[at].argmax(-1) == lp_d[at].argmax(-1)).sum())
                dlp += float((lp_s[at].gather(1, nxt[:, None]) - lp_d[at].gather(1, nxt[:, None])).abs().sum())
                n += len(nxt)
            rows.append([budget, summary, f"{agree / n:.4f}", f"{dlp / n:.4f}", n])
    print("\n### Quality gap vs dense (teacher-forced, positions past the budget)\n")
    print(markdown_table(["budget", "summary", "greedy agreement", "mean |d logprob| (next token)", "positions"], rows))



def documents_table(model, mc: ModelConfig, tok: Tokenizer, budgets, args) -> None:
    """4. top-k over squid documents vs dense over the same layout, teacher-forced over the query"""
    lib = sysconfig.get_paths()["stdlib"]

    def ids(name: str, n: int) -> list[int]:
        with open(os.path.join(lib, name)) as f:
            return tok.encode(f.read(), add_special_tokens=False)[:n]

    prefix = tok.encode("# the json package\n", add_special_tokens=False)
    docs = [ids(f"json/{m}.py", args.doc_tokens) for m in ("decoder", "encoder", "scanner")]
    query = ids("json/__init__.py", args.query_tokens)
    convention = mc.hf_config.get("squid_positions") or "concat"
    layout = SquidLayout(prefix, docs, convention)
    tokens = torch.tensor([layout.dense_context() + query])
    mask, pos = layout.dense_mask_and_positions(len(query))
    seg, shift = layout.dense_segments(len(query))
    flat = torch.tensor([layout.flat_tokens(query)])
    causal = torch.ones(flat.shape[1], flat.shape[1], dtype=torch.bool).tril()[None]
    at_docs = slice(tokens.shape[1] - len(query), tokens.shape[1] - 1)  # the query's positions, each predicting the next
    at_flat = slice(flat.shape[1] - len(query), flat.shape[1] - 1)
    nxt = torch.tensor(query[1:])[:, None]

    def run(sparse: TopKConfig | None, over_docs: bool) -> torch.Tensor:
        with torch.no_grad():
            if over_docs:
                h = model.forward_masked(tokens, pos[None], mask[None], sparse=sparse, segments=seg[None], segment_shifts=shift[None])
                return model.compute_logits(h[0][at_docs]).log_softmax(-1)
            h = model.forward_masked(flat, torch.arange(flat.shape[1])[None], causal, sparse=sparse)
            return model.compute_logits(h[0][at_flat]).log_softmax(-1)

    dense = {True: run(None, True), False: run(None, False)}
    rows = [[name, "dense", "1.0000", "0.0000", f"{float(dense[d].gather(1, nxt).mean()):.4f}"]
            for d, name in ((True, "query over documents"), (False, "one causal sequence"))]
    for budget in budgets:
        cfg = TopKConfig(budget=budget, block=args.block, dense_layers=args.dense_layers, summary="quest")
        for d, name in ((True, "query over documents"), (False, "one causal sequence")):
            lp = run(cfg, d)
            agree = float((lp.argmax(-1) == dense[d].argmax(-1)).float().mean())
            dlp = float((lp.gather(1, nxt) - dense[d].gather(1, nxt)).abs().mean())
            rows.append([name, f"top-k {budget}", f"{agree:.4f}", f"{dlp:.4f}", f"{float(lp.gather(1, nxt).mean()):.4f}"])
    print(f"\n### Over squid documents ({convention} positions; prefix {len(prefix)}, documents "
          f"{[len(d) for d in docs]}, query {len(query)} tokens; quest summaries)\n")
    print(markdown_table(["layout", "attention", "greedy agreement vs its dense", "mean |d logprob| (next token)",
                          "mean next-token logprob"], rows))


def retrieval_table(models: dict, tok, texts, budgets, args) -> None:
    """3. retrieval of a name defined early, for each model: its own attention, and top-k for a dense one"""
    prompts = retrieval_prompts(tok, texts, args.gap, args.names, args.lead)
    rows = []
    for path, model in models.items():
        own = "nsa" if model.nsa is not None else "dense"
        configs: list[tuple[str, TopKConfig | None]] = [(own, None)]
        if model.nsa is None:
            configs += [(f"topk {s} {b}", TopKConfig(budget=b, block=args.block, dense_layers=args.dense_layers, summary=s))
                        for b in budgets for s in ("quest", "mean")]
        for label, cfg in configs:
            lps, hits, n = 0.0, 0, 0
            for ids, at in prompts:
                lp = forward(model, ids, cfg)
                for i in range(at + 1, len(ids)):  # the name's tokens after its first (and the "(")
                    lps += lp[i - 1, ids[i]].item()
                    hits += int(lp[i - 1].argmax().item() == ids[i])
                    n += 1
            rows.append([os.path.relpath(path, ROOT) if path.startswith(ROOT) else path, label, f"{lps / n:.3f}",
                         f"{hits / n:.3f}", n])
    length = max(len(ids) for ids, _ in prompts)
    print(f"\n### Retrieval: a name defined after {args.lead} tokens, used {args.gap} tokens later ({args.names} names, "
          f"prompts of {length} tokens)\n")
    print(markdown_table(["model", "attention", "mean logprob of the name's later tokens", "top-1 accuracy", "tokens"], rows))


def random_model_qk(n_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """q/k of a tiny random Qwen3 (2 layers, 4 q / 2 kv heads, head_dim 16) with peaked attention."""
    from cuttle.engine.models.transformer import CausalLM

    hf = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0}
    torch.manual_seed(3)
    model = CausalLM(ModelConfig.from_hf(hf), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.normal_(0, 0.15)
        for layer in model.layers:
            layer.attn.q_norm.weight.fill_(2.0)
            layer.attn.k_norm.weight.fill_(2.0)
    rng = random.Random(1)
    ids = [rng.randrange(3, 256) for _ in range(n_tokens)]
    return capture_qk(model.eval(), ids)


if __name__ == "__main__":
    main()
