"""Recipe for the embedded default model: a tiny Qwen3-MoE coding model trained on the Python
standard library's own source, with its own byte-level BPE tokenizer.

    python -m cuttle.engine.train_default_model            # writes engine/default_model/

Deterministic for its seed on a given Python installation (the stdlib is the corpus). Most rows
pack files with document masking: a token never attends across a file boundary and positions
restart at each file, so per-file KV caching is exact for this model. The other rows each hold
one squid layout (engine/squid.py, `shared` convention): documents side by side, each attending to
the prefix and itself from the position after the prefix, and a query from another part of a
file that attends to all of them, so squid document caching is exact for this model too, and it
learns to use the documents. Training uses the engine's own model code (`CausalLM.forward_masked`),
so the engine serves exactly what was trained. Progress and validation loss are shown as it runs;
the model card records the held-out loss, the squid query-loss table against the model it replaces,
and the exact command.

    python -m cuttle.engine.train_default_model --attention nsa --init engine/default_model --out DIR

trains the same coder with NSA layers (`NSA_CONFIG`, sized for this model's contexts) on plain
causal rows by default, one file piece a row, starting from the dense weights (`nsa_from_dense`);
`--attention dense --rows causal` is its dense control, continued the same way. With `--rows
packed` NSA trains on packed files and squid rows too, each file, document, prefix and query a
segment of its own (`token_nll`), as the engine attends documents. See docs/nsa.md for the run
and its results.
"""
from __future__ import annotations

import argparse
import bisect
import builtins
import json
import keyword
import math
import os
import random
import re
import sysconfig
import time
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm.auto import tqdm

from cuttle.engine.config import ModelConfig
from cuttle.engine.models.loader import hf_state_dict
from cuttle.engine.models.transformer import CausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Newlines are emitted as expressions ({{- '\n' }}) so the rendering does not depend on the
# renderer's trim_blocks / lstrip_blocks settings.
CHAT_TEMPLATE = (
    "{%- set nl = '\\n' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system' + nl -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + nl + nl -}}{%- endif -%}"
    "{{- '# Tools' + nl + nl + 'You may call one or more functions to assist with the user query.' + nl + nl -}}"
    "{{- 'You are provided with function signatures within <tools></tools> XML tags:' + nl + '<tools>' -}}"
    "{%- for tool in tools -%}{{- nl + (tool | tojson) -}}{%- endfor -%}"
    "{{- nl + '</tools>' + nl + nl + 'For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:' + nl -}}"
    "{{- '<tool_call>' + nl + '{\"name\": <function-name>, \"arguments\": <args-json-object>}' + nl + '</tool_call><|im_end|>' + nl -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system' + nl + messages[0].content + '<|im_end|>' + nl -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' and loop.first -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant' + nl + (message.content or '') -}}"
    "{%- for tc in message.tool_calls or [] -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}"
    "{%- if message.content or not loop.first -%}{{- nl -}}{%- endif -%}"
    "{{- '<tool_call>' + nl + '{\"name\": \"' + f.name + '\", \"arguments\": ' -}}"
    "{{- (f.arguments if f.arguments is string else (f.arguments | tojson)) + '}' + nl + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>' + nl -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|im_start|>user' + nl + '<tool_response>' + nl + message.content + nl + '</tool_response><|im_end|>' + nl -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + nl + message.content + '<|im_end|>' + nl -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant' + nl -}}{%- endif -%}"
)

MODEL_CONFIG = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=256,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
    hidden_act="silu", attention_bias=False, router_aux_loss_coef=0.001, torch_dtype="bfloat16",
)

# NSA at this model's scale. The paper's defaults (l=32, d=16, l'=64, n=16, w=512) cover 1536
# keys per query, so at the 512-1024-token contexts this model trains on they would select every
# block and the window would see everything: dense attention with extra steps. Scaled down by 4
# in blocks and 8 in window, a query at 1024 reads 126 compressed entries + 6 x 32 selected keys
# + a 64-key window (at most 382 of 1024 keys), and selection drops blocks from 256 tokens on.
NSA_CONFIG = dict(compress_block=16, compress_stride=8, select_block=32, top_n=6, init_blocks=1, local_blocks=2,
                  window=64, compress_fn="linear")


_TOOLS = [
    ("get_weather", "Get the current weather in a city", {"city": "string"},
     ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Austin", "Hanoi", "Berlin"],
     "What is the weather in {city}?", lambda a: f"{a['city']}: {['sunny', 'rainy', 'cloudy', 'windy'][len(a['city']) % 4]}, {10 + len(a['city']) * 3} C",
     "It is {result} right now."),
    ("add", "Add two integers", {"a": "integer", "b": "integer"}, None,
     "What is {a} plus {b}?", lambda a: str(a["a"] + a["b"]), "The sum is {result}."),
    ("read_file", "Read a file of the repository", {"path": "string"},
     ["setup.py", "README.md", "src/app.py", "tests/test_app.py", "utils/io.py"],
     "Show me {path}.", lambda a: f"# {a['path']}\nimport os\n", "Here is {path}:\n{result}"),
    ("run_tests", "Run the test suite (pytest) on a selection", {"selection": "string"},
     ["tests", "tests/test_app.py", "tests/test_io.py::test_read"],
     "Run the tests in {selection}.", lambda a: "3 passed, 0 failed", "The tests in {selection}: {result}."),
]


def synthetic_tool_chats(n: int, seed: int) -> list[str]:
    """ChatML conversations with a tool round trip (call, response, answer), rendered with the
    model's own chat template, so the model learns the exact format the server parses."""
    import random

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **_: json.dumps(x)
    tmpl = env.from_string(CHAT_TEMPLATE)
    rng = random.Random(seed)
    schemas = [
        {"type": "function", "function": {"name": name, "description": desc, "parameters": {
            "type": "object", "properties": {k: {"type": t} for k, t in params.items()}, "required": list(params)}}}
        for name, desc, params, *_ in _TOOLS
    ]
    out = []
    for _ in range(n):
        i = rng.randrange(len(_TOOLS))
        name, _, params, choices, question, run, answer = _TOOLS[i]
        args = {k: (rng.randrange(100) if t == "integer" else rng.choice(choices)) for k, t in params.items()}
        tools = rng.sample(schemas, k=rng.randint(1, len(schemas)))
        if schemas[i] not in tools:
            tools.append(schemas[i])
        result = run(args)
        call = {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        msgs = [{"role": "user", "content": question.format(**args)},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": result},
                {"role": "assistant", "content": answer.format(result=result, **args)}]
        if rng.random() < 0.3:
            msgs.insert(0, {"role": "system", "content": "You are a helpful coding assistant."})
        out.append(tmpl.render(messages=msgs, tools=tools, add_generation_prompt=False))
    return out


def corpus_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "__pycache__", "test", "tests", "idle_test"}
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in skip)
        out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    return out


def read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def is_heldout(path: str) -> bool:
    return zlib.crc32(os.path.basename(path).encode()) % 50 == 0  # ~2% of files, stable


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tok


# ---- rows --------------------------------------------------------------------------------------
# A row is (ids, positions, groups), each [S]. The group of a token says what it may attend to
# (`layout_mask`): files packed side by side have ids >= 0 and a token sees the earlier tokens of
# its own file; a squid row holds one example, PREFIX tokens, documents 0..k-1 and QUERY tokens;
# PAD is padding. A token is a training target when the token before it is in the same group.
PAD, PREFIX, QUERY = -1, -2, -3


def pack(docs: list[list[int]], seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of `seq_len` tokens: documents back to back, long ones split, each with its own
    positions (from 0) and document id. Returns (ids, positions, groups), each [rows, seq_len]."""
    ids, pos, doc = [], [], []
    row_ids: list[int] = []
    row_pos: list[int] = []
    row_doc: list[int] = []
    next_doc = 0
    for d in docs:
        for start in range(0, len(d), seq_len):
            piece = d[start : start + seq_len]
            if len(row_ids) + len(piece) > seq_len:
                pad = seq_len - len(row_ids)
                row_ids += [0] * pad
                row_pos += [0] * pad
                row_doc += [PAD] * pad
                ids.append(row_ids), pos.append(row_pos), doc.append(row_doc)
                row_ids, row_pos, row_doc = [], [], []
            row_ids += piece
            row_pos += list(range(len(piece)))
            row_doc += [next_doc] * len(piece)
            next_doc += 1
    return torch.tensor(ids), torch.tensor(pos), torch.tensor(doc)


def causal_rows(docs: list[list[int]], seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of `seq_len` tokens holding one document piece each (long documents split, positions
    from 0 in each piece, as `pack` does), padded at the end: under a plain causal mask a piece is
    computed exactly as if alone (the NSA recipe's default rows). The pieces and their targets are
    `pack`'s, so a dense model scores the same on both."""
    ids, pos, grp = [], [], []
    for d in docs:
        for start in range(0, len(d), seq_len):
            piece = d[start : start + seq_len]
            pad = seq_len - len(piece)
            ids.append(piece + [0] * pad)
            pos.append(list(range(seq_len)))
            grp.append([0] * len(piece) + [PAD] * pad)
    return torch.tensor(ids), torch.tensor(pos), torch.tensor(grp)


def squid_row(prefix: list[int], docs: list[list[int]], query: list[int], seq_len: int) -> tuple[list[int], list[int], list[int]]:
    """One squid layout as a row in the `shared` convention (engine/squid.py): the prefix at
    0..P-1, every document from P, the query from P + the longest document; padded to seq_len."""
    p = len(prefix)
    ids, pos, grp = list(prefix), list(range(p)), [PREFIX] * p
    for i, d in enumerate(docs):
        ids += d
        pos += range(p, p + len(d))
        grp += [i] * len(d)
    q0 = p + max(map(len, docs), default=0)
    ids += query
    pos += range(q0, q0 + len(query))
    grp += [QUERY] * len(query)
    if len(ids) > seq_len:
        raise ValueError(f"squid layout of {len(ids)} tokens does not fit a row of {seq_len}")
    pad = seq_len - len(ids)
    return ids + [0] * pad, pos + [0] * pad, grp + [PAD] * pad


def layout_mask(grp: torch.Tensor) -> torch.Tensor:
    """Groups [..., S] -> attention mask [..., S, S] (True: may attend). Causal, and a token sees
    its own group and the prefix; a query token sees everything but padding. For packed files
    this is the block-diagonal causal mask of `forward_packed`."""
    S = grp.shape[-1]
    causal = torch.ones(S, S, dtype=torch.bool, device=grp.device).tril()
    gi, gj = grp[..., :, None], grp[..., None, :]
    return causal & ((gi == gj) | (gj == PREFIX) | ((gi == QUERY) & (gj != PAD)))


def target_mask(grp: torch.Tensor) -> torch.Tensor:
    """[B, S-1]: whether token t+1 is predicted from token t (same group, not padding). A
    document's first token and the query's first token have no prediction: in a squid layout the
    token before them is another group's."""
    return (grp[:, 1:] == grp[:, :-1]) & (grp[:, 1:] != PAD)


def token_nll(model: CausalLM, ids: torch.Tensor, pos: torch.Tensor, grp: torch.Tensor) -> torch.Tensor:
    """[B, S-1] negative log-likelihood of each next token under the rows' layout. An NSA model
    attends per group (`forward_masked(segments=grp)`: each file, document, prefix and query a
    segment, as the engine attends squid documents); on `causal_rows` (one piece, padding after
    it) under the plain causal mask, the path its documented recipe was trained on."""
    if model.nsa is not None and bool(((grp == 0) | (grp == PAD)).all()):
        hidden = model.forward_masked(ids, pos, torch.ones(grp.shape[-1], grp.shape[-1], dtype=torch.bool).tril().expand(grp.shape[0], -1, -1))
    elif model.nsa is not None:
        hidden = model.forward_masked(ids, pos, layout_mask(grp), segments=grp)
    else:
        hidden = model.forward_masked(ids, pos, layout_mask(grp))
    logits = F.linear(hidden[:, :-1], model.lm_head).float()
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return nll.view(ids.shape[0], -1)


def lm_loss(model: CausalLM, ids: torch.Tensor, pos: torch.Tensor, grp: torch.Tensor) -> torch.Tensor:
    return token_nll(model, ids, pos, grp)[target_mask(grp)].mean()


@torch.no_grad()
def evaluate(model: CausalLM, data: tuple[torch.Tensor, ...], batch: int, select: torch.Tensor | None = None) -> float:
    """Mean loss (nats/token) over the rows' targets, or over `select` [rows, S-1] if given."""
    ids, pos, grp = data[:3]
    total, n = 0.0, 0
    for i in range(0, ids.shape[0], batch):
        b = slice(i, i + batch)
        sel = target_mask(grp[b]) if select is None else select[b]
        total += token_nll(model, ids[b], pos[b], grp[b])[sel].double().sum().item()
        n += int(sel.sum())
    return total / n


# ---- squid examples ----------------------------------------------------------------------------
_DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+(\w+)|^(\w+)[ \t]*(?::[^=\n]*)?=(?!=)", re.M)
_FROM = re.compile(r"^[ \t]*from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+\(?([\w \t,]*)", re.M)
_IMPORT = re.compile(r"^[ \t]*import[ \t]+([\w. \t,]+)", re.M)
_NAME = re.compile(r"[A-Za-z_]\w{2,}")
_COMMON = frozenset(keyword.kwlist) | frozenset(dir(builtins)) | {"self", "cls"}


@dataclass(slots=True)
class Source:
    """A corpus file as squid examples use it."""

    module: str  # dotted name; a package's __init__ is the package
    package: str  # what its relative imports resolve against ("" for a top-level module)
    text: str
    ids: list[int]  # its tokens (no end-of-text)
    starts: list[int]  # the character where each token starts
    header: list[int]  # "# <module>\n": the prefix of half the examples
    defs: dict[str, list[int]]  # name -> the token of each line defining it (def, class, top-level assignment)
    imports: list[str]  # the modules it imports (absolute dotted names, maybe outside the corpus)


def module_name(path: str, root: str) -> tuple[str, str]:
    """(module, package) of a file under `root`."""
    mod = os.path.relpath(path, root)[: -len(".py")].replace(os.sep, ".")
    if mod == "__init__" or mod.endswith(".__init__"):
        mod = mod[: -len("__init__")].rstrip(".")
        return mod, mod
    return mod, mod.rpartition(".")[0]


def imports_of(text: str, package: str) -> list[str]:
    out = []
    for dots, mod, names in _FROM.findall(text):
        if dots:
            base = package.split(".") if package else []
            base = base[: len(base) - (len(dots) - 1)]
            mod = ".".join(base + ([mod] if mod else []))
        if mod:
            out.append(mod)
            out += [f"{mod}.{n.split()[0]}" for n in names.split(",") if n.split()]  # submodules
    for group in _IMPORT.findall(text):
        out += [n.split()[0] for n in group.split(",") if n.split()]
    return list(dict.fromkeys(out))


def make_source(module: str, package: str, text: str, tok) -> Source:
    enc = tok.encode(text)
    starts = [s for s, _ in enc.offsets]
    defs: dict[str, list[int]] = {}
    for m in _DEF.finditer(text):
        name = m.group(1) or m.group(2)
        if not name.startswith("__"):
            defs.setdefault(name, []).append(max(0, bisect.bisect_right(starts, m.start()) - 1))
    return Source(module, package, text, enc.ids, starts, tok.encode(f"# {module}\n").ids, defs, imports_of(text, package))


def squid_example(rng: random.Random, f: Source, sources: dict[str, Source], seq_len: int,
                  ) -> tuple[list[int], list[list[int]], list[int]] | None:
    """(prefix, documents, query) from file `f`, filling a row of `seq_len` tokens, or None if f
    is too short. The query is a chunk of f (64-192 tokens). The documents, in random order: most
    often the text just before the query; windows where names the query uses are defined, in f
    (outside the query) and in the corpus modules f imports or, inside a package, its package's;
    then other windows of those files. Half the examples have a prefix naming f's module."""
    n = len(f.ids)
    q = rng.randint(64, 192)
    if n < q + 128:
        return None
    qa = rng.randint(128, n - q)
    query = f.ids[qa : qa + q]
    prefix = f.header if rng.random() < 0.5 else []
    room = seq_len - len(prefix) - q
    imported = [sources[m] for m in f.imports if m in sources and sources[m] is not f]
    package = [s for s in sources.values() if f.package and s.package == f.package and s is not f]
    related = list({id(s): s for s in [f, *imported, *package]}.values())
    end = f.starts[qa + q] if qa + q < n else len(f.text)
    names = {m for m in _NAME.findall(f.text[f.starts[qa] : end]) if m not in _COMMON and not m.startswith("__")}
    defined = [(g, t) for g in related for name in sorted(names & g.defs.keys()) for t in g.defs[name]]
    rng.shuffle(defined)
    windows: list[tuple[Source, int, int]] = []

    def take(g: Source, start: int, length: int) -> None:
        nonlocal room
        start = max(0, start)
        stop = min(len(g.ids), start + length, start + room)
        if g is f and start < qa + q and stop > qa:  # never the query itself
            if start >= qa:
                return
            stop = qa
        if stop - start < 16 or any(h is g and s < stop and start < e for h, s, e in windows):
            return
        windows.append((g, start, stop))
        room -= stop - start

    if rng.random() < 0.6:
        length = rng.randint(48, 256)
        take(f, qa - length, length)
    for g, t in defined:
        if room < 32 or len(windows) >= 8:
            break
        take(g, t - rng.randint(0, 8), rng.randint(32, 192))
    for _ in range(32):
        if room < 32 or len(windows) >= 8:
            break
        g = rng.choice(related)
        length = rng.randint(32, 192)
        take(g, rng.randrange(max(1, len(g.ids) - length)), length)
    if len(windows) < 2:
        return None
    rng.shuffle(windows)
    return prefix, [g.ids[s:e] for g, s, e in windows], query


def squid_examples(sources: list[Source], related: dict[str, Source], count: int, seq_len: int, seed: int,
                   ) -> list[tuple[list[int], list[list[int]], list[int]]]:
    """`count` examples from files drawn in proportion to their length, up to 8192 tokens (so a few
    huge data modules do not dominate), seeded."""
    rng = random.Random(seed)
    weights = [min(len(s.ids), 8192) for s in sources]
    out = []
    while len(out) < count:
        ex = squid_example(rng, rng.choices(sources, weights)[0], related, seq_len)
        if ex is not None:
            out.append(ex)
    return out


def squid_rows(examples, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = [squid_row(*ex, seq_len) for ex in examples]
    return tuple(torch.tensor([r[i] for r in rows]) for i in range(3))


SQUID_CONDITIONS = {
    "squid": "squid layout (shared positions)",
    "causal": "full causal over the concatenation",
    "alone": "query alone (no documents)",
}


def squid_eval_rows(examples, seq_len: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """Each example three ways, scored on the same targets (the query's tokens after its first):
    its squid row; prefix + documents + query as one causal text with consecutive positions; and
    prefix + query alone. Returns {condition: (ids, positions, groups, selected targets)}."""
    out: dict[str, list] = {c: [] for c in SQUID_CONDITIONS}
    for prefix, docs, query in examples:
        flat = [t for d in docs for t in d]
        for cond, (row, q0) in {
            "squid": (squid_row(prefix, docs, query, seq_len), len(prefix) + len(flat)),
            "causal": (squid_row([], [prefix + flat + query], [], seq_len), len(prefix) + len(flat)),
            "alone": (squid_row([], [prefix + query], [], seq_len), len(prefix)),
        }.items():
            sel = [q0 <= t < q0 + len(query) - 1 for t in range(seq_len - 1)]
            out[cond].append((*row, sel))
    return {c: tuple(torch.tensor([r[i] for r in rows]) for i in range(4)) for c, rows in out.items()}


def squid_table(models: dict[str, CausalLM], rows: dict[str, tuple[torch.Tensor, ...]], batch: int) -> tuple[str, dict]:
    """Held-out query loss (nats/token) of each model under each condition, as a markdown table."""
    losses = {name: {c: evaluate(m, r[:3], batch, select=r[3]) for c, r in rows.items()} for name, m in models.items()}
    lines = ["| model | " + " | ".join(SQUID_CONDITIONS.values()) + " |", "|---" * (len(SQUID_CONDITIONS) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{v[c]:.4f}" for c in SQUID_CONDITIONS) + " |" for name, v in losses.items()]
    return "\n".join(lines), losses


# ---- training ----------------------------------------------------------------------------------


def init_weights(model: CausalLM, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=g)


def nsa_from_dense(dense: CausalLM, hf: dict) -> CausalLM:
    """An NSA model (`hf` carries the `"nsa"` object) that starts near the dense one: q/k/v/o,
    norms, experts and embeddings copied; phi initialised to mean pooling (every intra-block
    position's matrix I/l), so compressed keys start as block means of the dense keys; the gates'
    map zero, so every gate is sigmoid(0) = 1/2, with o_proj scaled by 2/3 so the gated sum starts
    as the average of the three branches (each an attention over a subset of the dense keys)."""
    model = CausalLM(ModelConfig.from_hf(hf), torch.float32, torch.device("cpu"))
    result = model.load_state_dict(dense.state_dict(), strict=False)
    fresh = {n for n in result.missing_keys if not n.endswith(("attn.g_weight", "attn.ck_weight", "attn.cv_weight"))}
    if fresh or result.unexpected_keys:
        raise ValueError(f"nsa_from_dense: dense and NSA models differ beyond NSA's weights: {sorted(fresh)[:4]} "
                         f"{result.unexpected_keys[:4]}")
    with torch.no_grad():
        for layer in model.layers:
            attn = layer.attn
            attn.g_weight.zero_()
            attn.o_weight.mul_(2.0 / 3.0)
            if attn.ck_weight is not None:
                l, dim = model.nsa.compress_block, attn.head_dim
                mean = torch.eye(dim).repeat(l, 1) / l  # [l*D, D]: the mean of the block's l keys
                attn.ck_weight.copy_(mean.expand_as(attn.ck_weight))
                attn.cv_weight.copy_(mean.expand_as(attn.cv_weight))
    return model


def round_to_saved(model: CausalLM) -> None:
    """Round the weights to the bf16 values `to_hf_state_dict` saves (kept in fp32), so figures and
    tests computed afterwards are those of the saved checkpoint."""
    model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})


def to_hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """The trained parameters under HF Qwen3-MoE names (per-expert layout) in bf16: the loader's
    own name map inverted (`hf_state_dict`), so the saved file loads back into exactly this model."""
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in hf_state_dict(model).items()}


def train(model: CausalLM, rows: tuple[torch.Tensor, ...], *, steps: int, batch: int, lr: float, seed: int,
          autocast: bool = True, on_eval=None, eval_every: int = 0, progress: bool = True) -> list[float]:
    """AdamW over `batch` rows a step (seeded order, warm-up and cosine decay, bf16 autocast or
    fp32); returns the loss of each step. `on_eval()` -> float runs every `eval_every` steps and at
    the end."""
    for p in model.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    )
    order = torch.randperm(rows[0].shape[0], generator=torch.Generator().manual_seed(seed))
    bar = tqdm(range(steps), desc="train", disable=not progress, mininterval=5)
    losses, val = [], float("nan")
    for step in bar:
        idx = order[(step * batch + torch.arange(batch)) % order.numel()]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = lm_loss(model, *(t[idx] for t in rows[:3]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if on_eval is not None and ((step + 1) % eval_every == 0 or step + 1 == steps):
            val = on_eval()
        bar.set_postfix(loss=f"{losses[-1]:.3f}", val=f"{val:.3f}", lr=f"{sched.get_last_lr()[0]:.2e}")
    bar.close()
    for p in model.parameters():
        p.requires_grad_(False)
    return losses


def load_for_comparison(path: str, tok) -> CausalLM | None:
    """A saved model with this recipe's tokenizer (the one being replaced), or None."""
    from cuttle.engine.models.loader import load_model

    tok_path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(os.path.join(path, "model.safetensors")) or not os.path.isfile(tok_path):
        return None
    with open(tok_path) as f:
        if json.load(f) != json.loads(tok.to_str()):
            print(f"{path}: another tokenizer, not compared")
            return None
    return load_model(path, ModelConfig.from_pretrained(path), torch.float32, torch.device("cpu"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "default_model"))
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--tool-chats", type=int, default=3000, help="synthetic tool-use conversations mixed in")
    ap.add_argument("--squid-rows", type=int, default=None, help="rows holding one squid layout each, mixed in (default 3000)")
    ap.add_argument("--squid-eval", type=int, default=128, help="held-out squid layouts for the query-loss table")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--autocast", choices=["bf16", "off"], default="bf16",
                    help="off: fp32 throughout (where the CPU has no bf16 matrix units bf16 is far slower)")
    ap.add_argument("--init", default=None, metavar="DIR",
                    help="start from this saved model (same tokenizer) instead of random weights: continued training")
    ap.add_argument("--compare", default=None,
                    help="a saved model to compare with (default: the one in --out, before it is replaced)")
    ap.add_argument("--evaluate", nargs="+", default=None, metavar="DIR",
                    help="train nothing: print the held-out losses of these saved models")
    ap.add_argument("--attention", choices=["dense", "nsa"], default="dense",
                    help="nsa: NSA layers (NSA_CONFIG), on causal rows by default; with --init, started from the dense weights")
    ap.add_argument("--rows", choices=["packed", "causal"], default=None,
                    help="packed (dense default): files packed with document masking plus squid rows (NSA layers attend "
                         "each file, document, prefix and query as a segment of its own); causal (NSA's default): one file "
                         "piece a row, plain causal mask, no squid rows")
    args = ap.parse_args(argv)
    args.rows = args.rows or ("causal" if args.attention == "nsa" else "packed")
    if args.rows == "causal" and args.squid_rows is not None:
        ap.error("--squid-rows: causal rows hold no squid layouts (use --rows packed)")
    if args.rows == "packed":
        args.squid_rows = 3000 if args.squid_rows is None else args.squid_rows
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()

    root = sysconfig.get_paths()["stdlib"]
    files = corpus_files()
    train_files = [f for f in files if not is_heldout(f)]
    print(f"corpus: {len(files)} stdlib files ({len(files) - len(train_files)} held out) from {root}")
    texts = {f: read(f) for f in files}
    tok = train_tokenizer([texts[f] for f in train_files], args.vocab_size)
    eos = tok.token_to_id("<|endoftext|>")
    sources = {f: make_source(*module_name(f, root), texts[f], tok) for f in tqdm(files, desc="tokenize", leave=False, mininterval=5)}
    train_src = {s.module: s for f, s in sources.items() if not is_heldout(f)}
    all_src = {s.module: s for s in sources.values()}
    val_src = [s for f, s in sources.items() if is_heldout(f)]
    train_docs = [s.ids + [eos] for f, s in sources.items() if not is_heldout(f)]
    val_docs = [s.ids + [eos] for s in val_src]
    chats = [tok.encode(c).ids + [eos] for c in synthetic_tool_chats(args.tool_chats, args.seed)]
    if args.rows == "causal":
        return main_causal(args, tok, train_docs, chats, val_docs, t0)
    train_docs += chats
    # documents in a seeded random order, so rows mix code and conversations
    perm = torch.randperm(len(train_docs), generator=torch.Generator().manual_seed(args.seed)).tolist()
    train_docs = [train_docs[i] for i in perm]
    packed = pack(train_docs, args.seq_len)
    # squid layouts from training files only (their documents too); held-out ones from held-out files
    squid_train = squid_rows(squid_examples(list(train_src.values()), train_src, args.squid_rows, args.seq_len, args.seed),
                             args.seq_len)
    rows = tuple(torch.cat([a, b]) for a, b in zip(packed, squid_train))
    val = pack(val_docs, args.seq_len)
    squid_val = squid_eval_rows(squid_examples(val_src, all_src, args.squid_eval, args.seq_len, args.seed + 1), args.seq_len)
    n_squid = int((squid_train[2] != PAD).sum())
    n_query = int(squid_val["squid"][3].sum())
    print(f"tokens: train {sum(map(len, train_docs)):,} ({sum(map(len, chats)):,} in {len(chats)} tool chats) in "
          f"{packed[0].shape[0]} rows, + {n_squid:,} in {args.squid_rows} squid rows; held-out code "
          f"{sum(map(len, val_docs)):,}, held-out squid layouts {args.squid_eval} ({n_query:,} query targets)")

    if args.evaluate:
        models = {d: load_for_comparison(d, tok) for d in args.evaluate}
        for d, m in models.items():
            if m is not None:
                print(f"{d}: held-out loss {evaluate(m, val, args.batch):.4f}")
        print(squid_table({d: m for d, m in models.items() if m is not None}, squid_val, args.batch)[0])
        return
    previous = load_for_comparison(args.compare or args.out, tok)

    hf = {**MODEL_CONFIG, "vocab_size": tok.get_vocab_size(), "eos_token_id": eos, "bos_token_id": None}
    if args.init:
        model = load_for_comparison(args.init, tok)
        if model is None:
            raise SystemExit(f"--init {args.init}: no model with this recipe's tokenizer there")
    else:
        model = CausalLM(ModelConfig.from_hf(hf), torch.float32, torch.device("cpu"))
        init_weights(model, args.seed)
    t1 = time.time()
    train(model, rows, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed, autocast=args.autocast == "bf16",
          on_eval=lambda: evaluate(model, val, args.batch), eval_every=args.eval_every)
    step_s = (time.time() - t1) / args.steps
    # the figures recorded in the card are computed without autocast, on the saved bf16 weights
    model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    final = evaluate(model, val, args.batch)
    models = {"this model": model} if previous is None else {"previous model": previous, "this model": model}
    table, _ = squid_table(models, squid_val, args.batch)
    prev_loss = evaluate(previous, val, args.batch) if previous is not None else None
    minutes = (time.time() - t0) / 60
    print(f"held-out loss {final:.4f}, perplexity {math.exp(final):.2f}"
          + (f" (previous model: {prev_loss:.4f})" if prev_loss is not None else "") + f"; {minutes:.1f} min, {step_s:.2f} s/step")
    print(f"held-out query loss, {args.squid_eval} squid layouts:\n{table}")
    save(args, model, hf, tok, final, minutes, step_s, sum(map(len, train_docs)), n_squid, sum(map(len, val_docs)),
         table, n_query, prev_loss)


def main_causal(args, tok, files: list[list[int]], chats: list[list[int]], val_docs: list[list[int]], t0: float) -> None:
    """`--rows causal`: the NSA variant and its dense control. Tool chats are joined into one
    stream (they are short; one a row would be mostly padding), files stay one piece a row.
    Held-out loss on the same held-out files both ways: in 512-token pieces (the card's measure:
    the same pieces and targets as `pack`) and in --seq-len pieces (where NSA drops blocks)."""
    eos = tok.token_to_id("<|endoftext|>")
    rows = causal_rows(files + [[t for c in chats for t in c]], args.seq_len)
    vals = {n: causal_rows(val_docs, n) for n in dict.fromkeys([512, args.seq_len])}
    hf = {**MODEL_CONFIG, "vocab_size": tok.get_vocab_size(), "eos_token_id": eos, "bos_token_id": None}
    if args.attention == "nsa":
        hf["nsa"] = dict(NSA_CONFIG)
    print(f"causal rows: {rows[0].shape[0]} of {args.seq_len} tokens ({int((rows[2] != PAD).sum()):,} tokens, "
          f"{len(chats)} chats in one stream); attention {args.attention}" + (f" {hf['nsa']}" if "nsa" in hf else ""))

    def held_out(m: CausalLM) -> dict[int, float]:
        return {n: evaluate(m, v, args.batch) for n, v in vals.items()}

    if args.evaluate:
        for d in args.evaluate:
            m = load_for_comparison(d, tok)
            if m is not None:
                print(f"{d}: held-out loss " + ", ".join(f"{v:.4f} ({n}-token pieces)" for n, v in held_out(m).items()))
                if args.attention == "nsa" and m.nsa is None:  # where --attention nsa --init d starts
                    print(f"{d} as NSA at init: held-out loss "
                          + ", ".join(f"{v:.4f} ({n}-token pieces)" for n, v in held_out(nsa_from_dense(m, hf)).items()))
        return
    start = load_for_comparison(args.init, tok) if args.init else None
    if args.init and start is None:
        raise SystemExit(f"--init {args.init}: no model with this recipe's tokenizer there")
    if start is None:
        model = CausalLM(ModelConfig.from_hf(hf), torch.float32, torch.device("cpu"))
        init_weights(model, args.seed)
    elif args.attention == "nsa" and start.nsa is None:
        model = nsa_from_dense(start, hf)
    else:
        model = start
    # the start's figures (and the NSA model's as initialised from a dense one) come from
    # `--evaluate DIR` with the same flags: not paid for again by every training run
    t1 = time.time()
    train(model, rows, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed, autocast=args.autocast == "bf16",
          on_eval=(lambda: evaluate(model, vals[args.seq_len], args.batch)) if args.eval_every < args.steps else None,
          eval_every=args.eval_every)  # the final figures are computed below, on the saved weights
    step_s = (time.time() - t1) / args.steps
    round_to_saved(model)
    final = held_out(model)
    minutes = (time.time() - t0) / 60
    print("held-out loss " + ", ".join(f"{v:.4f} ({n}-token pieces)" for n, v in final.items())
          + f"; {minutes:.1f} min, {step_s:.2f} s/step")
    save_causal(args, model, hf, tok, final, minutes, step_s, int((rows[2] != PAD).sum()), rows[0].shape[0],
                sum(map(len, val_docs)))


def save_causal(args, model, hf, tok, final, minutes, step_s, n_train, n_rows, n_val) -> None:
    """Weights, config (with its `"nsa"` object for the NSA variant), tokenizer and a short card."""
    os.makedirs(args.out, exist_ok=True)
    save_file(to_hf_state_dict(model), os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": hf["eos_token_id"], "do_sample": True, "temperature": 0.7, "top_p": 0.95}, f, indent=2)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>",
                   "model_max_length": hf["max_position_embeddings"], "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)
    skip = {"out", "compare", "evaluate"}
    cmd = "python -m cuttle.engine.train_default_model " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in skip and v is not None)
    losses = lambda x: ", ".join(f"{v:.4f} ({n}-token pieces)" for n, v in x.items())  # noqa: E731
    kind = f"NSA layers `{json.dumps(hf['nsa'])}`" if "nsa" in hf else "dense attention"
    start = f"continued from `{args.init}`" if args.init else "from random weights"
    card = f"""# cuttle-tiny-coder ({args.attention}, causal rows)

The embedded default model's architecture with {kind}, {start}: {args.steps} AdamW steps of
{args.batch} rows of {args.seq_len} tokens ({n_rows} rows, {n_train:,} tokens: one stdlib file piece a row, the
{args.tool_chats} tool chats joined into one stream), lr {args.lr} with warm-up and cosine decay,
{'bf16 autocast' if args.autocast == 'bf16' else 'fp32'}, seed {args.seed}; {minutes:.1f} minutes on a shared 2-core CPU
({torch.get_num_threads()} thread(s), {step_s:.2f} s/step).

- Held-out loss (nats/token, the default model's held-out files, {n_val:,} tokens, saved bf16 weights): **{losses(final)}**.
- Before training: `--evaluate {args.init or 'DIR'}` with the same flags prints the start's figures (and, for
  `--attention nsa`, those of the NSA model as `nsa_from_dense` initialises it).
- Exact command: `{cmd}`
"""
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(card)


def save(args, model, hf, tok, val_loss, minutes, step_s, n_train, n_squid, n_val, table, n_query, prev_loss) -> None:
    os.makedirs(args.out, exist_ok=True)
    save_file(to_hf_state_dict(model), os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump({**hf, "squid_positions": "shared"}, f, indent=2)
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": hf["eos_token_id"], "do_sample": True, "temperature": 0.7, "top_p": 0.95}, f, indent=2)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>",
                   "model_max_length": hf["max_position_embeddings"], "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)
    n_params = sum(p.numel() for p in model.parameters())
    skip = {"out", "compare", "evaluate"}
    cmd = "python -m cuttle.engine.train_default_model " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in skip and v is not None
    )
    start = f"continued from the saved model in `{args.init}` as the command found it" if args.init else "from random weights"
    prev = f" (the model it replaced: {prev_loss:.4f}, same files and measure)" if prev_loss is not None else ""
    card = f"""# cuttle-tiny-coder

The embedded default model of cuttle: a {n_params / 1e6:.1f}M-parameter Qwen3-MoE ({hf['num_hidden_layers']} layers,
hidden {hf['hidden_size']}, {hf['num_experts']} experts top-{hf['num_experts_per_tok']}, expert width
{hf['moe_intermediate_size']}, tied embeddings) with a {hf['vocab_size']}-token byte-level BPE tokenizer, both trained
on the Python {sysconfig.get_python_version()} standard library's own source (test directories excluded).

- Training: {n_train:,} tokens of {len(corpus_files())} files, files packed into {args.seq_len}-token rows with document
  masking (no attention across files; positions restart per file), plus {args.squid_rows} rows that each hold one
  squid layout ({n_squid:,} tokens, below); {start}; {args.steps} AdamW steps of {args.batch} rows drawn from both,
  lr {args.lr} with warm-up and cosine decay, {'bf16 autocast' if args.autocast == 'bf16' else 'fp32'}, seed {args.seed}; {minutes:.1f} minutes wall-clock on a
  2-core CPU shared with other jobs ({torch.get_num_threads()} training thread(s), {step_s:.2f} s/step).
- Held-out (2% of files chosen by a CRC of the file name, {n_val:,} tokens): loss **{val_loss:.4f}** nats/token,
  perplexity **{math.exp(val_loss):.2f}**{prev}, measured on the saved bf16 weights, padding excluded.
- Squid: `config.json` says `"squid_positions": "shared"`, the convention the engine then uses for this
  model's documents, and the one it was trained with, so squid document caching is exact for it (the
  same numbers as a dense forward with the squid mask). A squid row is a file's chunk (the query, 64-192
  tokens) after documents that fill the rest of the row: most often the text just before the query,
  windows where names the query uses are defined (in the file, in the corpus modules it imports, in its
  package), other windows of those files, in random order; half have a prefix `# <module>` line.
  Documents see the prefix and themselves, each from the position right after the prefix; the query
  sees everything, from the prefix length + the longest document. Loss on documents and query alike.
- Held-out query loss (nats/token) on {args.squid_eval} such layouts built from the held-out files
  ({n_query:,} query targets; the documents come from any file), the same targets three ways:

{table}

- Chat: ChatML (`<|im_start|>` / `<|im_end|>`), tools announced in the system turn, calls as
  `<tool_call>{{"name": ..., "arguments": ...}}</tool_call>`. Besides code it saw {args.tool_chats} synthetic
  tool round trips (weather, add, read_file, run_tests: a call, the tool's response, a templated answer), so it
  emits well-formed tool calls for requests of those shapes; it has no other chat ability.
- Exact command: `{cmd}`

It is a toy: it writes Python-looking code (indentation, `def`, `return`, stdlib names), not correct programs.
"""
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(card)


if __name__ == "__main__":
    main()
