"""Structured output and the token-level controls through the offline engine (engine/structured_output.py).

Oracles: `jsonschema` validates every JSON output against its schema, `re.fullmatch` the regex
outputs; logit_bias / allowed_token_ids / bad_words are checked against the model's own logits of
the same step, captured before the sampler touches them; preemption and forks against a run
that has neither."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import jsonschema
import pytest
import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.default_model import default_model_path
from cuttle.engine.sampling_params import StructuredOutputsParams
from xgrammar_probe import LONG_PATTERN, xgrammar_compiles_long_pattern



SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "io"]}, "maxItems": 3},
        "kind": {"enum": ["file", "dir", None]},
    },
    "required": ["name", "count", "ok", "tags", "kind"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def embedded():
    return LLM(dtype="float32", num_kv_blocks=1024, max_num_seqs=64, seed=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Qwen3 with the embedded model's byte-level BPE tokenizer (vocab 8196)."""
    from helpers import make_checkpoint

    path = str(tmp_path_factory.mktemp("tiny_bpe"))
    make_checkpoint(path, "qwen3", vocab_size=8196, eos_token_id=2)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(default_model_path(), f), path)
    return LLM(path, dtype="float32", num_kv_blocks=1024, max_num_seqs=64, seed=0)


def _gen(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0].outputs


@pytest.mark.parametrize("model", ["embedded", "tiny"])
def test_json_schema_outputs_validate_for_50_seeds(model, request):
    llm = request.getfixturevalue(model)
    so = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=160, structured_outputs=so) for s in range(50)]
    outs = llm.generate(["def load(path):\n    "] * 50, params, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({o.outputs[0].text for o in outs}) > 10  # sampled, not one forced answer


def test_json_object_regex_choice_grammar(embedded, tiny):
    for llm in (embedded, tiny):
        obj = _gen(llm, "x = ", temperature=1.0, seed=3, max_tokens=200, n=3,
                   structured_outputs=StructuredOutputsParams(json_object=True))
        for c in obj:
            if c.finish_reason == "stop":  # an unbounded object may run to max_tokens
                assert isinstance(json.loads(c.text), dict)
        rx = r"[0-9]{2,4}-(red|green|blue)\.[a-z]{1,5}"
        for c in _gen(llm, "x = ", temperature=1.0, seed=5, max_tokens=30, n=4, structured_outputs=StructuredOutputsParams(regex=rx)):
            assert c.finish_reason == "stop" and re.fullmatch(rx, c.text), c.text
        choices = ["yes", "no", "not sure", 'say "hi"']
        got = _gen(llm, "answer: ", temperature=1.0, seed=1, max_tokens=10, n=8, structured_outputs=StructuredOutputsParams(choice=choices))
        assert all(c.text in choices and c.finish_reason == "stop" for c in got)
        ebnf = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
        for c in _gen(llm, "e = ", temperature=1.0, seed=2, max_tokens=40, n=3, structured_outputs=StructuredOutputsParams(grammar=ebnf)):
            if c.finish_reason == "stop":
                assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", c.text), c.text
            else:
                assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*( \+ [1-9]?)?", c.text), c.text


def test_max_tokens_cut_is_length_and_greedy_is_deterministic(embedded):
    so = StructuredOutputsParams(json=SCHEMA)
    cut = _gen(embedded, "def f():", temperature=0, max_tokens=4, structured_outputs=so)[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 4
    with pytest.raises(ValueError):
        json.loads(cut.text)  # a cut JSON is reported as cut, not as a parse-valid answer
    full = _gen(embedded, "def f():", temperature=0, max_tokens=160, structured_outputs=so)[0]
    assert full.token_ids[:4] == cut.token_ids  # the same constrained greedy path
    jsonschema.validate(json.loads(full.text), SCHEMA)


def test_forks_and_preemption_keep_each_samples_grammar(tmp_path):
    """n=6 samples each with its own matcher; a pool so small that samples are preempted and
    recomputed gives the same tokens as a roomy one (the matchers never roll back)."""
    so = StructuredOutputsParams(json=SCHEMA)
    p = SamplingParams(temperature=1.0, seed=11, n=6, max_tokens=120, structured_outputs=so)
    roomy = LLM(dtype="float32", num_kv_blocks=512, seed=0).generate(["def g():"], p, use_tqdm=False)[0]
    tight_llm = LLM(dtype="float32", num_kv_blocks=10, block_size=16, seed=0)
    tight = tight_llm.generate(["def g():"], p, use_tqdm=False)[0]
    assert tight_llm.stats()["preemptions"] > 0
    assert [c.token_ids for c in tight.outputs] == [c.token_ids for c in roomy.outputs]
    for c in roomy.outputs:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({tuple(c.token_ids) for c in roomy.outputs}) > 1


def _capture(monkeypatch):
    """The logits rows each step hands the sampler, copied before the sampler changes them."""
    import cuttle.engine.llm_engine as le

    seen: list[torch.Tensor] = []
    real = le.sample

    def spy(logits, rows, mode="processed", mask=None, greedy=None):
        seen.append(logits.clone())
        return real(logits, rows, mode, mask, greedy)

    monkeypatch.setattr(le, "sample", spy)
    return seen


def test_logit_bias_allowed_ids_bad_words_against_the_models_logits(embedded, monkeypatch):
    prompt = "import os\nimport sys\n\ndef main():\n    "
    plain = _gen(embedded, prompt, temperature=0, max_tokens=6, logprobs=0)[0]
    seen = _capture(monkeypatch)
    # logit_bias: greedy picks the argmax of logits + bias, and the processed logprob is its log-softmax
    top = plain.token_ids[0]
    bias = {top: -100.0, 7: 30.0, 100: 5.5}
    got = _gen(embedded, prompt, temperature=0, max_tokens=3, logit_bias=bias, logprobs=0)[0]
    for step, tok in enumerate(got.token_ids):
        ref = seen[step][0].clone()
        for t, b in bias.items():
            ref[t] += b
        assert tok == int(ref.argmax())
        assert got.logprobs[step][tok].logprob == pytest.approx(float(torch.log_softmax(ref, -1)[tok]), abs=1e-5)
    assert top not in got.token_ids[:1]
    # allowed_token_ids at temperature 1: every token in the set, logprob = log-softmax over the set
    seen.clear()
    allowed = [11, 57, 300, 1024, 4000]
    got = _gen(embedded, prompt, temperature=1.0, seed=4, max_tokens=5, allowed_token_ids=allowed, logprobs=0)[0]
    idx = torch.tensor(allowed)
    for step, tok in enumerate(got.token_ids):
        assert tok in allowed
        sub = torch.log_softmax(seen[step][0][idx], -1)
        assert got.logprobs[step][tok].logprob == pytest.approx(float(sub[allowed.index(tok)]), abs=1e-5)
    # bad_words: the unconstrained greedy output's 2nd..3rd tokens as a word; its last token is
    # banned exactly where the rest of it was just generated
    tok = embedded.get_tokenizer()
    word = tok.decode(plain.token_ids[1:3])
    ids = tok.encode(word, add_special_tokens=False)
    assert len(ids) == 2, "pick a prompt whose greedy tokens 1..2 re-encode as themselves"
    seen.clear()
    got = _gen(embedded, prompt, temperature=0, max_tokens=6, bad_words=[word])[0]
    assert got.token_ids[:2] == plain.token_ids[:2]
    ref = seen[2][0].clone()
    ref[ids[1]] = float("-inf")
    assert got.token_ids[2] == int(ref.argmax()) != plain.token_ids[2]
    out = got.token_ids
    assert not any(out[i : i + 2] == ids for i in range(len(out) - 1))


def test_controls_apply_per_row_in_a_mixed_batch(embedded):
    """Constrained and free requests in one batch: the free ones are untouched."""
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = embedded.generate(["def a():", "class B:"], free, use_tqdm=False)
    mixed = embedded.generate(["def a():", "x = ", "class B:"],
                              [free, SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-c]{8}")), free],
                              use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == [o.outputs[0].token_ids for o in alone]
    assert re.fullmatch("[a-c]{1,8}", mixed[1].outputs[0].text)


@pytest.mark.parametrize("kw,field", [
    (dict(structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": 5})), "structured_outputs.json"),
    (dict(structured_outputs=StructuredOutputsParams(regex="(unclosed")), "structured_outputs.regex"),
    (dict(structured_outputs=StructuredOutputsParams(grammar="root ::= undefined_rule")), "structured_outputs.grammar"),
    # no finite string: it failed its request at the first sample (a 500 on the server)
    (dict(structured_outputs=StructuredOutputsParams(grammar="root ::= root")), "structured_outputs.grammar admits no output"),
    # keywords xgrammar compiles without enforcing (an output breaking them was returned as valid)
    (dict(structured_outputs=StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True})),
     "structured_outputs.json uses $.uniqueItems"),
    (dict(structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": {"a": {
        "type": "object", "if": {"required": ["x"]}, "then": {"required": ["y"]}}}})), "structured_outputs.json uses $.properties.a.if"),
    (dict(structured_outputs=StructuredOutputsParams(json={"type": "object", "dependentRequired": {"a": ["b"]}})),
     "dependentRequired"),
    # pattern parts xgrammar drops (a lookahead: "(?!b)[ab]" accepted "b") or reads as a plain
    # letter (\\A, \\Z), with only a log warning
    (dict(structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": {"s": {
        "type": "string", "pattern": "^(?!admin)[a-z]+$"}}})), "structured_outputs.json uses $.properties.s.pattern (a lookaround (?!...))"),
    (dict(structured_outputs=StructuredOutputsParams(json={"type": "string", "pattern": "\\Aab"})),
     "structured_outputs.json uses $.pattern (the escape \\A)"),
    (dict(structured_outputs=StructuredOutputsParams(json={"type": "object", "patternProperties": {"^x(?=y)": {}}})),
     "structured_outputs.json uses $.patternProperties"),
    (dict(structured_outputs=StructuredOutputsParams(regex="[a-z]+\\Z")), "structured_outputs.regex uses the escape \\Z"),
    (dict(structured_outputs=StructuredOutputsParams(regex="a$b")), "structured_outputs.regex uses an anchor $ that text can follow"),
    # a " or \\ in a schema pattern: xgrammar matches it in the JSON-escaped text ("[\\\\]{2}"
    # accepted one backslash, written \\\\)
    (dict(structured_outputs=StructuredOutputsParams(json={"type": "string", "pattern": "^[\\\\]{2}$"})),
     'structured_outputs.json uses $.pattern (a " or \\ character'),
    (dict(structured_outputs=StructuredOutputsParams(json={"type": "object", "patternProperties": {'^"k"$': {}}})),
     "structured_outputs.json uses $.patternProperties"),
    # a pattern neither xgrammar 0.2.8 nor 0.2.9 parses (a backreference)
    (dict(structured_outputs=StructuredOutputsParams(json={"type": "string", "pattern": "(a)\\1"})), "structured_outputs.json does not compile"),
    (dict(logit_bias={10**6: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[5, 10**6]), "allowed_token_ids"),
    # a pattern xgrammar 0.2.8 parses but whose compile fails one of its own checks (a RuntimeError,
    # a 500 on the server); 0.2.9 compiles it (LONG_PATTERN)
    (dict(structured_outputs=StructuredOutputsParams(json={"type": "string", "pattern": LONG_PATTERN})),
     "structured_outputs.json does not compile"),
])
def test_bad_controls_are_refused_at_admission(embedded, kw, field):
    if LONG_PATTERN in repr(kw) and xgrammar_compiles_long_pattern():
        # xgrammar 0.2.9 fixed that check: the schema is served like any other
        out = embedded.generate(["x"], SamplingParams(max_tokens=2, **kw), use_tqdm=False)
        assert out[0].outputs[0].finish_reason == "length"
        return
    with pytest.raises(ValueError, match=re.escape(field)):
        embedded.generate(["x"], SamplingParams(max_tokens=2, **kw), use_tqdm=False)
    assert not embedded.engine.has_unfinished_requests()


def test_unenforced_regex_skips_literals_and_supported_parts():
    """Lookarounds and anchors are found outside character classes and escapes only, unknown letter
    escapes inside classes too; what xgrammar enforces (classes, non-capturing groups, the escapes
    it knows, anchors that nothing can precede / follow; inline flags and named groups in schema
    patterns, where a `regex` spec gets "does not compile") is not refused."""
    from cuttle.engine.grammar_support import unenforced_regex

    for ok in ["[(?=]a", "\\(?=a\\)", "(?:a)b", "(?i)ab", "\\d+\\.\\w\\s\\x41\\u0041\\n\\t", "[\\]]x", "a\\"]:
        assert unenforced_regex(ok) is None, ok
    assert unenforced_regex("a(?<=a)b") == "a lookaround (?<=...)"
    assert unenforced_regex("a(?<!b)b") == "a lookaround (?<!...)"
    assert unenforced_regex("[\\]](?=x)") == "a lookaround (?=...)"  # the escaped ] does not end the class early
    assert unenforced_regex("x\\G") == "the escape \\G"
    assert unenforced_regex("[a\\Z]") == "the escape \\Z"  # inside a class too
    # anchors: xgrammar matches the whole string and drops every ^ / $, so only those that cannot
    # have text before (^) or after ($) them are kept
    for ok in ["^a$", "^(a|b)$", "(^a|^b)c", "^a|b$", "(a$)", "a$|b", "((a$))", "(?:^a)b", "(?i)^ab$", "[$^]a", "\\$a\\^"]:
        assert unenforced_regex(ok) is None, ok
    for bad in ["a^b", "b(^a)", "x(a|^b)"]:
        assert unenforced_regex(bad) == "an anchor ^ that text can precede", bad
    for bad in ["a$b", "(a$)b", "(a|b$)a", "((a$))b", "(a$)*", "((a$)|b)c"]:
        assert unenforced_regex(bad) == "an anchor $ that text can follow", bad
    # a group that can match twice puts the first pass's text before its ^ ("(^a)*" accepted "aa")
    for ok in ["(^a)?b", "(^a){1}b", "(^a){0,1}b", "^(ab)*$", "^(?:a|b)+$", "(^a)a{2}", "(^a)\\*", "(^a){}"]:
        assert unenforced_regex(ok) is None, ok
    for bad in ["[]a]", "x[^]a]"]:  # Python: a literal ]; ECMA-262 and xgrammar: the class ends ("[^]a]" accepted "xa]")
        assert unenforced_regex(bad) == "a ] first in a character class (write \\] for the character)", bad
    for bad in ["(^a)*", "(^a)+", "(^a){2}", "(?:^a|b){1,3}", "((^a))*", "(a|(^b)){2,}", "(^a){,}", "(?:(^a|b))+"]:
        assert unenforced_regex(bad) == "an anchor in a group that can repeat", bad


def test_schema_patterns_naming_a_quote_or_backslash_are_refused():
    """xgrammar matches a JSON-schema pattern in the string's JSON-escaped text, so a pattern that
    names " or \\ (a literal ", an escape of either, either in a class that is not negated) is
    refused in a schema; negated classes are kept, and `regex` specs (raw text) keep both."""
    from cuttle.engine.grammar_support import unenforced_regex, unenforced_schema_pattern

    for bad in ['a"', '\\"', "[\\\\]{2}", "\\\\", "\\x5c", "\\u005C", "\\x22", '[a"]', '[\\]"]']:
        assert unenforced_schema_pattern(bad) == 'a " or \\ character, which the grammar matches in the JSON-escaped text', bad
        assert unenforced_regex(bad) is None, bad
    for ok in ['[^"]*', "[^\\\\]+", "\\d+", "a\\.b", "^[^@]+@[^@]+$", "\\x41"]:
        assert unenforced_schema_pattern(ok) is None, ok
    assert unenforced_schema_pattern("(?=a)") == "a lookaround (?=...)"  # what unenforced_regex finds, first


def test_served_patterns_are_enforced_by_xgrammar():
    """Property check of what the engine hands xgrammar (`build_grammar`: `unenforced_regex`'s
    and `unenforced_schema_pattern`'s refusals, "." and \\x spelled out) against `re`: random
    patterns over a, b, newline, quote, backslash, classes, ".", anchors, groups, alternatives and
    quantifiers; for each pattern served (and that xgrammar parses), every string over
    {a, b, newline, ", \\} up to 2 long and over {a, b, newline} 3 long that the grammar accepts
    must match the pattern -- `re.fullmatch` for a `regex` spec, `re.search` for a JSON-schema
    `pattern` (ECMA-262 semantics: not anchored). Seeded; ~700 served patterns."""
    import itertools
    import random

    from xgrammar.testing import _is_grammar_accept_string as accepts

    from cuttle.engine.structured_output import build_grammar

    rng = random.Random(20261128)
    quantifiers = ["?", "*", "+", "{2}", "{0,1}", "{1,2}", "*?", "{2,}"]

    def alternatives(depth: int) -> str:
        return "|".join("".join(atom(depth) for _ in range(rng.randint(0, 3))) for _ in range(rng.choice([1, 1, 2, 3])))

    def atom(depth: int) -> str:
        r = rng.random()
        if r < 0.15:
            return rng.choice("^$")
        if r < 0.35 and depth < 3:
            a = rng.choice(["(", "(?:"]) + alternatives(depth + 1) + ")"
        else:
            a = rng.choice(["a", "b", "[ab]", "[^a]", ".", ".", "\\n", "[.]", "\\.", "[^]a]", "\\s", '"', "\\\\",
                            "[\\\\a]", "[^\\\\]", "\\x61", "\\x61b", "[\\x61b]"])
        return a + rng.choice(quantifiers) if rng.random() < 0.25 else a

    strings = [""] + ["".join(p) for k in range(1, 3) for p in itertools.product('ab\n"\\', repeat=k)]
    strings += ["".join(p) for p in itertools.product("ab\n", repeat=3)]
    served = 0
    for _ in range(2000):
        pattern = alternatives(0)
        try:
            re.compile(pattern)
            as_regex = build_grammar(StructuredOutputsParams(regex=pattern))
            as_schema = build_grammar(StructuredOutputsParams(json={"type": "string", "pattern": pattern}))
        except (re.error, ValueError):  # not a regex, refused, or xgrammar does not parse it
            continue
        served += 1
        for s in strings:
            assert not accepts(as_regex, s) or re.fullmatch(pattern, s), (pattern, s)
            assert not accepts(as_schema, json.dumps(s)) or re.search(pattern, s), (pattern, s)
    assert served > 600


def test_schema_combinations_xgrammar_drops_are_refused():
    """Keyword combinations xgrammar compiles but does not enforce (each measured to accept an
    instance the schema forbids) are refused naming where; the shapes schema generators emit
    (Pydantic's enum / Literal / Optional[$ref], annotations beside $ref, discriminated unions) are
    served."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from cuttle.engine.grammar_support import unenforced_keywords
    from cuttle.engine.structured_output import build_grammar

    refused = [
        ({"allOf": [{"type": "integer", "minimum": 1}, {"type": "integer", "maximum": 2}]}, "$.allOf"),
        ({"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 2}]}, "$.oneOf (enforced as anyOf)"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "$.oneOf (enforced as anyOf)"),
        ({"const": 1, "minimum": 2}, "$.minimum (beside const)"),
        ({"enum": ["a", 1], "type": "string"}, "$.type (beside enum)"),
        ({"enum": ["a", "abc"], "maxLength": 1}, "$.maxLength (beside enum)"),
        ({"anyOf": [{"type": "integer"}], "minimum": 3}, "$.minimum (beside anyOf)"),
        ({"$defs": {"p": {"type": "integer"}}, "$ref": "#/$defs/p", "minimum": 3}, "$.minimum (beside $ref)"),
        ({"type": "object", "required": ["a"]}, '$.required ("a" not in properties)'),
        ({"type": "string", "minLength": 3, "pattern": "^a+$"}, "$.minLength (beside pattern)"),
        ({"type": "string", "maxLength": 3, "format": "date"}, "$.maxLength (beside format)"),
        ({"type": "string", "pattern": "^a$", "format": "date"}, "$.pattern (beside format)"),
        ({"type": "number", "multipleOf": 2}, "$.multipleOf (enforced only on an integer type, by an integer)"),
        ({"type": "integer", "multipleOf": 2, "maximum": 0}, "$.multipleOf (beside a bound)"),
        ({"maxLength": 1}, "$.maxLength (without a type)"),
        ({"type": "object", "properties": {"b": {"type": "boolean"}}, "patternProperties": {"^x$": {}}}, "$.patternProperties"),
        ({"type": "object", "additionalProperties": False, "propertyNames": {"pattern": "^a"}}, "$.propertyNames"),
        ({"type": "object", "properties": {"a": {}}, "minProperties": 1}, "$.minProperties"),
        ({"type": "array", "items": {"maximum": 1}}, "$.items.maximum (without a type)"),
    ]
    for schema, where in refused:
        assert where in unenforced_keywords(schema), (schema, unenforced_keywords(schema))
    served = [
        {"enum": ["red", "blue"], "type": "string", "title": "Color"},
        {"const": "a", "type": "string"},
        {"enum": [1, 2.0], "type": "integer"},
        {"type": "object", "properties": {"c": {"anyOf": [{"$ref": "#/$defs/C"}, {"type": "null"}], "default": None, "title": "C"}},
         "$defs": {"C": {"type": "integer"}}},
        {"properties": {"x": {"$ref": "#/$defs/p", "description": "d"}}, "required": ["x"], "type": "object",
         "$defs": {"p": {"type": "integer", "maximum": 3}}},
        {"oneOf": [{"type": "integer"}, {"type": "string"}]},
        {"type": "integer", "multipleOf": 2},
        {"type": ["string", "null"], "maxLength": 2},
        {"type": "string", "format": "date"},
    ]
    for schema in served:
        assert unenforced_keywords(schema) == [], (schema, unenforced_keywords(schema))

    # a discriminated union (Pydantic's shape): oneOf over $refs whose required tag consts differ is
    # disjoint, so anyOf enforces it; with a shared tag, or a tag not required, it is refused
    def pets(cat_tag: str, required: list[str]) -> dict:
        def pet(tag: str, field: str) -> dict:
            return {"type": "object", "properties": {"pet_type": {"const": tag, "type": "string"}, field: {"type": "integer"}},
                    "required": [r if r != "field" else field for r in required]}
        return {"$defs": {"Cat": pet(cat_tag, "meows"), "Dog": pet("dog", "barks")}, "type": "object", "required": ["pet"],
                "properties": {"pet": {"discriminator": {"propertyName": "pet_type"}, "title": "Pet",
                                       "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}}}

    union = pets("cat", ["pet_type", "field"])
    assert unenforced_keywords(union) == []
    grammar = build_grammar(StructuredOutputsParams(json=union))
    for pet, ok in (({"pet_type": "cat", "meows": 1}, True), ({"pet_type": "dog", "barks": 2}, True),
                    ({"pet_type": "cat", "barks": 1}, False), ({"pet_type": "dog", "meows": 1}, False)):
        assert accepts(grammar, json.dumps({"pet": pet})) == ok == jsonschema.Draft202012Validator(union).is_valid({"pet": pet})
    assert "$.properties.pet.oneOf (enforced as anyOf)" in unenforced_keywords(pets("dog", ["pet_type", "field"]))
    assert "$.properties.pet.oneOf (enforced as anyOf)" in unenforced_keywords(pets("cat", ["field"]))
    one = {"type": "object", "properties": {"t": {"const": 1}}, "required": ["t"]}
    one_float = {"type": "object", "properties": {"t": {"enum": [1.0]}}, "required": ["t"]}
    assert unenforced_keywords({"oneOf": [one, one_float]}) == ["$.oneOf (enforced as anyOf)"]  # 1 == 1.0 in JSON


def test_served_schemas_are_enforced_by_xgrammar():
    """Property check of the schema keywords: random schemas (types with their bounds, patterns,
    enum / const, anyOf / oneOf / allOf, properties / required / additionalProperties, keywords
    without a type, ...); for each one `build_grammar` serves, every instance of a fixed pool that
    xgrammar's grammar accepts must validate under `jsonschema`. Seeded; ~280 served schemas."""
    import random

    from xgrammar.testing import _is_grammar_accept_string as accepts

    from cuttle.engine.structured_output import build_grammar

    rng = random.Random(7)
    pool = [0, 1, 2, 3, -1, 5, 1.5, -0.5, 100, "", "a", "ab", "abc", "b", "ba", "2024-01-01", "zz", [], [1], [1, 1],
            [1, 2, 3], ["a"], ["a", 1], {}, {"a": 1}, {"b": 1}, {"a": 1, "b": 2}, {"a": "x"}, {"a": [1]}, {"a": {"a": 1}},
            {"c": 1}, True, False, None]
    def strings() -> dict:
        return {k: v for k, v in (("minLength", rng.randint(0, 2)), ("maxLength", rng.randint(0, 2)),
                                  ("pattern", rng.choice(["^a", "^[a-z]+$", "b", "^.$"])), ("format", "date"))
                if rng.random() < 0.3}

    def numbers() -> dict:
        return {k: rng.choice([0, 1, 2, 1.5]) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                                                          "multipleOf") if rng.random() < 0.25}

    def schema(depth: int) -> dict:
        r = rng.random()
        if depth > 1 or r < 0.25:
            t = rng.choice(["string", "integer", "number", "boolean", "null", None])
            node = {"type": t} if t else {}
            node.update(strings() if t in ("string", None) else numbers() if t in ("integer", "number", None) else {})
            if t is None and rng.random() < 0.5:
                node.update(numbers())
            return node
        if r < 0.35:
            node = {"enum": rng.sample(pool, 3)} if rng.random() < 0.5 else {"const": rng.choice(pool)}
            if rng.random() < 0.4:
                node.update(rng.choice([{"type": "string"}, {"type": "integer"}, {"minimum": 1}, {"maxLength": 1}]))
            return node
        if r < 0.55:
            node = {rng.choice(["anyOf", "oneOf", "allOf"]): [schema(depth + 1) for _ in range(rng.randint(1, 3))]}
            if rng.random() < 0.3:
                node.update(rng.choice([{"type": "integer"}, {"minimum": 2}, {"title": "t"}]))
            return node
        if r < 0.75:
            node = {"type": "array", "items": schema(depth + 1)}
            node.update({k: rng.randint(0, 2) for k in ("minItems", "maxItems") if rng.random() < 0.3})
            return node if rng.random() < 0.8 else {k: v for k, v in node.items() if k != "type"}
        props = {name: schema(depth + 1) for name in rng.sample(["a", "b"], rng.randint(0, 2))}
        node = {"type": "object", "properties": props}
        if rng.random() < 0.6:
            node["required"] = rng.sample(sorted(props) + ["c"], rng.randint(0, len(props)))
        if rng.random() < 0.3:
            node["additionalProperties"] = rng.choice([False, True, {"type": "integer"}])
        return node

    served = 0
    for _ in range(600):
        sch = schema(0)
        try:
            grammar = build_grammar(StructuredOutputsParams(json=sch))
        except ValueError:  # refused, or xgrammar does not compile it
            continue
        served += 1
        validator = jsonschema.validators.validator_for(sch)(sch)  # ("format": an annotation, as the spec has it)
        for instance in pool:
            assert not accepts(grammar, json.dumps(instance)) or validator.is_valid(instance), (sch, instance)
    assert served > 200


def test_choice_is_exactly_its_strings():
    """A choice is an EBNF alternation of its strings, written literally: one outside the Basic
    Multilingual Plane was once spelled as a JSON surrogate pair, which the EBNF took for two code
    points, so "😀" could never be produced."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from cuttle.engine.structured_output import build_grammar

    choices = ['a"b', "\\", "\n", "é", "\u2028", "😀", "日本", "\\n", "x\ty", "\x01"]
    grammar = build_grammar(StructuredOutputsParams(choice=choices))
    assert all(accepts(grammar, c) for c in choices)
    assert not any(accepts(grammar, c) for c in ["a", '"', "n", "😀😀", "日", "\\ud83d\\ude00", "\\u00e9", "a\\b"])


def test_patterns_are_spelled_out_for_xgrammar():
    """xgrammar's "." matches a newline ("a." accepted "a\\n", which re.fullmatch refuses): the
    engine spells "." out as Python's (regex specs) or ECMA-262's (JSON-schema patterns, also
    without \\r, U+2028, U+2029); escaped dots and dots in classes stay literal. \\xHH is handed
    over as \\u00HH."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from cuttle.engine.grammar_support import explicit_dots
    from cuttle.engine.structured_output import build_grammar

    assert explicit_dots("a.\\.[.]b[^.\\]]", "X") == "aX\\.[.]b[^.\\]]"
    g = build_grammar(StructuredOutputsParams(regex="a.b"))
    assert accepts(g, "axb") and accepts(g, "a\rb") and not accepts(g, "a\nb")
    # xgrammar's regex parser reads hex digits after \x for as long as they last ("\x41b" was U+041B)
    assert explicit_dots("\\x41b[\\x41b]\\\\x41", "X") == "\\u0041b[\\u0041b]\\\\x41"
    g = build_grammar(StructuredOutputsParams(regex="\\x41b"))
    assert accepts(g, "Ab") and not accepts(g, "\u041b")
    g = build_grammar(StructuredOutputsParams(json={"type": "object", "properties": {"s": {"type": "string", "pattern": "^.$"}},
                                                    "required": ["s"]}))
    assert accepts(g, '{"s": "x"}')
    for line_break in ("\n", "\r", "\u2028", "\u2029"):
        assert not accepts(g, json.dumps({"s": line_break})) and not accepts(g, json.dumps({"s": line_break}, ensure_ascii=False))
    # an enum value is data: its "." is not a pattern's
    g = build_grammar(StructuredOutputsParams(json={"enum": ["a.b"]}))
    assert accepts(g, '"a.b"')
    # every pattern of a schema (tool parameters too) and patternProperties' names; data and names kept
    from cuttle.engine.grammar_support import SCHEMA_DOT, schema_with_explicit_dots

    schema = {"type": "object", "properties": {"a.b": {"type": "string", "pattern": "x."}, "pattern": {"const": "."}},
              "patternProperties": {"^k.$": {"items": [{"pattern": ".\\."}]}}, "$defs": {"d": {"pattern": "[.]."}},
              "default": {"pattern": "."}}
    assert schema_with_explicit_dots(schema) == {
        "type": "object", "properties": {"a.b": {"type": "string", "pattern": "x" + SCHEMA_DOT}, "pattern": {"const": "."}},
        "patternProperties": {f"^k{SCHEMA_DOT}$": {"items": [{"pattern": SCHEMA_DOT + "\\."}]}},
        "$defs": {"d": {"pattern": "[.]" + SCHEMA_DOT}}, "default": {"pattern": "."}}


def test_properties_named_like_unenforced_keywords_are_kept():
    """A property called "not" or "if" is data, not the keyword: the schema compiles."""
    from cuttle.engine.grammar_support import unenforced_keywords

    schema = {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "object", "properties": {
        "contains": {"type": "integer"}}}}, "$defs": {"else": {"type": "integer"}}, "required": ["not"]}
    assert unenforced_keywords(schema) == []
    assert unenforced_keywords({"properties": {"a": {"not": {"type": "string"}}}}) == ["$.properties.a.not"]


@pytest.mark.parametrize("kw,field", [
    (dict(logit_bias={5: 101}), "logit_bias[5]"),
    (dict(logit_bias={-1: 1}), "logit_bias key"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(bad_words=[" "]), "bad_words"),
    (dict(structured_outputs=StructuredOutputsParams(json={}), ignore_eos=True), "ignore_eos"),
    (dict(structured_outputs=StructuredOutputsParams(json={}), min_tokens=2), "min_tokens"),
])
def test_sampling_params_refuse_bad_controls(kw, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        SamplingParams(**kw)


def test_structured_outputs_params_shape():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="structured_outputs.json is not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=[])
    assert StructuredOutputsParams(json={"type": "object"}).key() == ("json", '{"type": "object"}')
    # the empty schema (any JSON value) is a schema, not "nothing set" (its kind was a StopIteration)
    assert StructuredOutputsParams(json={}).kind == "json" and StructuredOutputsParams(json={}).key() == ("json", "{}")


def test_word_level_tokenizer_is_refused(qwen3_path):
    """The test checkpoints' word-level tokenizer decodes with spaces between tokens: a token
    grammar would not be a text grammar there, so it is refused, naming the decoder."""
    llm = LLM(qwen3_path, dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match="WordPiece"):
        llm.generate(["a"], SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+")), use_tqdm=False)
    # the token-level controls need no grammar and work with any tokenizer
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=[9, 10], ignore_eos=True), use_tqdm=False)
    assert set(out[0].outputs[0].token_ids) <= {9, 10}


def test_engine_imports_and_refuses_structured_output_without_xgrammar():
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] == 'xgrammar':\n"
        "            raise ImportError('xgrammar is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from cuttle.engine import LLM, SamplingParams\n"
        "from cuttle.engine.sampling_params import StructuredOutputsParams\n"
        "llm = LLM(dtype='float32', num_kv_blocks=16)\n"
        "out = llm.generate(['def f(x):'], SamplingParams(temperature=0, max_tokens=3, logit_bias={5: 2.0}, bad_words=['x']), use_tqdm=False)\n"
        "assert len(out[0].outputs[0].token_ids) == 3\n"
        "try:\n"
        "    llm.generate(['a'], SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex='a')), use_tqdm=False)\n"
        "except ValueError as e:\n"
        "    assert 'xgrammar' in str(e), e\n"
        "    print('refused:', e)\n"
        "else:\n"
        "    raise SystemExit('not refused')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "refused: structured_outputs needs the xgrammar package" in r.stdout


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("vocab", [1000, 1024, 8196])
def test_apply_token_mask_matches_the_bit_layout(path, vocab, monkeypatch):
    """Bit t of word w allows token 32 w + t (xgrammar's layout, checked against xgrammar's own
    apply); rows without a mask row and the logit_bias entries as specified. Both the native
    kernel (attention/csrc/token_mask.c) and the torch path; whole all-ones and all-zeros words
    (the kernel's shortcuts), a vocabulary that ends inside a word."""
    import numpy as np
    import xgrammar as xgr

    import cuttle.engine.sampler as sampler
    from cuttle.attention.native import kernels
    from cuttle.engine.sampler import apply_token_mask
    from cuttle.engine.structured_output import TokenMask

    calls = []
    if path == "torch":
        monkeypatch.setattr(sampler, "apply_bitmask", lambda *a: False)
    else:
        assert kernels().lib is not None, "the CPU kernel library did not build (a compiler is part of the test set-up)"
        real = sampler.apply_bitmask
        monkeypatch.setattr(sampler, "apply_bitmask", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(vocab)
    bm = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    bm[0, 3:9] = -1  # all allowed
    bm[1, 2:7] = 0  # all banned
    bm[2, -1] = 0
    x = torch.randn(4, vocab, generator=gen)
    bits = torch.from_numpy(np.unpackbits(bm.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :vocab].astype(bool))
    mask = TokenMask([0, 2, 3], bm, bias_rows=torch.tensor([1, 2]), bias_ids=torch.tensor([7, 9]), bias_vals=torch.tensor([2.5, -1.0]))
    got = x.clone()
    apply_token_mask(got, mask)
    want = x.clone()
    want[1, 7] += 2.5
    want[2, 9] -= 1.0
    for k, r in enumerate([0, 2, 3]):
        want[r][~bits[k]] = float("-inf")
    assert torch.equal(got, want)
    xg = x[[0, 2, 3]].clone()
    xg[1, 9] -= 1.0
    xgr.apply_token_bitmask_inplace(xg, bm)
    assert torch.equal(got[[0, 2, 3]], xg)
    if path == "native":
        assert calls and torch.isinf(got).any()
        # a logits view with a row stride (not the whole tensor) is masked in place as well
        wide = torch.randn(3, vocab + 40, generator=gen)
        view = wide[:, :vocab]
        want_v = view.clone()
        apply_token_mask(view, TokenMask([0, 1, 2], bm))
        for k in range(3):
            want_v[k][~bits[k]] = float("-inf")
        assert torch.equal(view, want_v)


def test_a_token_its_grammar_rejects_fails_that_request_alone_and_is_delivered(embedded, monkeypatch):
    """A sampled token the request's own grammar rejects (here forced by a patched sampler, as a
    buggy logits processor or a scripted test sampler would) ends that request with an error output
    and frees its KV; a free request in the same batch runs on. (Such a request used to be failed
    without ever producing an output: its caller waited forever and it stayed in `requests`.)"""
    import cuttle.engine.llm_engine as llm_engine

    engine = embedded.engine
    real = llm_engine.sample
    bad = embedded.get_tokenizer().encode("zzz", add_special_tokens=False)[0]

    def forcing(logits, rows, *rest):
        out = real(logits, rows, *rest)
        for k, r in enumerate(rows):
            if r.params.seed == 777:
                out[k] = dataclasses.replace(out[k], token=bad)
        return out

    monkeypatch.setattr(llm_engine, "sample", forcing)
    constrained = SamplingParams(seed=777, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("bad-grammar", "Answer:", constrained)
    engine.add_request("free", "def a():", free)
    finals = {}
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert set(finals) == {"bad-grammar", "free"}
    assert "not allowed by the request's grammar" in finals["bad-grammar"].error
    assert finals["free"].error is None and len(finals["free"].outputs[0].token_ids) == 6
    stats = engine.stats()
    assert not engine.requests and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_async_engine_compiles_a_grammar_off_the_engine_thread(embedded, monkeypatch):
    """A schema's compile runs on a worker thread before admission, so it never stalls the
    engine thread's steps; the request then finds the grammar compiled, and a spec that does not
    compile is refused by `add` as before."""
    import asyncio
    import threading

    from cuttle.engine.async_engine import AsyncEngine

    controls = embedded.engine.controls
    threads = []
    real = controls.compile
    monkeypatch.setattr(controls, "compile", lambda spec: threads.append(threading.current_thread().name) or real(spec))
    aeng = AsyncEngine(embedded.engine)
    aeng.start()
    schema = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 4, "maximum": 977}}, "required": ["k"]}
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=24, structured_outputs=StructuredOutputsParams(json=schema))

    async def main():
        async for out in await aeng.add("so-1", "x = ", params):
            last = out
        with pytest.raises(ValueError):
            await aeng.add("so-2", "x", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(")))
        return last

    try:
        out = asyncio.run(main())
    finally:
        aeng.shutdown()
    assert 4 <= json.loads(out.outputs[0].text)["k"] <= 977
    # each spec compiled first before admission, off the engine thread ("cuttle-engine"); the
    # engine's own compile in add_request is then a cache hit (the bad spec fails before that)
    assert threads[0] != "cuttle-engine" and threads[1] == "cuttle-engine" and threads[2] != "cuttle-engine", threads
    assert len(threads) == 3


def test_a_slow_compile_stalls_no_other_compile(embedded, monkeypatch):
    """A compile runs outside the cache's lock: while one spec compiles (seconds for a hostile
    schema on a large vocabulary), a cached spec is returned at once (the engine thread's
    admission of any structured request) and another spec compiles beside it; two threads
    asking for the same spec share one compile, and its failure reaches both."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from concurrent.futures import Future

    from cuttle.engine import structured_output

    waiting = threading.Event()

    class Shared(Future):  # an in-flight compile, telling when another thread waits for it
        def result(self, timeout=None):
            waiting.set()
            return super().result(timeout)

    monkeypatch.setattr(structured_output, "Future", Shared)
    controls = embedded.engine.controls
    cached = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    controls.compile(cached)  # (also builds the vocabulary's tables)
    real, started, release, calls, fail = controls._compiler, threading.Event(), threading.Event(), [], []

    class Held:  # the real compiler, with compiles of the "slow..." regexes held until released
        def compile_grammar(self, grammar):
            slow = '"s" "l" "o" "w"' in str(grammar)
            calls.append(slow)
            if slow:
                started.set()
                assert release.wait(30)
                if fail:
                    raise RuntimeError("held compile failed")
            return real.compile_grammar(grammar)

    controls._compiler = Held()
    try:
        with ThreadPoolExecutor(4) as pool:
            slow = [pool.submit(controls.compile, StructuredOutputsParams(regex="slowslow[0-9]+")) for _ in range(2)]
            assert started.wait(30)
            t0 = time.monotonic()
            assert controls.compile(cached) is not None
            other = controls.compile(StructuredOutputsParams(regex="[a-f]{3}z"))
            waited = time.monotonic() - t0
            assert other is not None and waited < 2.0 and not any(f.done() for f in slow), waited
            release.set()
            assert slow[0].result(30) is slow[1].result(30)
        assert calls.count(True) == 1  # the second asker waited for the first one's compile
        # a spec failing to compile, asked for by two threads at once: one compile, the error in both
        release.clear()
        waiting.clear()
        started.clear()
        fail.append(True)
        with ThreadPoolExecutor(2) as pool:
            bad = [pool.submit(controls.compile, StructuredOutputsParams(regex="slowslow[a-z]+")) for _ in range(2)]
            assert started.wait(30)
            assert waiting.wait(30)  # the second asker is waiting for the first one's compile
            release.set()
            for f in bad:
                with pytest.raises(ValueError, match="structured_outputs.regex does not compile .*held compile failed"):
                    f.result(30)
        assert calls.count(True) == 2 and not controls._compiling
    finally:
        controls._compiler = real
        release.set()

