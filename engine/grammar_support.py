"""What xgrammar (0.2.8, 0.2.9) enforces of a spec, and how the engine hands a spec to it.

xgrammar compiles some JSON-schema keywords, keyword combinations and regex constructs without
enforcing them (with a log warning at best), and reads a few regex spellings differently from
Python's `re`. Each case here was measured to let an output through that breaks the spec. This
module owns the two answers:
- the refusals: `unenforced_regex` (regex specs and schema patterns), `unenforced_schema_pattern`
  (schema patterns only), `unenforced_keywords` (a whole schema), and `UNENFORCED_WHAT` for the
  messages. engine/structured_output.py refuses a spec they flag; the server's strict tools too;
- the rewrites: `explicit_dots` (a regex's "." as a class, \\xHH as \\u00HH) and
  `schema_with_explicit_dots` (the same for every pattern of a schema).
Two seeded property tests in tests/engine/test_structured_output.py check what is served against
`re` and `jsonschema`; docs/server.md lists the cases.
"""
from __future__ import annotations

import json
import re
from typing import Any

# JSON-schema keywords xgrammar compiles without enforcing (measured on xgrammar 0.2.8: a schema
# with each accepted an instance it forbids); a schema using one is refused rather than half-kept
_UNENFORCED = ("if", "then", "else", "not", "dependentRequired", "dependentSchemas", "dependencies", "contains",
               "minContains", "maxContains",
               # kept alone at best; beside other object keywords a property's schema or additionalProperties
               # false was lost ({"properties": {"b": {}}, "patternProperties": {"b$": {"type": "boolean"}}}
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
                   "min/maxProperties, oneOf unless its branches differ in type or in a required const, a "
                   "constraint beside enum / const / anyOf / oneOf / $ref, a required name not in properties, "
                   "minLength / maxLength / pattern beside another string rule, multipleOf but an integer's alone "
                   "on integers, a string / number / array bound without a type; in a pattern, lookarounds, a ^ "
                   "that text can precede or a $ that text can follow, a ] first in a class, a \" or \\ named in a "
                   "schema's pattern, and escapes other than \\d \\w \\s \\D \\W \\S \\n \\r \\t \\f \\v \\a \\e \\x \\u")

# What "." may match, spelled out for xgrammar, whose "." also matches a newline: Python's "." in a
# `regex` spec (its outputs are checked with re), ECMA-262's in a JSON-schema pattern (the line
# terminators \n \r \u2028 \u2029 excluded), which is within Python's too
REGEX_DOT = "[^\\n]"
SCHEMA_DOT = "[^\\n\\r\\u2028\\u2029]"


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


def schema_with_explicit_dots(node: Any) -> Any:
    """A copy of the JSON schema `node` with explicit_dots applied to every pattern and
    patternProperties name (values under const / enum / default / examples are data: kept)."""
    if isinstance(node, list):
        return [schema_with_explicit_dots(v) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k in ("const", "enum", "default", "examples"):
            out[k] = v
        elif k == "pattern" and isinstance(v, str):
            out[k] = explicit_dots(v, SCHEMA_DOT)
        elif k in _NAMED_SCHEMAS and isinstance(v, dict):
            rename = k == "patternProperties"
            out[k] = {(explicit_dots(name, SCHEMA_DOT) if rename else name): schema_with_explicit_dots(sub)
                      for name, sub in v.items()}
        else:
            out[k] = schema_with_explicit_dots(v)
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
    string rule is kept); multipleOf other than an integer on an integer type, or beside a bound;
    a keyword of _NEED_TYPE without a "type"."""
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
    """Where `schema` uses a keyword, or a combination of keywords (`_unenforced_combinations`), the
    grammar would not enforce (uniqueItems counts when true; a pattern, or a patternProperties name,
    counts with what `unenforced_schema_pattern` finds in it); a property merely named like one
    ("not", "if") is not one."""
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
