"""Structured output and the token-level sampling controls, as one mask stage.

Owns what decides, per sampled row, which tokens may come next: the grammar of a request's
`structured_outputs` (JSON schema, JSON object, regex, choice, EBNF grammar, structural tag),
`allowed_token_ids`, `bad_words` and `logit_bias`. Concretely:
- grammar compilation through xgrammar: the tokenizer's vocabulary is read once (lazily, at the
  first request that needs it), and compiled grammars are cached per spec (LRU);
- the per-request state (`Controls`), created at admission, so a bad spec is refused before
  anything is queued (a `ValueError` naming the field);
- one grammar matcher per *sample*: the `n` samples of a request (and the members of a GRPO
  group, which are separate requests) never share one. A matcher is created on a sample's first
  sampled step and fed that sample's own output tokens, so a fork needs no copy;
- the per-step job (`start`): on a worker thread, every constrained sample's matcher catches up
  with the tokens appended since the last step and fills the sample's row of the token bitmask,
  while the main thread runs the model's forward. The sampler then waits for the `TokenMask`
  and applies it (engine/sampler.py `apply_token_mask`).

Preemption and recompute keep a sequence's tokens, so a matcher never has to roll back: it
counts the tokens it has consumed and only ever catches up. It never samples and never touches
logits. xgrammar is optional: `cuttle.engine` imports without it, and a request that needs it is
refused with an error naming the missing package. Why xgrammar and not llguidance: docs/server.md.
"""
from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from cuttle.engine.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from cuttle.engine.sequence import Request, Sequence
    from cuttle.engine.tokenizer import Tokenizer

# tokenizers' decoders whose output is the concatenation of each token's own bytes: a grammar over
# tokens is then a grammar over the text (WordPiece and friends insert spaces between tokens)
_CONCAT_DECODERS = {"ByteLevel", "Metaspace", "ByteFallback", "Fuse", "Strip", "Replace"}
_CACHE_SIZE = 64  # compiled grammars kept (a JSON schema on a 151k vocab compiles in ~0.1 s)
# JSON is generated in one layout, separators ", " and ": " and no other whitespace: with free
# whitespace a code model's vocabulary (tokens of dozens of spaces, runs of newlines) fills
# max_tokens with indentation (measured: 16 of 16 embedded-model samples cut at 200 tokens).
_JSON_LAYOUT = {"any_whitespace": False}


def xgrammar() -> Any:
    """The xgrammar module, or a ValueError naming the package to install."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise ValueError("structured_outputs needs the xgrammar package, which is not installed "
                         "(pip install 'cuttle[serve]', or pip install xgrammar)") from None
    return xgr


# JSON-schema keywords xgrammar compiles without enforcing (measured on xgrammar 0.2.8: a schema
# with each accepted an instance it forbids); a schema using one is refused rather than half-kept
_UNENFORCED = ("if", "then", "else", "not", "dependentRequired", "dependentSchemas", "dependencies", "contains",
               "minContains", "maxContains",
               # kept alone at best; beside other object keywords a property's schema or additionalProperties
               # false was lost ({"properties": {"b": {"type": "boolean"}}, "patternProperties": {"^x$": {}}}
               # accepted {"b": 1}; additionalProperties false beside propertyNames accepted {"a": 1})
               "patternProperties", "propertyNames", "minProperties", "maxProperties")


# keywords whose value maps names (a property's, a definition's) to schemas: the names are data
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions")

# Letters xgrammar reads after a backslash as what they mean in a regex (probed on 0.2.8 and 0.2.9,
# JSON-schema patterns and `regex` alike): after any other letter it matches the letter itself with
# only a log warning (\A, \Z, \z, \G, ...) or refuses the pattern.
_KNOWN_ESCAPES = frozenset("adDefnrsStuvwWx")

# what unenforced_keywords finds, for the messages that refuse it
UNENFORCED_WHAT = ("if/then/else, not, dependent*, contains, uniqueItems, allOf, patternProperties, propertyNames, "
                   "min/maxProperties, oneOf unless its branches differ in "
                   "type or in a required const, a constraint beside enum / const / anyOf / oneOf / $ref, a required name not in properties, "
                   "minLength / maxLength / pattern beside another string rule, multipleOf but an integer's alone on integers, a string / "
                   "number / array bound without a type; "
                   "in a pattern, lookarounds, a ^ that text "
                   "can precede or a $ that text can follow, a ] first in a class, a \" or \\ named in a schema's "
                   "pattern, and escapes other than \\d \\w \\s \\D \\W \\S \\n \\r \\t \\f \\v \\a \\e \\x \\u")

# What "." may match, spelled out for xgrammar, whose "." also matches a newline: Python's "." in a
# `regex` spec (its outputs are checked with re), ECMA-262's in a JSON-schema pattern (the line
# terminators \n \r \u2028 \u2029 excluded), which is within Python's too
_REGEX_DOT = "[^\\n]"
_SCHEMA_DOT = "[^\\n\\r\\u2028\\u2029]"


def unenforced_regex(pattern: str) -> str | None:
    """What in a regex the grammar would not enforce, or None: a lookaround (xgrammar drops a
    lookahead from a JSON-schema pattern with only a log warning: "(?!b)[ab]" accepted "b"), an
    escape it would match as a plain letter, or an anchor where text can precede a ^ or follow a $
    (xgrammar matches the whole string and drops every anchor: "a$b" accepted "ab", "b(^a)" "ba"),
    which includes an anchor in a group that can repeat ("(^a)*" accepted "aa"); or a "]" first in
    a class, a literal to Python's re but the class's end to ECMA-262 and xgrammar ("[^]a]" accepted
    "xa]").
    Escaped characters and character classes are literals to the lookaround and anchor checks, so
    "\\(?=" and "[(?=]" pass; letter escapes inside a class are checked like any other."""
    def unknown_escape(at: int) -> str | None:
        nxt = pattern[at + 1] if at + 1 < n else ""
        return f"the escape \\{nxt}" if nxt.isascii() and nxt.isalpha() and nxt not in _KNOWN_ESCAPES else None

    i, n = 0, len(pattern)
    at_start = True  # nothing can have been matched before this point
    # open groups: [opened at a start point, holds a $ that must end the match, holds an anchor]
    groups: list[list[bool]] = []
    while i < n:
        c = pattern[i]
        if c == "\\":
            if why := unknown_escape(i):
                return why
            i, at_start = i + 2, False
        elif c == "[":  # a class, to its closing ]
            i += 2 if pattern.startswith("[^", i) else 1
            if pattern.startswith("]", i):
                return "a ] first in a character class (write \\] for the character)"
            while i < n and pattern[i] != "]":
                if pattern[i] == "\\" and (why := unknown_escape(i)):
                    return why
                i += 2 if pattern[i] == "\\" else 1
            i, at_start = i + 1, False
        elif pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
            return f"a lookaround {pattern[i:i + (4 if pattern[i + 2] == '<' else 3)]}...)"
        elif c == "(":
            i += 1
            if pattern.startswith("?", i):  # a group header: (?: (?P<name> (?<name> or flags (?i)
                j = i
                while j < n and pattern[j] not in ":>)":
                    j += 1
                if j < n and pattern[j] == ")":  # inline flags: no group
                    i = j + 1
                    continue
                i = j + 1
            groups.append([at_start, False, False])
        elif c == ")":
            _, must_end, anchored = groups.pop() if groups else (False, False, False)
            i += 1
            if must_end:
                if i < n and pattern[i] not in "|)":
                    return "an anchor $ that text can follow"
                if i < n and groups:  # the group ends an alternative of the one around it: so must that
                    groups[-1][1] = True
            if anchored:
                if _repeats(pattern, i):  # a second pass is preceded (or followed) by the first's text
                    return "an anchor in a group that can repeat"
                if groups:
                    groups[-1][2] = True
            at_start = False
        elif c == "|":
            i, at_start = i + 1, groups[-1][0] if groups else True
        elif c == "^":
            if not at_start:
                return "an anchor ^ that text can precede"
            i += 1
            if groups:
                groups[-1][2] = True
        elif c == "$":
            i += 1
            if groups:
                groups[-1][2] = True
            if i < n and pattern[i] not in "|)":
                return "an anchor $ that text can follow"
            if i < n and groups:
                groups[-1][1] = True
        else:
            i, at_start = i + 1, False
    return None


# a " or \ written as an escape: \" \\ \x22 \x5c \u0022 \u005c
_QUOTE_OR_BACKSLASH_ESCAPE = re.compile(r'\\(?:["\\]|x(?:22|5[cC])|u00(?:22|5[cC]))')


def unenforced_schema_pattern(pattern: str) -> str | None:
    r"""What `unenforced_regex` finds in a JSON-schema pattern, or a " or \ the pattern names (a
    literal ", an escape of either, or either listed in a class that is not negated): xgrammar
    matches a schema pattern in the string's JSON-escaped text, so such a pattern accepts strings
    it does not match (`[\\]{2}` accepted one backslash, whose JSON text is two; `[^\d]{2}"`
    accepted `a"`, whose JSON text is `a\"`)."""
    if why := unenforced_regex(pattern):
        return why
    i, n = 0, len(pattern)
    while i < n:
        if pattern[i] == '"' or _QUOTE_OR_BACKSLASH_ESCAPE.match(pattern, i):
            return 'a " or \\ character, which the grammar matches in the JSON-escaped text'
        if pattern[i] == "[" and pattern.startswith("[^", i):  # a negated class: to its end
            i += 2
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
        i += 2 if pattern[i:i + 1] == "\\" else 1
    return None


def explicit_dots(pattern: str, dot: str) -> str:
    """`pattern` with every "." that means any character (not escaped, not in a class) written as
    the class `dot`, and every \\xHH as \\u00HH (xgrammar's regex parser reads hex digits after \\x
    for as long as they last: "\\x41b" accepted "\u041b", not "Ab"); the rest unchanged."""
    out, i, n = [], 0, len(pattern)
    in_class = False
    while i < n:
        c = pattern[i]
        if c == "\\":
            hx = pattern[i + 2:i + 4]
            if pattern.startswith("x", i + 1) and len(hx) == 2 and all(h in "0123456789abcdefABCDEF" for h in hx):
                out.append("\\u00" + hx)
                i += 4
            else:
                out.append(pattern[i:i + 2])
                i += 2
            continue
        if not in_class and c == "[":
            j = i + (2 if pattern.startswith("[^", i) else 1)
            j += 1 if pattern.startswith("]", j) else 0  # (refused by unenforced_regex; kept whole here)
            out.append(pattern[i:j])
            i, in_class = j, True
            continue
        if in_class and c == "]":
            in_class = False
        out.append(dot if c == "." and not in_class else c)
        i += 1
    return "".join(out)


def _schema_with_explicit_dots(node: Any) -> Any:
    """A copy of the JSON schema `node` with explicit_dots applied to every pattern and
    patternProperties name (values under const / enum / default / examples are data: kept)."""
    if isinstance(node, list):
        return [_schema_with_explicit_dots(v) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k in ("const", "enum", "default", "examples"):
            out[k] = v
        elif k == "pattern" and isinstance(v, str):
            out[k] = explicit_dots(v, _SCHEMA_DOT)
        elif k in _NAMED_SCHEMAS and isinstance(v, dict):
            rename = k == "patternProperties"
            out[k] = {(explicit_dots(name, _SCHEMA_DOT) if rename else name): _schema_with_explicit_dots(sub)
                      for name, sub in v.items()}
        else:
            out[k] = _schema_with_explicit_dots(v)
    return out


def _repeats(pattern: str, i: int) -> bool:
    """Whether the quantifier at pattern[i] (if any) lets what it follows match more than once."""
    if pattern.startswith(("*", "+"), i):
        return True
    m = re.match(r"\{(\d*)(,?)(\d*)\}", pattern[i:])
    if m is None:  # no quantifier, "?", or a "{" that is a literal
        return False
    low, comma, high = m.groups()
    if not comma:  # "{n}" ("{}" is a literal)
        return bool(low) and int(low) > 1
    return not high or int(high) > 1  # "{n,}", "{,}" (Python: any count), "{n,m}"


# keywords that constrain nothing (annotations), and where definitions live
_ANNOTATIONS = frozenset(("title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                          "writeOnly", "$id", "$schema", "$defs", "definitions", "discriminator"))  # (OpenAPI's)
# keywords xgrammar enforces only beside a "type" (without one it ignores them: {"maxLength": 1}
# accepted "ab", {"maximum": 1} 2, {"maxItems": 1} [1, 2])
_NEED_TYPE = ("minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
              "multipleOf", "minItems", "maxItems")
_JSON_TYPES: dict[str, Any] = {"string": str, "boolean": bool, "null": type(None), "array": list, "object": dict,
                               "integer": int, "number": (int, float)}


def _of_type(value: Any, types: Any) -> bool:
    """Whether the JSON value is of one of the schema types `types` (a name or a list of names)."""
    names = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    for t in names:
        if isinstance(value, bool) and t not in ("boolean",):
            continue  # JSON true / false are not numbers
        if t == "integer" and isinstance(value, float) and value.is_integer():
            return True
        if t in _JSON_TYPES and isinstance(value, _JSON_TYPES[t]):
            return True
    return False


def _resolve(branch: Any, root: Any) -> Any:
    """A local "$ref" ("#/$defs/X") followed within `root` (one level), else the branch itself."""
    ref = branch.get("$ref") if isinstance(branch, dict) else None
    if not (isinstance(ref, str) and ref.startswith("#/")):
        return branch
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _disjoint(branches: list[Any], root: Any) -> bool:
    """Whether no JSON value can match two of the branches: each has a single type of its own
    (integer and number overlap), or each is an object requiring one property P whose const (or
    one-value enum) differs from branch to branch, as a discriminated union's do."""
    types = [b.get("type") if isinstance(b, dict) else None for b in branches]
    if all(isinstance(t, str) for t in types) and len(set(types)) == len(types) and not {"integer", "number"} <= set(types):
        return True
    resolved = [_resolve(b, root) for b in branches]
    if not all(isinstance(b, dict) and isinstance(b.get("properties"), dict) for b in resolved):
        return False

    def tag(b: dict, name: str) -> str | None:
        sub = b["properties"].get(name)
        if name not in (b.get("required") or []) or not isinstance(sub, dict):
            return None
        enum = sub.get("enum")
        if "const" in sub or (isinstance(enum, list) and len(enum) == 1):
            v = sub["const"] if "const" in sub else enum[0]
            # JSON equality: 1 and 1.0 are one value (true and 1 are not)
            return repr(float(v)) if isinstance(v, (int, float)) and not isinstance(v, bool) else json.dumps(v, sort_keys=True)
        return None

    for name in resolved[0]["properties"]:
        tags = [tag(b, name) for b in resolved]
        if all(t is not None for t in tags) and len(set(tags)) == len(tags):
            return True
    return False


def _unenforced_combinations(node: dict[str, Any], at: str, root: Any) -> list[str]:
    """Keyword combinations in one schema node that xgrammar (0.2.8, 0.2.9) compiles but does not
    enforce, each measured to accept an instance the schema forbids: allOf ({"allOf": [{"type":
    "integer", "minimum": 1}, {"maximum": 2}]} accepted 0); oneOf, enforced as anyOf (an instance
    matching two branches passed), kept only where the branches are disjoint (`_disjoint`); a
    constraint beside enum / const (only the enum is enforced: {"const": 1, "minimum": 2} accepted
    1), where a "type" is checked against the values instead; a constraint beside anyOf / oneOf /
    $ref (only those are enforced); a required name missing from properties ({} passed);
    minLength / maxLength beside a pattern or format, and a pattern beside a format (only one
    string rule is kept); multipleOf other
    than an integer on an integer type, or beside a bound; a keyword of _NEED_TYPE without a
    "type"."""
    found: list[str] = []
    keys = set(node)
    if "allOf" in keys:
        found.append(f"{at}.allOf")
    branches = node.get("oneOf")
    if isinstance(branches, list) and not _disjoint(branches, root):
        found.append(f"{at}.oneOf (enforced as anyOf)")
    for holder in ("enum", "const"):
        if holder in keys:
            for k in sorted(keys - _ANNOTATIONS - {"enum", "const"}):
                values = node.get("enum") if holder == "enum" else [node.get("const")]
                if k == "type" and isinstance(values, list) and all(_of_type(v, node["type"]) for v in values):
                    continue
                found.append(f"{at}.{k} (beside {holder})")
            return found  # the rest of the node is what just got listed
    for holder in ("anyOf", "oneOf", "$ref"):
        if holder in keys:
            others = keys - _ANNOTATIONS - {"anyOf", "oneOf", "$ref"}
            found += [f"{at}.{k} (beside {holder})" for k in sorted(others)]
            return found
    required, props = node.get("required"), node.get("properties")
    if isinstance(required, list):
        missing = [r for r in required if not (isinstance(props, dict) and r in props)]
        if missing:
            found.append(f"{at}.required ({json.dumps(missing[0])} not in properties)")
    if "pattern" in keys or "format" in keys:  # one string rule is kept: the format, else the pattern
        found += [f"{at}.{k} (beside {'format' if 'format' in keys else 'pattern'})"
                  for k in ("minLength", "maxLength", "pattern") if k in keys and not (k == "pattern" and "format" not in keys)]
    if "multipleOf" in keys and "type" in keys:  # ({"type": "number", "multipleOf": 2} accepted 1)
        types = node["type"] if isinstance(node["type"], list) else [node["type"]]
        m = node["multipleOf"]
        if "number" in types or isinstance(m, bool) or not isinstance(m, int):
            found.append(f"{at}.multipleOf (enforced only on an integer type, by an integer)")
        elif keys & {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}:  # (-1 passed beside < 0)
            found.append(f"{at}.multipleOf (beside a bound)")
    if "type" not in keys and not at.endswith(".propertyNames"):  # (names are strings: enforced there)
        found += [f"{at}.{k} (without a type)" for k in _NEED_TYPE if k in keys]
    return found


def unenforced_keywords(schema: Any) -> list[str]:
    """Where `schema` uses a keyword the grammar would not enforce (uniqueItems counts when true;
    a pattern, or a patternProperties name, counts with what `unenforced_regex` finds in it); a
    property merely named like one ("not", "if") is not one."""
    found: list[str] = []
    todo = [(schema, "$")]
    while todo:
        node, at = todo.pop()
        if isinstance(node, dict):
            found += [f"{at}.{k}" for k in _UNENFORCED if k in node]
            if node.get("uniqueItems") is True:
                found.append(f"{at}.uniqueItems")
            found += _unenforced_combinations(node, at, schema)
            if isinstance(node.get("pattern"), str) and (why := unenforced_schema_pattern(node["pattern"])):
                found.append(f"{at}.pattern ({why})")
            if isinstance(node.get("patternProperties"), dict):
                found += [f"{at}.patternProperties[{json.dumps(name)}] ({why})" for name in node["patternProperties"]
                          if isinstance(name, str) and (why := unenforced_schema_pattern(name))]
            for k, v in node.items():
                if k in ("const", "enum", "default", "examples"):  # values, not schemas
                    continue
                if k in _NAMED_SCHEMAS and isinstance(v, dict):
                    todo += [(sub, f"{at}.{k}.{name}") for name, sub in v.items()]
                else:
                    todo.append((v, f"{at}.{k}"))
        elif isinstance(node, list):
            todo += [(v, f"{at}[{i}]") for i, v in enumerate(node)]
    return sorted(found)


def build_grammar(spec: StructuredOutputsParams) -> Any:
    """The spec as an (uncompiled, tokenizer-free) xgrammar Grammar; a ValueError naming the field
    when the schema / regex / grammar does not parse."""
    xgr = xgrammar()
    kind = spec.kind
    if kind == "json":
        try:
            parsed = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        except ValueError:
            parsed = None  # not JSON: xgrammar's error below names it
        bad = unenforced_keywords(parsed)
        if bad:
            raise ValueError(f"structured_outputs.json uses {', '.join(bad[:4])}: a keyword the grammar does not enforce "
                             f"({UNENFORCED_WHAT}), so the output could break it")
    if kind == "regex" and isinstance(spec.regex, str) and (why := unenforced_regex(spec.regex)):
        raise ValueError(f"structured_outputs.regex uses {why}, which the grammar does not enforce ({UNENFORCED_WHAT}), "
                         "so the output could break it")
    try:
        if kind == "json":
            # (not JSON: the text as sent, for xgrammar's error to name)
            schema = json.dumps(_schema_with_explicit_dots(parsed)) if parsed is not None else spec.json
            return xgr.Grammar.from_json_schema(schema, strict_mode=True, **_JSON_LAYOUT)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', **_JSON_LAYOUT)
        if kind == "regex":
            return xgr.Grammar.from_regex(explicit_dots(spec.regex, _REGEX_DOT))
        if kind == "choice":
            # an EBNF alternation of string literals (JSON string escapes are EBNF's too)
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.grammar)
        return xgr.Grammar.from_structural_tag(spec.structural_tag)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / its own types for a bad spec
        raise ValueError(f"structured_outputs.{kind} does not compile: {str(e).strip()[:300]}") from None


_tokenizer_verdicts: weakref.WeakKeyDictionary[Tokenizer, str] = weakref.WeakKeyDictionary()


def check_tokenizer(tok: Tokenizer | None) -> None:
    """Refuse a tokenizer whose decoded text is not the concatenation of its tokens' texts (the
    verdict is cached: serializing a 151k vocabulary to read its decoder takes ~0.1 s)."""
    if tok is None:
        raise ValueError("structured_outputs needs a tokenizer (the engine runs without one)")
    why = _tokenizer_verdicts.get(tok)
    if why is None:
        bad = sorted(_decoder_kinds(json.loads(tok.tok.to_str()).get("decoder")) - _CONCAT_DECODERS)
        why = _tokenizer_verdicts[tok] = (
            f"structured_outputs is not supported for this checkpoint's tokenizer: its decoder {bad[0]} does not decode "
            "text as the concatenation of its tokens (byte-level BPE, byte-fallback and raw vocabularies do)") if bad else ""
    if why:
        raise ValueError(why)


def _decoder_kinds(decoder: dict[str, Any] | None) -> set[str]:
    if decoder is None:
        return set()
    if decoder.get("type") == "Sequence":
        return set().union(*(_decoder_kinds(d) for d in decoder.get("decoders", [])))
    return {decoder.get("type", "?")}


@dataclass(slots=True)
class Controls:
    """One request's controls, compiled."""

    grammar: Any = None  # xgrammar CompiledGrammar
    allowed: np.ndarray | None = None  # uint32 bitmask row of allowed_token_ids
    banned: np.ndarray | None = None  # single-token bad words, always banned
    bad_seqs: list[tuple[int, ...]] = field(default_factory=list)  # multi-token bad words
    bias_ids: torch.Tensor | None = None
    bias_vals: torch.Tensor | None = None
    matchers: dict[int, list[Any]] = field(default_factory=dict)  # sample index -> [matcher, tokens consumed]

    @property
    def masks(self) -> bool:
        return self.grammar is not None or self.allowed is not None or self.banned is not None or bool(self.bad_seqs)


@dataclass(slots=True)
class TokenMask:
    """What the sampler applies to one step's logits rows (engine/sampler.py `apply_token_mask`)."""

    rows: list[int]  # rows that have a bitmask row, in order
    bitmask: torch.Tensor  # int32 [len(rows), ceil(vocab / 32)]; bit t of a row set = token t allowed
    bias_rows: torch.Tensor | None = None  # long [k]: logit_bias entries as (row, token, value)
    bias_ids: torch.Tensor | None = None
    bias_vals: torch.Tensor | None = None
    failed: dict[int, str] = field(default_factory=dict)  # row -> why its grammar rejected its own tokens

    def take(self, src: list[int]) -> TokenMask:
        """The mask for rows `src[k]` placed at row k (the n samples of a prompt that just forked
        share its row)."""
        where = {r: i for i, r in enumerate(self.rows)}
        rows = [k for k, r in enumerate(src) if r in where]
        bitmask = self.bitmask[[where[src[k]] for k in rows]] if rows else self.bitmask[:0]
        out = TokenMask(rows, bitmask, failed={k: self.failed[r] for k, r in enumerate(src) if r in self.failed})
        if self.bias_rows is not None:
            pos = torch.tensor(src)
            picks = (pos[:, None] == self.bias_rows[None, :]).nonzero()  # (new row, entry)
            out.bias_rows, out.bias_ids, out.bias_vals = picks[:, 0], self.bias_ids[picks[:, 1]], self.bias_vals[picks[:, 1]]
        return out


class StructuredOutput:
    """The engine's mask stage: per-request controls and the per-step bitmask job."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.width = (vocab_size + 31) // 32
        self.eos_token_ids = sorted(t for t in eos_token_ids if t < vocab_size)
        self._compiler: Any = None
        self._json_safe: np.ndarray | None = None  # bitmask row: tokens free of raw control characters
        self._compiled: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()  # the compiler and its cache (the server may compile from another thread)
        self._controls: weakref.WeakKeyDictionary[Request, Controls] = weakref.WeakKeyDictionary()
        self._pool: ThreadPoolExecutor | None = None

    # ---- admission -------------------------------------------------------------------------
    def prepare(self, params: SamplingParams, stop_ids: Collection[int] = ()) -> Controls | None:
        """The compiled controls of `params` (None if it sets none); a ValueError naming the field
        for a token id out of the vocabulary, a spec that does not compile, or allowed_token_ids
        that bad_words (and, under min_tokens, the stop ids `stop_ids`) leave empty."""
        if not params.has_controls:
            return None
        ctl = Controls()
        v = self.vocab_size
        if params.logit_bias is not None:
            bad = next((t for t in params.logit_bias if t >= v), None)
            if bad is not None:
                raise ValueError(f"logit_bias token ids must be in [0, {v - 1}], got {bad}")
            ctl.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            ctl.bias_vals = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        if params.allowed_token_ids is not None:
            bad = next((t for t in params.allowed_token_ids if t >= v), None)
            if bad is not None:
                raise ValueError(f"allowed_token_ids must be in [0, {v - 1}], got {bad}")
            ctl.allowed = np.zeros(self.width, dtype=np.uint32)
            _set_bits(ctl.allowed, np.array(params.allowed_token_ids, dtype=np.int64))
        single: set[int] = set()
        if params.bad_words is not None:
            single, ctl.bad_seqs = self._bad_word_ids(params.bad_words)
            if single:
                ctl.banned = np.array(sorted(single), dtype=np.int64)
        if params.allowed_token_ids is not None:
            # every logit -inf: the sample would be garbage (token 0, NaN logprobs)
            left = set(params.allowed_token_ids) - single
            if not left:
                raise ValueError(f"allowed_token_ids {sorted(set(params.allowed_token_ids))[:8]} are all banned by bad_words: "
                                 "nothing could be sampled")
            if stop_ids and left <= set(stop_ids):
                raise ValueError(f"allowed_token_ids {sorted(left)[:8]} left by bad_words are all stop or EOS tokens, which "
                                 f"min_tokens ({params.min_tokens}) forbids: nothing could be sampled")
        so = params.structured_outputs
        if so is not None:
            ctl.grammar = self.compile(so)
            if so.kind in ("json", "json_object"):
                # xgrammar's rule for a string with maxLength / minLength admits raw control
                # characters, which JSON forbids (and our JSON layout has no raw whitespace either)
                safe = self._json_safe
                assert safe is not None
                ctl.allowed = safe.copy() if ctl.allowed is None else ctl.allowed & safe
        return ctl

    def attach(self, req: Request, ctl: Controls | None) -> None:
        if ctl is not None:
            self._controls[req] = ctl

    def compile(self, spec: StructuredOutputsParams) -> Any:
        key = spec.key()
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
            grammar = build_grammar(spec)
            if self._compiler is None:
                self._compiler = self._build_compiler()
            try:
                compiled = self._compiler.compile_grammar(grammar)
            except RuntimeError as e:  # xgrammar's own checks failing on a spec it parsed (seen on some patterns)
                raise ValueError(f"structured_outputs.{spec.kind} does not compile (xgrammar: "
                                 f"{str(e).strip()[:300]})") from None
            _check_admits_output(compiled, spec)
            self._compiled[key] = compiled
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
            return compiled

    def _build_compiler(self) -> Any:
        """xgrammar's view of the vocabulary: each token's text as the tokenizer stores it (the
        byte-level / byte-fallback encoding xgrammar decodes), special tokens blanked so a grammar
        never emits them as text (the stop tokens end the output), ids past the tokenizer up to
        the logits' width never allowed."""
        xgr = xgrammar()
        tok = self.tokenizer
        check_tokenizer(tok)
        assert tok is not None
        # how xgrammar reads the stored token strings: GPT-2 byte-level, sentencepiece byte
        # fallback (<0x0A>, with the metaspace prefix), or as they are
        kinds = _decoder_kinds(json.loads(tok.tok.to_str()).get("decoder"))
        vocab_type = (xgr.VocabType.BYTE_LEVEL if "ByteLevel" in kinds else
                      xgr.VocabType.BYTE_FALLBACK if "ByteFallback" in kinds else xgr.VocabType.RAW)
        n = min(tok.vocab_size, self.vocab_size)
        vocab = [tok.tok.id_to_token(i) or "" for i in range(n)]
        for i in tok.special_ids:
            if i < n:
                vocab[i] = ""
        info = xgr.TokenizerInfo(vocab, vocab_type, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids,
                                 add_prefix_space="Metaspace" in kinds)
        safe = np.zeros(self.width, dtype=np.uint32)
        clean = [i for i, b in enumerate(info.decoded_vocab) if b and not any(c < 0x20 for c in b)]
        _set_bits(safe, np.array(clean + self.eos_token_ids, dtype=np.int64))
        self._json_safe = safe
        return xgr.GrammarCompiler(info, max_threads=1)

    def _bad_word_ids(self, words: list[str]) -> tuple[set[int], list[tuple[int, ...]]]:
        """Each word as tokens, alone and after a space (vLLM's rule: the spaced form counts when
        it is a different token sequence of the same length)."""
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer (the engine runs without one)")
        single: set[int] = set()
        seqs: list[tuple[int, ...]] = []
        for w in words:
            plain = self.tokenizer.encode(w, add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + w.lstrip(" "), add_special_tokens=False)
            forms = [plain] + ([spaced] if len(spaced) == len(plain) and spaced != plain else [])
            for ids in forms:
                if len(ids) == 1:
                    single.add(ids[0])
                elif ids and tuple(ids) not in seqs:
                    seqs.append(tuple(ids))
        return single, seqs

    # ---- the step ----------------------------------------------------------------------------
    def start(self, seqs: list[Sequence]) -> Future | None:
        """Start filling the masks of the rows sampled this step (row j = seqs[j]) on the worker
        thread; None when no row has controls (the common case costs one dict lookup per row)."""
        if not self._controls:
            return None
        picks = [(j, s, c) for j, s in enumerate(seqs) if (c := self._controls.get(s.request)) is not None]
        if not picks:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="cuttle-mask")
        return self._pool.submit(self._fill, picks)

    def _fill(self, picks: list[tuple[int, Sequence, Controls]]) -> TokenMask:
        masked = [(j, s, c) for j, s, c in picks if c.masks]
        bitmask = torch.full((len(masked), self.width), -1, dtype=torch.int32)
        bits = bitmask.numpy().view(np.uint32)
        failed: dict[int, str] = {}
        for k, (j, seq, ctl) in enumerate(masked):
            # the output is read from its end only (new tokens, a bad word's prefix): no copy of it
            ids, start = seq.token_ids, seq.num_prompt_tokens
            if ctl.grammar is not None:
                err = self._fill_grammar(ctl, seq.index, ids, start, bitmask, k)
                if err is not None:
                    failed[j] = err
            if ctl.allowed is not None:
                bits[k] &= ctl.allowed
            if ctl.banned is not None:
                _clear_bits(bits[k], ctl.banned)
            if ctl.bad_seqs:
                n = len(ids)
                hit = [s[-1] for s in ctl.bad_seqs if n - start >= len(s) - 1 and tuple(ids[n - len(s) + 1 :]) == s[:-1]]
                if hit:
                    _clear_bits(bits[k], np.array(hit, dtype=np.int64))
        mask = TokenMask([j for j, _, _ in masked], bitmask, failed=failed)
        biased = [(j, c) for j, _, c in picks if c.bias_ids is not None]
        if biased:
            mask.bias_rows = torch.cat([torch.full((len(c.bias_ids),), j, dtype=torch.long) for j, c in biased])
            mask.bias_ids = torch.cat([c.bias_ids for _, c in biased])
            mask.bias_vals = torch.cat([c.bias_vals for _, c in biased])
        return mask

    def _fill_grammar(self, ctl: Controls, index: int, ids: list[int], start: int, bitmask: torch.Tensor, k: int) -> str | None:
        entry = ctl.matchers.get(index)
        if entry is None:
            entry = ctl.matchers[index] = [xgrammar().GrammarMatcher(ctl.grammar, max_rollback_tokens=0), 0]
        matcher, done = entry
        for t in ids[start + done :]:  # the output tokens sampled since the last fill (preemption keeps them all)
            if not matcher.accept_token(t):
                return f"token {t} at output position {done} is not allowed by the request's grammar"
            done += 1
        entry[1] = done
        matcher.fill_next_token_bitmask(bitmask, k)
        return None


def _check_admits_output(compiled: Any, spec: StructuredOutputsParams) -> None:
    """A grammar whose first step allows no token (`root ::= root`: no finite string) would fail
    its request at the first sample: refused at compile time instead, naming the field."""
    xgr = xgrammar()
    matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=0)
    mask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(mask, 0)
    if not bool(mask.any()):
        raise ValueError(f"structured_outputs.{spec.kind} admits no output: its first token can be none "
                         "(a rule with no finite expansion?)")


def _set_bits(row: np.ndarray, ids: np.ndarray) -> None:
    np.bitwise_or.at(row, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))


def _clear_bits(row: np.ndarray, ids: np.ndarray) -> None:
    np.bitwise_and.at(row, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))


# ---- tool calls ----------------------------------------------------------------------------------
_CALL_END = "}\n</tool_call>"


def tool_call_structure(fmt: str, choice: str, name: str | None, tools: list[dict[str, Any]] | None,
                        tokenizer: Tokenizer | None) -> StructuredOutputsParams | None:
    """The structured output that makes a chat request's tool calls parse (hermes format here):
    - `named` / `required`: the server has already written the call's opening for the model
      (engine/server/chat.py `_forced_prefix`: up to `"arguments":` / `"name":`); the rest is
      the function's name (required: one of the tools), its arguments under the tool's JSON
      schema, and the call's end; then only EOS. One call per turn.
    - `auto`: free text, but once the model writes `<tool_call>` the call follows the grammar
      (xgrammar's triggered tags).
    The qwen3_coder format gets the same three cases in its XML form (`_qwen3_coder_calls`).
    None when there is nothing to enforce: no tools, `none`, xgrammar missing or a
    tokenizer it cannot serve (tool calls then work as they did before structured output: prefix
    forcing, no guarantee that the call parses)."""
    if not tools or choice == "none" or fmt not in ("hermes", "qwen3_coder"):
        return None
    try:
        xgrammar()
        check_tokenizer(tokenizer)
    except ValueError:
        return None

    def args(t: dict[str, Any]) -> dict[str, Any]:
        schema = _schema_with_explicit_dots(t["function"].get("parameters") or {"type": "object"})
        # one space at most between JSON tokens (a code model otherwise writes indentation forever)
        return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}

    def call_rest(t: dict[str, Any]) -> dict[str, Any]:  # after `{"name":`
        return {"type": "sequence", "elements": [
            {"type": "const_string", "value": f' {json.dumps(t["function"]["name"])}, "arguments": '}, args(t),
            {"type": "const_string", "value": _CALL_END}]}

    if fmt == "qwen3_coder":
        fmt_ = _qwen3_coder_calls(choice, name, tools)
    elif choice == "named":
        [tool] = [t for t in tools if t["function"]["name"] == name]
        fmt_ = {"type": "sequence", "elements": [{"type": "const_string", "value": " "}, args(tool),
                                                  {"type": "const_string", "value": _CALL_END}]}
    elif choice == "required":
        fmt_ = call_rest(tools[0]) if len(tools) == 1 else {"type": "or", "elements": [call_rest(t) for t in tools]}
    else:
        fmt_ = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [
            {"type": "tag", "begin": f'<tool_call>\n{{"name": {json.dumps(t["function"]["name"])}, "arguments": ',
             "content": args(t), "end": _CALL_END} for t in tools]}
    return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": fmt_}))


_XML_CALL_END = "\n</function>\n</tool_call>"


def _qwen3_coder_calls(choice: str, name: str | None, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Qwen3-Coder's XML calls (`<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>
    ...</function>\n</tool_call>`): the parameters follow the tool's JSON schema in xgrammar's
    `qwen_xml` style (schema order, required keys present, each value of its type; string values
    are raw text). `named` continues after the server's `<function=NAME>\n`, `required` after
    `<function=` (chat.py `_forced_prefix`); `auto` applies once the model opens a call."""

    def params(t: dict[str, Any]) -> dict[str, Any]:
        schema = t["function"].get("parameters") or {"type": "object"}
        return {"type": "json_schema", "json_schema": schema, "style": "qwen_xml", "max_whitespace_cnt": 1}

    if choice == "named":
        [tool] = [t for t in tools if t["function"]["name"] == name]
        return {"type": "sequence", "elements": [params(tool), {"type": "const_string", "value": _XML_CALL_END}]}
    if choice == "required":
        alts = [{"type": "sequence", "elements": [{"type": "const_string", "value": f'{t["function"]["name"]}>\n'}, params(t),
                                                  {"type": "const_string", "value": _XML_CALL_END}]} for t in tools]
        return alts[0] if len(alts) == 1 else {"type": "or", "elements": alts}
    return {"type": "triggered_tags", "triggers": ["<tool_call>\n<function="], "tags": [
        {"type": "tag", "begin": f'<tool_call>\n<function={t["function"]["name"]}>\n', "content": params(t), "end": _XML_CALL_END}
        for t in tools]}
