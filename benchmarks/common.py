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


def make_random_checkpoint(path: str, config: dict[str, Any], dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> str:
    """Random weights of the given HF config, saved with transformers (HF layout), once per path."""
    if os.path.isfile(os.path.join(path, "model.safetensors")) or os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
        return path
    import transformers

    os.makedirs(path, exist_ok=True)
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    cfg.architectures = config["architectures"]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(path)
    _write_byte_tokenizer(path, config["vocab_size"], config.get("eos_token_id"))
    return path


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
