"""Mistral's tekken.json read without a tokenizer.json (engine/ranked_bpe.py).

Mistral's shipped Tekken vocabulary (mistral_common's data: 130,072 ranked tokens and 1,000
special ids) with a v11 file's special tokens: token ids equal mistral_common's Tekkenizer on code,
Unicode, whitespace runs, digits and a seeded corpus of random text, and transformers'
convert_tekken_tokenizer's tokenizer.json on the same texts; decoding gives the text back; special
tokens written in text are read as theirs (a chat template spells them); a checkpoint folder with
only tekken.json serves the engine. A file without special tokens and a malformed one are refused,
naming what to do.
"""
from __future__ import annotations

import json
import os
import random

import pytest

import mistral_common
from cuttle.engine import LLM, SamplingParams
from cuttle.engine.ranked_bpe import tekken_tokenizer
from cuttle.engine.tokenizer import Tokenizer
from helpers import mistral_tokenizer_dir, save_checkpoint, tiny_mistral

SOURCE = os.path.join(os.path.dirname(mistral_common.__file__), "data", "tekken_240911.json")
SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]",
            "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]", "[ARGS]", "[CALL_ID]"]
TEXTS = ["def add(a, b):\n    return a + b\n", "Hello, world! Ça va? 日本語のテキスト 🙂 naïve café", "  \n\n\t x=1;y=2  \n",
         "import numpy as np\nprint(np.arange(10)[::-1])", "1234567890 3.14159 -2e10", "URL: https://example.com/a/b?c=d&e=f",
         "ÀÉÎÕÜ àéîõü ßøå ĳ ǅ", "    if (x) {\r\n        y++;\r\n    }", "", " ", "a" * 300, "\u200b\u00a0zero width"]


@pytest.fixture(scope="module")
def tekken(tmp_path_factory) -> str:
    """A folder holding only a v11 tekken.json: the shipped vocabulary with Mistral's special tokens."""
    data = json.load(open(SOURCE))
    data["config"] = {**data["config"], "version": "v11"}
    data["special_tokens"] = [{"rank": i, "token_str": t, "is_control": True} for i, t in enumerate(SPECIALS)]
    d = tmp_path_factory.mktemp("tekken")
    json.dump(data, open(d / "tekken.json", "w"))
    return str(d)


def _corpus() -> list[str]:
    rng = random.Random(7)
    pieces = ["the", " quick", "ß", "日本", "🙂", "\n", "  ", "\t", "0", "123", "_x", "()", "{}", "==", "é", "Ω", "'s", " 's", "\r\n"]
    return TEXTS + ["".join(rng.choice(pieces) for _ in range(rng.randrange(1, 40))) for _ in range(300)] + [
        "".join(chr(rng.randrange(32, 0x3000)) for _ in range(rng.randrange(1, 30))) for _ in range(100)]


def test_ids_equal_mistral_common_and_transformers(tekken, tmp_path):
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    path = os.path.join(tekken, "tekken.json")
    ours = tekken_tokenizer(path)
    oracle = Tekkenizer.from_file(path)
    converted = Tokenizer(mistral_tokenizer_dir(path, tmp_path))  # transformers' convert_tekken_tokenizer
    assert ours.get_vocab_size() == 131072
    for text in _corpus():
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == oracle.encode(text, bos=False, eos=False), text
        assert ids == converted.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == text
    # special tokens written in text are theirs (a rendered chat template spells them)
    assert ours.encode("[INST]hi[/INST][TOOL_CALLS]f[ARGS]{}", add_special_tokens=False).ids[:2] == [3, oracle.encode("hi", bos=False, eos=False)[0]]
    assert [ours.token_to_id(t) for t in ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<SPECIAL_999>")] == [9, 20, 21, 999]


def test_a_folder_with_only_tekken_json_serves(tekken):
    """cuttle's Tokenizer reads it (BOS / EOS Mistral's), and an engine over a tiny Mistral with
    that vocabulary takes a text prompt."""
    tok = Tokenizer(tekken)
    assert (tok.bos_token, tok.eos_token, tok.eos_token_id, tok.vocab_size) == ("<s>", "</s>", 2, 131072)
    assert 3 in tok.special_ids and tok.encode("[INST]", add_special_tokens=False) == [3]
    model = tiny_mistral(None, layers=1)
    model.resize_token_embeddings(131072)
    save_checkpoint(tekken, model)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # (save_checkpoint writes the test tokenizer: only tekken.json stays)
        os.remove(os.path.join(tekken, name))
    out = LLM(tekken, dtype="float32", num_kv_blocks=16, block_size=8).generate(["def f(x):"], SamplingParams(max_tokens=3),
                                                                               use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode("def f(x):", add_special_tokens=False) and len(out.outputs[0].token_ids) == 3


def test_refusals(tmp_path):
    data = json.load(open(SOURCE))  # (the shipped file: version v3, special tokens left to a built-in list)
    json.dump(data, open(tmp_path / "tekken.json", "w"))
    with pytest.raises(ValueError, match="names no special_tokens.*convert_tekken_tokenizer"):
        Tokenizer(str(tmp_path))
    (tmp_path / "tekken.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a tekken vocabulary"):
        Tokenizer(str(tmp_path))
