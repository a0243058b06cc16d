"""Mistral's fill in the middle (Codestral, Devstral): engine/fim.py's `mistral` format against
mistral_common's own `encode_fim`, on the vocabularies mistral_common ships (Tekken, and the
SentencePiece v3 of Codestral-22B), converted to tokenizer.json by transformers as the HF repos
ship them. The prompt is BOS, [SUFFIX], the suffix encoded as an infill (no dummy-prefix space),
[PREFIX], the prefix; the model writes the middle after it."""
from __future__ import annotations

import os

import pytest

from cuttle.engine.fim import FimFormat
from cuttle.engine.tokenizer import Tokenizer
from helpers import mistral_tokenizer_dir

mistral_common = pytest.importorskip("mistral_common", reason="the oracle is mistral_common (the test extra installs it)")
from mistral_common.protocol.fim.request import FIMRequest  # noqa: E402
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer  # noqa: E402

DATA = os.path.join(os.path.dirname(mistral_common.__file__), "data")
VOCABS = {"tekken": "tekken_240911.json", "sentencepiece_v3": "mistral_instruct_tokenizer_240323.model.v3"}
CASES = [("def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"), ("", "x = 1\n"), (" for  i", " "), ("x = ", ""),
         ("naïve = '☺'\n", "  # über\n\treturn naïve\n"), ("\n\n", "\n")]


@pytest.fixture(scope="module", params=list(VOCABS))
def vocab(request, tmp_path_factory):
    src = os.path.join(DATA, VOCABS[request.param])
    return Tokenizer(mistral_tokenizer_dir(src, tmp_path_factory.mktemp(request.param))), MistralTokenizer.from_file(src)


def test_mistral_fim_prompt_is_mistral_commons(vocab):
    tok, oracle = vocab
    fim = FimFormat.of(tok)
    assert fim is not None and fim.name == "mistral"
    assert (fim.prefix_id, fim.suffix_id) == (oracle.instruct_tokenizer.PREFIX, oracle.instruct_tokenizer.SUFFIX)
    raw = oracle.instruct_tokenizer.tokenizer
    compared = 0
    for prefix, suffix in CASES:
        # transformers' conversion of a SentencePiece vocabulary encodes runs of spaces otherwise
        # than sentencepiece does (' a' -> '▁a' where sentencepiece writes '▁', '▁a'): a property
        # of the tokenizer.json served, not of the infilling layout, so such texts are left out
        if any(tok.encode(t, add_special_tokens=False) != raw.encode(t, bos=False, eos=False) for t in (prefix, "☺" + suffix)):
            assert request_is_sentencepiece(tok)
            continue
        want = oracle.encode_fim(FIMRequest(prompt=prefix, suffix=suffix)).tokens
        assert fim.prompt_ids(tok, prefix, suffix) == want, (prefix, suffix)
        compared += 1
    assert compared >= 3
    # the suffix is encoded as an infill: on the SentencePiece vocabulary not as a text is (its
    # dummy-prefix space), so a plain encoding of it would be a prompt the model never saw
    ids = fim.prompt_ids(tok, "a", "return y")
    assert ids[2:ids.index(fim.prefix_id)] == raw.encode("☺return y", bos=False, eos=False)[2:]
    # a token-id prefix is taken as given (no BOS), the squid query leaves the BOS to the layout
    assert fim.prompt_ids(tok, [7, 8], "b")[-3:] == [fim.prefix_id, 7, 8] and fim.prompt_ids(tok, [7, 8], "b")[0] == fim.suffix_id
    assert fim.prompt_ids(tok, "a", "b", head=False) == fim.prompt_ids(tok, "a", "b")[1:]
    assert set(fim.stop_ids) == {fim.prefix_id, fim.suffix_id, fim.middle_id}


def request_is_sentencepiece(tok: Tokenizer) -> bool:
    """Whether `tok` is the SentencePiece-converted vocabulary (its pre-tokenizer is Metaspace)."""
    return type(tok.tok.pre_tokenizer).__name__ == "Metaspace"
