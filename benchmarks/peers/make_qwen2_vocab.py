"""Regenerate `qwen2_vocab.json.xz` (committed, ~0.6 MB) from llama.cpp's vocab-only test file.

    python benchmarks/peers/make_qwen2_vocab.py .peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp

The benchmark checkpoints carry a real Qwen2/Qwen3 byte-level BPE tokenizer so that every engine
(cuttle, transformers, vLLM, llama.cpp) reads the same token ids and llama.cpp's converter
recognises the `qwen2` pre-tokenizer. The source is `models/ggml-vocab-qwen2.gguf` (MIT, vendored in
the llama-cpp-python sdist). Stored compactly: the 151643 BPE tokens in id order, and for each merge
the length of its left half (merge i always produces token 256 + i in this vocab, so the merge list
is exactly recoverable). `common.py` turns it back into a tokenizer.json.
"""
from __future__ import annotations

import json
import lzma
import os
import sys

N_BPE = 151643  # ids below are BPE tokens; 151643.. are added (special) tokens


def main() -> None:
    llama_cpp_dir = sys.argv[1]
    sys.path.insert(0, os.path.join(llama_cpp_dir, "gguf-py"))
    import gguf

    r = gguf.GGUFReader(os.path.join(llama_cpp_dir, "models", "ggml-vocab-qwen2.gguf"))
    tokens = r.fields["tokenizer.ggml.tokens"].contents()[:N_BPE]
    merges = r.fields["tokenizer.ggml.merges"].contents()
    assert r.fields["tokenizer.ggml.pre"].contents() == "qwen2" and len(merges) == N_BPE - 256
    split = []
    for i, m in enumerate(merges):
        a, b = m.split(" ")
        assert a + b == tokens[256 + i], (i, m)
        split.append(len(a))
    data = {"source": "llama.cpp models/ggml-vocab-qwen2.gguf", "tokens": tokens, "merge_split": split}
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qwen2_vocab.json.xz")
    with lzma.open(out, "wt", encoding="utf-8", preset=9) as f:
        json.dump(data, f, ensure_ascii=False, separators=(",", ":"))
    print(f"wrote {out} ({os.path.getsize(out) / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
