"""Shared benchmark plumbing: random checkpoints of real shapes, the machine's measured limits,
markdown tables. Benchmarks report ratios against a peer or a limit measured in the same run."""
from __future__ import annotations

import json
import os
import platform
import time
from typing import Any

import torch

QWEN3_0_6B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
    intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
    eos_token_id=151645, bos_token_id=None, torch_dtype="bfloat16",
)

# A small Qwen3-MoE (same family as Qwen3-30B-A3B: every layer sparse, top-k probs renormalised).
QWEN3_MOE_SMALL = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=512,
    intermediate_size=1024, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, router_aux_loss_coef=0.001,
    eos_token_id=151645, bos_token_id=None, torch_dtype="bfloat16",
)

# --model-preset name -> (config, cache subdirectory)
PRESETS = {"qwen3-0.6b": (QWEN3_0_6B, "qwen3-0.6b-random"), "qwen3-moe-small": (QWEN3_MOE_SMALL, "qwen3-moe-small-random")}
DEFAULT_CACHE_DIR = os.path.expanduser("~/.cache/cuttle-bench")


def preset_checkpoint(name: str, cache_dir: str = DEFAULT_CACHE_DIR) -> str:
    """The random checkpoint of a preset, created on first use."""
    config, sub = PRESETS[name]
    return make_random_checkpoint(os.path.join(cache_dir, sub), config)


def make_random_checkpoint(path: str, config: dict[str, Any], dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> str:
    """Random weights of the given HF config, saved with transformers (HF layout), once per path.

    With a Qwen-sized vocab (>= 151669) the checkpoint gets the real Qwen2/Qwen3 byte-level BPE
    tokenizer (built offline from `peers/qwen2_vocab.json.xz`), so every engine, llama.cpp's GGUF
    converter included, reads the same token ids; smaller vocabs get a word-level "t<i>" tokenizer.
    An existing checkpoint with the older word-level tokenizer has its tokenizer files upgraded in
    place (weights untouched)."""
    has_weights = os.path.isfile(os.path.join(path, "model.safetensors")) or os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    if not has_weights:
        import transformers

        os.makedirs(path, exist_ok=True)
        cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
        cfg.architectures = config["architectures"]
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        model.save_pretrained(path)
    if config["vocab_size"] >= QWEN_TOKENIZER_SIZE:
        if not has_weights or _tokenizer_kind(path) != QWEN_TOKENIZER_KIND:
            _write_qwen_tokenizer(path, config.get("eos_token_id"))
    elif not has_weights:
        _write_byte_tokenizer(path, config["vocab_size"], config.get("eos_token_id"))
    return path


QWEN_TOKENIZER_KIND = "qwen2-bpe-v1"  # marker in tokenizer_config.json
QWEN_TOKENIZER_SIZE = 151669  # 151643 BPE tokens + Qwen3's 26 added tokens
# Qwen2's pre-tokenizer split (its tokenizer.json; llama.cpp's `qwen2` pre-tokenizer)
_QWEN2_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Qwen3's added tokens from id 151643 on: (content, special)
_QWEN3_ADDED = [(t, True) for t in (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>")] + [(t, False) for t in (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
    "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>")]
_CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _tokenizer_kind(path: str) -> str | None:
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            return json.load(f).get("cuttle_bench_tokenizer")
    except (OSError, ValueError):
        return None


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _write_qwen_tokenizer(path: str, eos_id: int | None) -> None:
    """The Qwen2/Qwen3 byte-level BPE tokenizer (Qwen3's ids), with a chat-ML template."""
    import lzma

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab_file = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "qwen2_vocab.json.xz")
    with lzma.open(vocab_file, "rt", encoding="utf-8") as f:
        data = json.load(f)
    tokens = data["tokens"]
    merges = [(tokens[256 + i][:k], tokens[256 + i][k:]) for i, k in enumerate(data["merge_split"])]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for content, special in _QWEN3_ADDED:  # one at a time: ids follow the list order
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    assert tok.get_vocab_size(with_added_tokens=True) == QWEN_TOKENIZER_SIZE and tok.token_to_id("<|im_end|>") == 151645
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "cuttle_bench_tokenizer": QWEN_TOKENIZER_KIND,
        "bos_token": None, "eos_token": tok.id_to_token(eos_id) if eos_id is not None else None,
        "pad_token": "<|endoftext|>", "model_max_length": 131072, "clean_up_tokenization_spaces": False,
        "chat_template": _CHATML_TEMPLATE,
    }
    _atomic_write(os.path.join(path, "tokenizer.json"), tok.to_str())
    _atomic_write(os.path.join(path, "tokenizer_config.json"), json.dumps(cfg, indent=1))


def _write_byte_tokenizer(path: str, vocab_size: int, eos_id: int | None) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": f"t{eos_id}" if eos_id is not None else None}, f)


def copy_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best of `repeats` large copies, counting read + write bytes."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best / 1e9


def matmul_gflops(dtype: torch.dtype, m: int = 2048, k: int = 2048, n: int = 2048, repeats: int = 5) -> float:
    a = torch.randn(m, k, dtype=dtype)
    b = torch.randn(k, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * m * k * n / best / 1e9


def machine_info() -> dict[str, Any]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    def fmt(x: Any) -> str:
        return f"{x:.3g}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def best_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls of fn(), after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
