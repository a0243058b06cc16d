"""The default model's recipe trains squid layouts exactly as the engine serves them: its rows'
positions and attention mask equal the dense oracle's (`squid_oracle.layout_rows` / `squid_mask`,
the `shared` convention), its `forward_masked` equals `forward_packed` on packed files and
transformers under the squid mask, a few steps on a tiny config learn, and the shipped model says
`squid_positions: shared`."""
from __future__ import annotations


import pytest
import torch

from cuttle.engine import train_default_model as recipe
from cuttle.engine.config import ModelConfig
from cuttle.engine.models.transformer import CausalLM
from helpers import make_checkpoint
from squid_oracle import dense_logits, layout_rows, squid_mask

SEQ = 512


def _package() -> dict[tuple[str, str], str]:
    """(module, package) -> text: a package whose modules define names the others use."""
    shapes = "".join(f"def area_{i}(w, h):\n    return w * h + {i}\n\n\nclass Box{i}:\n    size = {i}\n\n" for i in range(40))
    draw = "from .shapes import area_3, Box7\nfrom . import shapes\n\n" + "".join(
        f"def paint_{i}(canvas):\n    total = shapes.area_{i}(canvas.w, canvas.h)\n    return Box{i % 40}(total)\n\n"
        for i in range(60))
    util = "import os\nimport pkg.draw\n\n" + "".join(f"def helper_{i}(x):\n    return pkg.draw.paint_{i}(x) + {i}\n\n" for i in range(60))
    return {("pkg.shapes", "pkg"): shapes, ("pkg.draw", "pkg"): draw, ("pkg", "pkg"): util}


@pytest.fixture(scope="module")
def corpus():
    texts = _package()
    tok = recipe.train_tokenizer(list(texts.values()), 300)
    sources = {m: recipe.make_source(m, p, t, tok) for (m, p), t in texts.items()}
    return tok, sources


def _tiny(vocab: int) -> CausalLM:
    hf = {**recipe.MODEL_CONFIG, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "intermediate_size": 64, "moe_intermediate_size": 32, "num_experts": 4, "vocab_size": vocab,
          "eos_token_id": 0, "bos_token_id": None}
    model = CausalLM(ModelConfig.from_hf(hf), torch.float32, torch.device("cpu"))
    recipe.init_weights(model, 0)
    return model


def test_source_index(corpus):
    _, src = corpus
    assert src["pkg.draw"].imports[:4] == ["pkg.shapes", "pkg.shapes.area_3", "pkg.shapes.Box7", "pkg"]
    assert "pkg.shapes" in src["pkg"].imports or "pkg.draw" in src["pkg"].imports
    s = src["pkg.shapes"]
    # a definition points at the token holding the start of its line
    t = s.defs["Box7"][0]
    assert "class Box7" in s.text[s.starts[t]: s.starts[t] + 20]


def test_squid_rows_equal_the_oracle_layout(corpus):
    """Every example's row: tokens and positions equal `layout_rows(..., "shared")`, the mask over
    them equals `squid_mask`, padding is seen by no real token, and the targets are exactly the
    next tokens inside the prefix, each document and the query."""
    _, src = corpus
    examples = recipe.squid_examples(list(src.values()), src, 24, SEQ, seed=3)
    assert examples == recipe.squid_examples(list(src.values()), src, 24, SEQ, seed=3)  # seeded
    assert any(p for p, _, _ in examples) and any(not p for p, _, _ in examples)
    assert max(len(d) for _, d, _ in examples) >= 3
    for prefix, docs, query in examples:
        ids, pos, grp = recipe.squid_row(prefix, docs, query, SEQ)
        tokens, opos, group = layout_rows(prefix, docs, query, "shared")
        n = len(tokens)
        assert SEQ - 32 <= n <= SEQ  # the documents fill the row
        assert ids[:n] == tokens and pos[:n] == opos
        mask = recipe.layout_mask(torch.tensor(grp))
        assert torch.equal(mask[:n, :n], squid_mask(group))
        assert not mask[:n, n:].any()
        n_targets = sum(len(x) - 1 for x in [prefix, *docs, query] if x)
        assert int(recipe.target_mask(torch.tensor([grp])).sum()) == n_targets
        # the query is a chunk of some file and no document holds it
        assert any(query == s.ids[i: i + len(query)] for s in src.values() for i in range(len(s.ids) - len(query) + 1))
        q = tuple(query[:16])
        assert not any(q == tuple(d[i: i + 16]) for d in docs for i in range(len(d) - 15))


def test_eval_rows_score_the_same_targets(corpus):
    _, src = corpus
    ex = recipe.squid_examples(list(src.values()), src, 4, SEQ, seed=5)
    rows = recipe.squid_eval_rows(ex, SEQ)
    for i, (prefix, docs, query) in enumerate(ex):
        got = {c: r[0][i][1:][r[3][i]].tolist() for c, r in rows.items()}  # the tokens each condition predicts
        assert got["squid"] == got["causal"] == got["alone"] == query[1:]
        flat = prefix + [t for d in docs for t in d] + query
        assert rows["causal"][0][i][: len(flat)].tolist() == flat and rows["causal"][1][i][: len(flat)].tolist() == list(range(len(flat)))
        assert rows["alone"][0][i][: len(prefix) + len(query)].tolist() == prefix + query


def test_forward_masked_equals_forward_packed():
    model = _tiny(300)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (50, 7, 130, 64, 200, 90)]
    ids, pos, grp = recipe.pack(docs, 256)
    S = ids.shape[1]
    block_causal = (grp[:, :, None] == grp[:, None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
    assert torch.equal(recipe.layout_mask(grp), block_causal)
    with torch.no_grad():
        assert torch.equal(model.forward_masked(ids, pos, recipe.layout_mask(grp)), model.forward_packed(ids, pos, grp))


def test_forward_masked_equals_transformers_under_the_squid_mask(tmp_path):
    """What the recipe trains is what the dense oracle computes (and test_squid.py shows the engine
    serves exactly that): a tiny Qwen3-MoE, a layout with a prefix and three documents."""
    from cuttle.engine.models import load_model

    hf = make_checkpoint(str(tmp_path), "qwen3_moe", seed=4)
    model = load_model(str(tmp_path), ModelConfig.from_pretrained(str(tmp_path)), torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    prefix, docs, query = [5, 6, 7], [torch.randint(3, 250, (n,), generator=g).tolist() for n in (20, 9, 33)], [40, 41, 42, 43, 44]
    ids, pos, grp = (torch.tensor([x]) for x in recipe.squid_row(prefix, docs, query, 96))
    tokens, opos, group = layout_rows(prefix, docs, query, "shared")
    n = len(tokens)
    with torch.no_grad():
        ours = model.compute_logits(model.forward_masked(ids, pos, recipe.layout_mask(grp))[0, :n])
    ref = dense_logits(hf, tokens, opos, group)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_a_few_steps_learn_and_are_deterministic(corpus):
    """Packed files and squid rows in one batch; two runs from one seed give the same losses."""
    tok, src = corpus
    seq = 320
    packed = recipe.pack([s.ids + [0] for s in src.values()], seq)
    squid = recipe.squid_rows(recipe.squid_examples(list(src.values()), src, 4, seq, seed=0), seq)
    rows = tuple(torch.cat([a, b]) for a, b in zip(packed, squid))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest, and immune to a busy machine
    try:
        runs = [recipe.train(_tiny(tok.get_vocab_size()), rows, steps=8, batch=4, lr=1e-2, seed=0, autocast=False, progress=False)
                for _ in range(2)]
    finally:
        torch.set_num_threads(threads)
    assert runs[0] == runs[1]
    losses = runs[0]
    assert sum(losses[-2:]) / 2 < losses[0] - 1.0, losses
