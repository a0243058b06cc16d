"""Fill in the middle (engine/fim.py, the completions `suffix` field): each family's infilling
prompt equals its tokenizer's encoding of the documented template string, the format is found
from the tokenizer or refused, and the server's infilling completion equals the offline engine
on those ids."""
from __future__ import annotations

import json

import httpx
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from cuttle.engine.fim import FORMATS, STOP_TEXTS, FimFormat
from cuttle.engine.tokenizer import Tokenizer

CODE = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i * 2)\n", "class Point:\n    x: int = 0\n",
        "if x is None:\n    raise ValueError('x')\n", "import os\nprint(os.getcwd())\n"] * 20
BOS = "<｜begin▁of▁sentence｜>"


def _byte_level_checkpoint(tmp_path, family: str | None) -> Tokenizer:
    """A byte-level BPE tokenizer trained on a little code, with the family's infilling tokens
    (DeepSeek's with its BOS post-processor), written where `Tokenizer` reads it."""
    specials = ["<|endoftext|>", *(FORMATS[family] + STOP_TEXTS[family] if family else ())] + ([BOS] if family == "deepseek" else [])
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CODE, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cfg = {"eos_token": "<|endoftext|>", "bos_token": None}
    if family == "deepseek":
        tk.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tk.token_to_id(BOS))])
        cfg["bos_token"] = BOS
    d = tmp_path / (family or "none")
    d.mkdir()
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return Tokenizer(str(d))


@pytest.mark.parametrize("family", list(FORMATS))
def test_prompt_is_the_template_string_encoded(tmp_path, family):
    tok = _byte_level_checkpoint(tmp_path, family)
    fim = FimFormat.of(tok)
    assert fim is not None and fim.name == family
    assert fim.stop_ids == tuple(tok.tok.token_to_id(t) for t in FORMATS[family] + STOP_TEXTS[family])
    pre, suf, mid = FORMATS[family]
    for prefix, suffix in [("def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"), ("", "x = 1\n"), (" for  i", " ")]:
        ids = fim.prompt_ids(tok, prefix, suffix)
        # the oracle: the whole template string through the tokenizer (special tokens on, as a
        # text prompt is encoded), and through transformers' wrapper of the same file
        assert ids == tok.encode(f"{pre}{prefix}{suf}{suffix}{mid}", add_special_tokens=True), (prefix, suffix)
        transformers = pytest.importorskip("transformers")
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / family / "tokenizer.json"))
        assert ids == hf(f"{pre}{prefix}{suf}{suffix}{mid}")["input_ids"]
    has_bos = family == "deepseek"
    ids = fim.prompt_ids(tok, "a", "b")
    assert (ids[0] == tok.tok.token_to_id(BOS)) == has_bos and ids[int(has_bos)] == fim.prefix_id and ids[-1] == fim.middle_id
    # a token-id prefix is taken as given: no BOS
    assert fim.prompt_ids(tok, [7, 8], "b") == [fim.prefix_id, 7, 8, fim.suffix_id, *tok.encode("b", False), fim.middle_id]


def test_no_infilling_tokens_no_format(tmp_path):
    assert FimFormat.of(_byte_level_checkpoint(tmp_path, None)) is None
    from cuttle.engine.default_model import DEFAULT_MODEL_DIR

    assert FimFormat.of(Tokenizer(DEFAULT_MODEL_DIR)) is None  # the embedded model was not trained on infilling


@pytest.fixture(scope="module")
def fim_live(tmp_path_factory):
    from helpers import make_checkpoint, write_tokenizer
    from server_fixture import LiveServer

    path = str(tmp_path_factory.mktemp("fim"))
    make_checkpoint(path, "qwen3")
    write_tokenizer(path, 256, extra_specials=FORMATS["qwen"] + STOP_TEXTS["qwen"])  # the ids inside the model's vocabulary
    with LiveServer(path, dtype="float32", num_kv_blocks=64, max_model_len=128) as srv:
        yield srv, path


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_server_infills_as_the_offline_engine(fim_live):
    from cuttle.engine import LLM, SamplingParams

    srv, path = fim_live
    tok = Tokenizer(path)
    fim = FimFormat.of(tok)
    assert fim is not None and fim.name == "qwen"
    body = {"model": "test-model", "prompt": "a b c", "suffix": "x y", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 1}
    r = _post(srv.url, body)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    want = [fim.prefix_id, *tok.encode("a b c", False), fim.suffix_id, *tok.encode("x y", False), fim.middle_id]
    assert ch["prompt_token_ids"] == want
    assert r.json()["usage"]["prompt_tokens"] == len(want)
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    offline = llm.get_tokenizer()  # the offline route docs/server.md gives
    assert FimFormat.of(offline).prompt_ids(offline, "a b c", "x y") == want
    ref = llm.generate([want], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert ch["token_ids"] == ref.outputs[0].token_ids and ch["text"] == ref.outputs[0].text
    # streamed, a token-id prompt, and n prompts: each prompt is its own infilling prefix
    s = httpx.post(srv.url + "/v1/completions", json={**body, "stream": True, "prompt": [[5, 6], "a b c"], "logprobs": None},
                   timeout=60)
    chunks = [json.loads(line[6:]) for line in s.text.splitlines() if line.startswith("data: {")]
    by_index: dict[int, list[int]] = {}
    for c in chunks:
        for cc in c["choices"]:
            by_index.setdefault(cc["index"], []).extend(cc.get("token_ids") or [])
    assert by_index[1] == ref.outputs[0].token_ids
    ids_ref = llm.generate(
        [[fim.prefix_id, 5, 6, fim.suffix_id, *tok.encode("x y", False), fim.middle_id]],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert by_index[0] == ids_ref.outputs[0].token_ids
    # an infill ends at its format's control tokens (here <|fim_pad|>, forced by logit_bias), as
    # well as at the client's own stop ids
    pad = tok.tok.token_to_id("<|fim_pad|>")
    forced = _post(srv.url, {**body, "logit_bias": {str(pad): 100}, "stop_token_ids": [7]}).json()["choices"][0]
    assert forced["token_ids"] == [pad] and forced["finish_reason"] == "stop" and forced["stop_reason"] == pad
    plain_pad = _post(srv.url, {**body, "suffix": "", "logit_bias": {str(pad): 100}}).json()["choices"][0]
    assert plain_pad["token_ids"] == [pad] * 6 and plain_pad["finish_reason"] == "length"  # only infills stop there
    # repository-level infilling: the other files as squid documents (each cached on its own),
    # the infilling prompt as the query after them
    files = ["d e f g", "h i"]
    squid = _post(srv.url, {**body, "documents": files}).json()["choices"][0]
    ref = llm.generate({"documents": files, "prompt": want}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    assert squid["token_ids"] == ref.outputs[0].token_ids and squid["prompt_token_ids"] == ref.prompt_token_ids
    assert squid["token_ids"] != ch["token_ids"]  # the documents are read
    # suffix "" is a plain completion
    plain = _post(srv.url, {**body, "suffix": ""}).json()["choices"][0]
    assert plain["prompt_token_ids"] == tok.encode("a b c")


@pytest.mark.parametrize("family", list(FORMATS))
def test_query_after_documents_is_the_template_string_after_them(tmp_path, family):
    """Repository-level infilling: with squid documents the infilling prompt is the query, and
    the layout equals the one the template string sent as the query gives (a text query's BOS
    starts the layout, before the documents, not the query)."""
    from cuttle.engine.server.completions import _fim_prompts, _squid_prompt
    from cuttle.engine.squid import parse_prompt

    tok = _byte_level_checkpoint(tmp_path, family)
    fim = FimFormat.of(tok)
    pre, suf, mid = FORMATS[family]

    def layout(p: dict) -> tuple[list[int], list[list[int]], list[int]]:
        lay, query, _ = parse_prompt(p, tok.encode, lambda ids, field: None, "concat", 8)
        return lay.prefix, lay.documents, query

    text_docs = ["def f():\n    pass\n", "x = 1\n"]
    code, suffix = "def add(a, b):\n    ", "\nprint(add(1, 2))\n"
    bos = [tok.tok.token_to_id(BOS)] if family == "deepseek" else []
    for docs in (text_docs, [tok.encode(d, False) for d in text_docs]):
        for prefix in (None, "import os\n", [9, 10]):
            extra = {} if prefix is None else {"prefix": prefix}
            queries, heads = _fim_prompts(fim, tok, [code, tok.encode(code, False)], suffix, False, True, prefix)
            want = layout({**extra, "documents": docs, "prompt": f"{pre}{code}{suf}{suffix}{mid}"})
            assert layout(_squid_prompt(queries[0], heads[0], docs)) == want
            head = [] if isinstance(prefix, list) else bos  # (token ids are taken as given)
            assert want[0][:len(head)] == head and want[2][0] == fim.prefix_id  # a BOS heads the layout, not the query
            # a token-id prompt is placed as given: the layout's head is what the documents and
            # the prefix give (a BOS only where one of them is text)
            by_ids = layout(_squid_prompt(queries[1], heads[1], docs))
            assert by_ids[1:] == want[1:]
            assert by_ids[0] == layout({**extra, "documents": docs, "prompt": [1]})[0]


@pytest.mark.parametrize("extra,says", [
    ({"echo": True}, "echo"),
    ({"suffix": 5}, "string"),
])
def test_server_refuses_what_infilling_cannot_do(fim_live, extra, says):
    srv, _ = fim_live
    r = _post(srv.url, {"model": "test-model", "prompt": "a", "suffix": "b", "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "suffix" and says in err["message"]
    assert _post(srv.url, {"model": "test-model", "prompt": "a", "max_tokens": 2}).status_code == 200  # still serving


def test_server_without_infilling_tokens_names_the_field(tmp_path):
    from helpers import make_checkpoint
    from server_fixture import LiveServer

    make_checkpoint(str(tmp_path), "qwen3")
    with LiveServer(str(tmp_path), dtype="float32", num_kv_blocks=32, max_model_len=64) as srv:
        r = _post(srv.url, {"model": "test-model", "prompt": "a", "suffix": "b", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
        assert "infilling" in r.json()["error"]["message"] and "<|fim_prefix|>" in r.json()["error"]["message"]
        chat = httpx.post(srv.url + "/v1/chat/completions", json={"model": "test-model", "messages": [{"role": "user", "content": "a"}],
                                                                  "suffix": "b", "max_tokens": 2}, timeout=60)
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "suffix" and "/v1/completions" in chat.json()["error"]["message"]


@pytest.mark.parametrize("bad", [5, "x", [1.5]])
def test_bad_stop_token_ids_with_suffix_name_their_field(fim_live, bad):
    srv, _ = fim_live
    r = _post(srv.url, {"model": "test-model", "prompt": "a", "suffix": "b", "max_tokens": 2, "stop_token_ids": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
