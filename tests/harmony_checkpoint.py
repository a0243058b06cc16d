"""A tiny checkpoint that talks like gpt-oss: a byte-level tokenizer (every text round-trips exactly)
with harmony's markers as special tokens, `<|return|>` and `<|call|>` its stop tokens, and a chat
template that writes harmony messages (tools in a developer message, a call as a commentary
message to `functions.NAME`, a tool's result as a message from it, the generation prompt
`<|start|>assistant`; a system message naming the reasoning effort, as gpt-oss's does). Its weights are a tiny random Qwen3's: the tests script the sampled ids.
Built in a directory, no download."""
from __future__ import annotations

import json
import os

from helpers import make_checkpoint

MARKERS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]

HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{%- if tools -%}<|start|>developer<|message|># Tools\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' or m.role == 'user' -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' -%}"
    "{%- if m.content -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- for tc in m.tool_calls or [] -%}<|start|>assistant to=functions.{{ tc.function.name }}<|channel|>commentary json"
    "<|message|>{{ tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson }}<|call|>"
    "{%- endfor -%}"
    "{%- elif m.role == 'tool' -%}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)


def make_harmony_checkpoint(path: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({ch: i for i, ch in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(MARKERS)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    ids = {m: tok.token_to_id(m) for m in MARKERS}
    make_checkpoint(path, "qwen3", vocab_size=288, max_position_embeddings=2048, eos_token_id=[ids["<|return|>"], ids["<|call|>"]])
    assert vocab <= 288
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": HARMONY_TEMPLATE, "eos_token": "<|return|>", "bos_token": None}, f)
    return path
