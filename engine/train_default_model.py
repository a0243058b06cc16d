"""Recipe for the embedded default model: a tiny Qwen3-MoE coding model trained on the Python
standard library's own source, with its own byte-level BPE tokenizer.

    python -m cuttle.engine.train_default_model            # writes engine/default_model/

Deterministic for its seed on a given Python installation (the stdlib is the corpus). Files are
packed into rows with document masking: a token never attends across a file boundary and
positions restart at each file, so per-file KV caching is exact for this model. Training uses
the engine's own model code (`CausalLM.forward_packed`), so the engine serves exactly what was
trained. Progress and validation loss are shown as it runs; the model card records the held-out
loss, perplexity and the exact command.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sysconfig
import time
import zlib

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


def pack(docs: list[list[int]], seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of `seq_len` tokens: documents back to back, long ones split, each with its own
    positions (from 0) and document id. Returns (ids, positions, doc_ids), each [rows, seq_len]."""
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
                row_doc += [-1] * pad
                ids.append(row_ids), pos.append(row_pos), doc.append(row_doc)
                row_ids, row_pos, row_doc = [], [], []
            row_ids += piece
            row_pos += list(range(len(piece)))
            row_doc += [next_doc] * len(piece)
            next_doc += 1
    return torch.tensor(ids), torch.tensor(pos), torch.tensor(doc)


def lm_loss(model: CausalLM, ids: torch.Tensor, pos: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    hidden = model.forward_packed(ids, pos, doc)
    logits = F.linear(hidden[:, :-1], model.lm_head).float()
    target = ids[:, 1:].clone()
    target[doc[:, 1:] != doc[:, :-1]] = -100  # no prediction across a document boundary (or padding)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)


@torch.no_grad()
def evaluate(model: CausalLM, data: tuple[torch.Tensor, ...], batch: int) -> float:
    ids, pos, doc = data
    total, n = 0.0, 0
    for i in range(0, ids.shape[0], batch):
        tgt = doc[i : i + batch, 1:] == doc[i : i + batch, :-1]
        count = int((tgt & (doc[i : i + batch, 1:] >= 0)).sum())
        total += lm_loss(model, ids[i : i + batch], pos[i : i + batch], doc[i : i + batch]).item() * count
        n += count
    return total / n


def init_weights(model: CausalLM, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=g)


def to_hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """The trained parameters under HF Qwen3-MoE names (per-expert layout) in bf16: the loader's
    own name map inverted (`hf_state_dict`), so the saved file loads back into exactly this model."""
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in hf_state_dict(model).items()}


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
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()

    files = corpus_files()
    train_files = [f for f in files if not is_heldout(f)]
    val_files = [f for f in files if is_heldout(f)]
    print(f"corpus: {len(files)} stdlib files ({len(val_files)} held out) from {sysconfig.get_paths()['stdlib']}")
    tok = train_tokenizer([read(f) for f in train_files], args.vocab_size)
    eos = tok.token_to_id("<|endoftext|>")
    encode = lambda f: tok.encode(read(f)).ids + [eos]  # noqa: E731
    train_docs = [encode(f) for f in tqdm(train_files, desc="tokenize", leave=False)]
    val_docs = [encode(f) for f in val_files]
    chats = [tok.encode(c).ids + [eos] for c in synthetic_tool_chats(args.tool_chats, args.seed)]
    train_docs += chats
    # documents in a seeded random order, so rows mix code and conversations
    perm = torch.randperm(len(train_docs), generator=torch.Generator().manual_seed(args.seed)).tolist()
    train_docs = [train_docs[i] for i in perm]
    train = pack(train_docs, args.seq_len)
    val = pack(val_docs, args.seq_len)
    print(f"tokens: train {sum(map(len, train_docs)):,} ({sum(map(len, chats)):,} in {len(chats)} tool chats) "
          f"in {train[0].shape[0]} rows, held-out code {sum(map(len, val_docs)):,}")

    hf = {**MODEL_CONFIG, "vocab_size": tok.get_vocab_size(), "eos_token_id": eos, "bos_token_id": None}
    cfg = ModelConfig.from_hf(hf)
    model = CausalLM(cfg, torch.float32, torch.device("cpu"))
    init_weights(model, args.seed)
    for p in model.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    )
    g = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(train[0].shape[0], generator=g)
    bar = tqdm(range(args.steps), desc="train")
    val_loss = float("nan")
    for step in bar:
        idx = order[(step * args.batch + torch.arange(args.batch)) % order.numel()]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model, train[0][idx], train[1][idx], train[2][idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val_loss = evaluate(model, val, args.batch)
        bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{val_loss:.3f}", lr=f"{sched.get_last_lr()[0]:.2e}")
    bar.close()
    # the held-out figure recorded in the card is computed without autocast, on the saved bf16 weights
    model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    final = evaluate(model, val, args.batch)
    minutes = (time.time() - t0) / 60
    print(f"held-out loss {final:.4f}, perplexity {math.exp(final):.2f}, {minutes:.1f} min")
    save(args, model, hf, tok, final, minutes, sum(map(len, train_docs)), sum(map(len, val_docs)))


def save(args, model, hf, tok, val_loss, minutes, n_train, n_val) -> None:
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
    n_params = sum(p.numel() for p in model.parameters())
    cmd = "python -m cuttle.engine.train_default_model " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v is not None
    )
    card = f"""# cuttle-tiny-coder

The embedded default model of cuttle: a {n_params / 1e6:.1f}M-parameter Qwen3-MoE ({hf['num_hidden_layers']} layers,
hidden {hf['hidden_size']}, {hf['num_experts']} experts top-{hf['num_experts_per_tok']}, expert width
{hf['moe_intermediate_size']}, tied embeddings) with a {hf['vocab_size']}-token byte-level BPE tokenizer, both trained
on the Python {sysconfig.get_python_version()} standard library's own source (test directories excluded).

- Training: {n_train:,} tokens of {len(corpus_files())} files, files packed into {args.seq_len}-token rows with document
  masking (no attention across files; positions restart per file), {args.steps} AdamW steps of {args.batch} rows,
  lr {args.lr} with warm-up and cosine decay, bf16 autocast, seed {args.seed}; {minutes:.1f} minutes wall-clock on this
  machine's CPU ({torch.get_num_threads()} thread(s)).
- Held-out (2% of files chosen by a CRC of the file name, {n_val:,} tokens): loss **{val_loss:.4f}** nats/token,
  perplexity **{math.exp(val_loss):.2f}**, measured on the saved bf16 weights.
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
