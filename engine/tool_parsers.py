"""Tool calls parsed out of a model's text: the Qwen3 / Hermes `<tool_call>{json}</tool_call>`
format, the Qwen3-Coder `<tool_call><function=NAME><parameter=P>value</parameter></function>`
format (and Seed-OSS's, the same inside `<seed:tool_call>`, `seed_oss`) and GLM-4.5's `<tool_call>NAME<arg_key>P</arg_key><arg_value>value</arg_value></tool_call>`
(GLM-4.5 / 4.6 put newlines between the tags, GLM-4.7 none: both parse), and DeepSeek's, whose
calls sit in a `<｜tool▁calls▁begin｜>` ... `<｜tool▁calls▁end｜>` section, each
`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>` (DeepSeek-V3,
`deepseek_v3`) or `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>` (DeepSeek-V3.1,
`deepseek_v31`); and MiniMax-M2's, `<invoke name="NAME"><parameter name="P">value</parameter></invoke>`
calls in a `<minimax:tool_call>` section (`minimax_m2`): the section markers are neither content
nor calls; and Mistral's (`mistral`), which has no closing tag: `[TOOL_CALLS]NAME[ARGS]{json}` per
call (tokenizers v11 on, Devstral Small 2507, Mistral Small 3.2; v11 may write `[CALL_ID]ID` before
`[ARGS]`, and that id is the call's) or one `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`
list (v3 / v7: Mistral-7B v0.3, Mixtral-8x22B, Mistral Small 3.1, Devstral Small 2505), a call
ending where its JSON value does. Mistral's templates want call ids of 9 letters or digits, so its
calls get such ids; and Llama 3.1 / 3.2 / 3.3's (`llama3_json`): the output itself is
`{"name": NAME, "parameters": {...}}` (several joined by `;`), after an optional `<|python_tag|>`,
with no markers at all, so a call is only read at the start of the output (JSON later in an
answer is content); and Kimi-K2's (`kimi_k2`): `<|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>{json}<|tool_call_end|>` calls in a `<|tool_calls_section_begin|>`
section, the model's `functions.NAME:IDX` being the call's id (Kimi's templates write it back);
and Granite 3.x's (`granite`): `<|tool_call|>` and a JSON list of `{"name", "arguments"}` calls
(or one such object), ending where its JSON value does, as Mistral's list; and gpt-oss's (`openai`):
the harmony reasoning parser (engine/harmony.py) hands each message to `functions.NAME` on as
`<|start|>assistant to=functions.NAME<|channel|>commentary<|message|>ARGS<|call|>`, read here.
Whole or streamed.

Owns only text -> (content, tool calls). The streaming parser never emits text that could still
turn out to be part of a tool call, and its deltas always add up to the whole-text parse, however
the text is split. Every parsed call keeps the exact block the model wrote (`ToolCall.text`,
`<tool_call>` to `</tool_call>`), so a caller that must reproduce the model's tokens (an agent's
next turn, an RL trajectory) never has to re-serialize the arguments.

Streamed, a call is sent whole once its block closes, or, with `incremental` (for calls the
tool-call grammar generates, whose text is known to parse), as it is written: its id and name
once its opening is complete, then its arguments piece by piece (engine/tool_args.py), adding up
to the whole-text parse's string (Llama 3's, for a call opened exactly as the grammar writes it;
any other is read whole). A call cut off before its end (max_tokens) is then a call with
its arguments so far, `complete` false, in the streamed and the whole-text result alike
(`StreamingToolParser.feed_deltas(text, final=True)` is that whole-text result).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from cuttle.engine.harmony import CALL_OPENING
from cuttle.engine.reasoning_parsers import partial_suffix
from cuttle.engine.tool_args import GlmArguments, JsonArguments, MinimaxArguments, XmlArguments

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_MS_OPEN, _MS_ARGS, _MS_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_DS_OPEN, _DS_CLOSE, _DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
# format -> (a call's opening, its closing), and the markers of a section around the calls
TAGS = {"hermes": (OPEN, CLOSE), "qwen3_coder": (OPEN, CLOSE), "seed_oss": ("<seed:tool_call>", "</seed:tool_call>"),
        "glm45": (OPEN, CLOSE),
        "deepseek_v3": (_DS_OPEN, _DS_CLOSE), "deepseek_v31": (_DS_OPEN, _DS_CLOSE), "minimax_m2": ("<invoke name=", "</invoke>"),
        "mistral": (_MS_OPEN, ""),  # (a Mistral call ends where its JSON value does: _block_end)
        "granite": ("<|tool_call|>", ""),  # (likewise)
        "llama3_json": ("{", ""),  # (read at the output's start only: _LlamaCalls)
        "kimi_k2": ("<|tool_call_begin|>", "<|tool_call_end|>"),
        "openai": (CALL_OPENING, "<|call|>")}
SECTIONS = {"deepseek_v3": ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
            "deepseek_v31": ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
            "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>"),
            "kimi_k2": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")}
_DS_V3_CALL = re.compile(r"\s*function" + re.escape(_DS_SEP) + r"([^\n]+)\n```json\n(.*)\n```\s*$", re.S)
# Kimi-K2: `functions.NAME:IDX` (the id), then the arguments
_KIMI_CALL = re.compile(r"\s*((?:functions\.)?([^\s<:]+):\d+)\s*<\|tool_call_argument_begin\|>(.*)$", re.S)
# gpt-oss (the harmony parser's canonical call): NAME, then the arguments
_HARMONY_CALL = re.compile(r"([^\s<]+)<\|channel\|>commentary<\|message\|>(.*)$", re.S)
_DS_V31_CALL = re.compile(r"\s*([^\s<]+?)\s*" + re.escape(_DS_SEP) + r"(.*)$", re.S)
# MiniMax-M2: the rest of `<invoke name=` up to its parameters, and each parameter (one whitespace
# character beside its tags is a separator, as for qwen3_coder)
_MM_NAME = re.compile(r'\s*"([^"\n]+)"\s*>')
_MM_PARAM = re.compile(r'<parameter name="([^"\n]+)">[ \t\r\n]?(.*?)[ \t\r\n]?</parameter>', re.S)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
# One whitespace character next to each tag is the format's separator, not the value's: the
# template writes a newline there, and the structured-output grammar (xgrammar's qwen_xml style)
# admits any one of space / tab / CR / LF, so stripping exactly one keeps a constrained string
# within its schema's maxLength.
_PARAM = re.compile(r"<parameter=([^>\n]+)>[ \t\r\n]?(.*?)[ \t\r\n]?</parameter>", re.S)

# GLM: the name runs to the first newline or tag; keys hold no tag; one whitespace character beside
# each value tag is a separator, as for qwen3_coder (xgrammar's glm_xml style admits it there and
# leaves it out of the value's schema bounds)
_GLM_NAME = re.compile(r"\s*([^\s<]+)\s*$")
_GLM_PAIR = re.compile(r"<arg_key>([^<]*)</arg_key>\s*<arg_value>[ \t\r\n]?(.*?)[ \t\r\n]?</arg_value>", re.S)

_MS_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}$")  # Mistral's function names (mistral_common's rule, with dots)

_PY_TAG = "<|python_tag|>"
_LLAMA_CALL = re.compile(r'\{\s*"name"\s*:')  # what makes a JSON object at the start a (perhaps broken) call
# a Llama 3 call as the tool-call grammar writes it (structured_output.py `_SHAPES`): the trigger,
# then the name and the arguments' key exactly so, so its arguments can stream as written
_LLAMA_TRIGGER = '{"name": '
_LLAMA_OPENING = re.compile(r'\{"name": ("(?:[^"\\\x00-\x1f]|\\.)*"), "parameters": ')

PARSERS = ("hermes", "qwen3_coder", "seed_oss", "glm45", "deepseek_v3", "deepseek_v31", "minimax_m2", "mistral", "granite", "llama3_json", "kimi_k2",
           "openai")
_STREAMED_ARGUMENTS = ("hermes", "qwen3_coder", "seed_oss", "glm45", "deepseek_v3", "deepseek_v31", "minimax_m2")  # formats whose arguments stream as written (tool_args.py)


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (the OpenAI wire format)
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])
    text: str = ""  # the model's exact block, "<tool_call>...</tool_call>" (not sent on the wire)
    complete: bool = True  # False: cut off before its end (its arguments are those written so far)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


def mistral_call_id() -> str:
    """A call id Mistral's templates accept: 9 letters or digits (they refuse any other)."""
    return uuid.uuid4().hex[:9]


# markers of tool-call formats cuttle does not parse -> what they are (a template writing one of
# them and none of ours teaches its model a format the parsers would never find a call in)
FOREIGN_FORMATS = {
    "<|python_tag|>": "Llama's <|python_tag|> calls",
}


def is_harmony_template(chat_template: str | None) -> bool:
    """Whether the template writes gpt-oss's harmony messages (its output is then read by the
    `gpt_oss` reasoning parser and the `openai` tool-call format)."""
    return bool(chat_template) and "<|channel|>" in chat_template and "<|message|>" in chat_template


def parser_for_template(chat_template: str | None) -> str:
    """The format a checkpoint's chat template teaches its model."""
    if is_harmony_template(chat_template):
        return "openai"
    if chat_template and "<arg_key>" in chat_template:
        return "glm45"
    if chat_template and "<seed:tool_call>" in chat_template:
        return "seed_oss"
    if chat_template and "<｜tool▁calls▁begin｜>" in chat_template:
        return "deepseek_v3" if "```json" in chat_template else "deepseek_v31"
    if chat_template and "<minimax:tool_call>" in chat_template:
        return "minimax_m2"
    if chat_template and "<|tool_calls_section_begin|>" in chat_template:
        return "kimi_k2"
    if chat_template and _MS_OPEN in chat_template:
        return "mistral"
    if chat_template and "<|tool_call|>" in chat_template:
        return "granite"
    if chat_template and "<|start_header_id|>" in chat_template and '"parameters": ' in chat_template \
            and "<tool_call>" not in chat_template:
        return "llama3_json"  # Llama 3.1 / 3.2 / 3.3: {"name": ..., "parameters": ...} as the whole reply
    return "qwen3_coder" if chat_template and "<function=" in chat_template else "hermes"


def foreign_tool_format(chat_template: str | None) -> str | None:
    """The tool-call format the template teaches when it is one cuttle does not parse, else None."""
    if not chat_template or "<tool_call>" in chat_template or parser_for_template(chat_template) != "hermes":
        return None
    return next((what for marker, what in FOREIGN_FORMATS.items() if marker in chat_template), None)


def _param_types(tools: list[dict[str, Any]] | None, name: str) -> dict[str, str]:
    for t in tools or []:
        f = t.get("function", t)
        if f.get("name") == name:
            return {k: v.get("type", "string") for k, v in (f.get("parameters") or {}).get("properties", {}).items()}
    return {}


_JSON_MARKS = re.compile(r'["\\{}\[\]]')  # the only characters that move a JSON scan's state


class _JsonScanner:
    """Finds the end of the JSON object or array opening at `start` (brackets matched, strings and
    escapes skipped) over a text that only grows: each call reads what is new since the last, so a
    streamed call's arguments are scanned once in all, not once a token."""

    __slots__ = ("start", "pos", "depth", "in_string", "escape")

    def __init__(self, start: int) -> None:
        self.start = self.pos = start
        self.depth, self.in_string, self.escape = 0, False, False

    def end(self, text: str, limit: int) -> int | None:
        """The value's end if it closes before `limit`, else None (the scan resumes there)."""
        pos = self.pos
        if self.escape and pos < limit:  # an escape cut at the last call's limit: its character
            pos, self.escape = pos + 1, False
        while True:
            m = _JSON_MARKS.search(text, pos, limit)
            if m is None:
                self.pos = limit
                return None
            c, pos = m.group(), m.end()
            if self.in_string:
                if c == "\\":
                    if pos < limit:
                        pos += 1  # the escaped character, whatever it is
                    else:
                        self.escape = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = pos
                    return pos


def _json_end(text: str, i: int, limit: int) -> int | None:
    """The end of the JSON object or array opening at text[i], or None when it does not close
    before `limit`."""
    return _JsonScanner(i).end(text, limit)


def _skip_space(text: str, i: int, limit: int) -> int:
    while i < limit and text[i].isspace():
        i += 1
    return i


def _block_end(text: str, start: int, fmt: str, final: bool, scans: dict[int, _JsonScanner] | None = None) -> int | None:
    """Where the call block opening at text[start] ends, or None while that is not known yet (or,
    `final`, an unterminated block). A tag format's block ends with its closing tag. A Mistral or
    Granite one ends where its JSON value does (a `[TOOL_CALLS]` inside one of its strings is text); one that
    cannot be a call (no JSON object or array where one must start, or one never closed) ends at
    the next `[TOOL_CALLS]`, decided only once that is certain, so the end is the same however the
    text is cut. `scans`: a streaming parser's scanners of JSON values begun, by where they start
    (resumed, not rescanned, as the text grows)."""
    opening, closing = TAGS[fmt]
    if closing:
        e = text.find(closing, start + len(opening))
        return None if e == -1 else e + len(closing)
    at = start + len(opening)
    nxt = text.find(opening, at)
    limit = nxt if nxt != -1 else len(text)
    i = _skip_space(text, at, limit)
    if i < limit and text[i] != "[" and fmt == "mistral":  # NAME[ARGS]{...}: the value after [ARGS]
        args = text.find(_MS_ARGS, at, limit)
        i = _skip_space(text, args + len(_MS_ARGS), limit) if args != -1 else limit
    if i < limit and text[i] in "{[":
        scan = (scans if scans is not None else {}).setdefault(i, _JsonScanner(i))
        e = scan.end(text, len(text))
        if e is not None:
            return e
        return (nxt if nxt != -1 else None) if final else None
    if i < limit:  # not a JSON value where one must start: malformed up to the next call
        return nxt if nxt != -1 else (len(text) if final else None)
    return nxt if nxt != -1 else None


def _llama_call(block: str) -> ToolCall | None:
    """One Llama 3 call, `{"name": NAME, "parameters": {...}}` (`arguments` taken too)."""
    obj = _json_object(block)
    if obj is None or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("parameters", obj.get("arguments", {}))
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args), text=block)


class _LlamaCalls:
    """Llama 3's calls at the start of the output, read as the text grows (`feed`): the calls, the
    malformed ones, where the content starts (`at`), and whether that is settled. Calls are JSON
    objects from the output's start (an optional `<|python_tag|>` before the first, `;` between
    them); the first text that is not one is content from there to the end. Unsettled (not
    `final`), the text may still hold more calls, so nothing from the content's start on can be sent
    yet. Each answer holds for any longer text, so the streamed parse equals the whole one; a
    call's JSON is scanned once in all (`_JsonScanner`), however many feeds it takes."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.malformed: list[str] = []
        self.at = 0  # text[:at] is the calls so far
        self.settled = False
        self._scan: _JsonScanner | None = None  # the JSON value being read

    def next_start(self, text: str) -> int:
        """Where the next call would start: after spaces, and a `;` between calls or a
        `<|python_tag|>` before the first."""
        n = len(text)
        j = _skip_space(text, self.at, n)
        if self.calls and text.startswith(";", j):
            return _skip_space(text, j + 1, n)
        if not self.calls and text.startswith(_PY_TAG, j):
            return _skip_space(text, j + len(_PY_TAG), n)
        return j

    def feed(self, text: str, final: bool, one: bool = False) -> None:
        """Read on from `at` (`one`: at most one more call)."""
        n = len(text)
        while not self.settled:
            if self._scan is None:
                j = self.next_start(text)
                rest = text[j:j + len(_PY_TAG)]
                if not final and (not rest or (not self.calls and _PY_TAG.startswith(rest) and j + len(rest) == n)):
                    return
                if not rest.startswith("{"):
                    self.settled = True
                    return
                self._scan = _JsonScanner(j)
            j = self._scan.start
            e = self._scan.end(text, n)
            if e is None and not final:
                return
            call = _llama_call(text[j:e]) if e is not None else None
            if call is None:  # JSON that is not a call is content; one that began as a call is malformed
                if _LLAMA_CALL.match(text, j):
                    self.malformed.append(text[j:e] if e is not None else text[j:])
                self.settled = True
                return
            self.calls.append(call)
            self.at, self._scan = e, None
            if one:
                return
        return


def _list_calls(block: str, opening: str, mistral_ids: bool) -> list[ToolCall] | None:
    """The calls of `opening` then a JSON list of `{"name", "arguments"}` objects (or one such
    object), each call's text its own element. `mistral_ids`: a 9-character id an element carries
    is the call's, and calls without one get such ids (Mistral's templates demand them)."""
    try:
        items = json.loads(block[len(opening):])
    except (json.JSONDecodeError, RecursionError):  # (too deeply nested JSON: RecursionError)
        return None
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list) or not items:
        return None
    calls, at = [], len(opening)
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", {})
        if not isinstance(args, (dict, str)):
            return None
        start = block.index("{", at)
        end = _json_end(block, start, len(block))
        assert end is not None  # the list parsed, so each element closes
        call = ToolCall(item["name"], args if isinstance(args, str) else json.dumps(args), text=block[start:end])
        if mistral_ids:
            cid = item.get("id")
            call.id = cid if isinstance(cid, str) and len(cid) == 9 and cid.isalnum() else mistral_call_id()
        calls.append(call)
        at = end
    return calls


def _mistral_calls(block: str) -> list[ToolCall] | None:
    """The calls of one Mistral block (`[TOOL_CALLS]` to the end of its JSON value), each with its
    exact text: the block for a `NAME[ARGS]{...}` call, its own element of a list."""
    body = block[len(_MS_OPEN):]
    if body.lstrip().startswith("["):  # v3 / v7: one list of {"name", "arguments"} objects
        return _list_calls(block, _MS_OPEN, mistral_ids=True)
    head, sep, raw = body.partition(_MS_ARGS)
    name, _, cid = head.partition(_MS_CALL_ID)
    name, cid = name.strip(), cid.strip()
    args = _json_object(raw) if sep and _MS_NAME.match(name) else None
    if args is None:
        return None
    return [ToolCall(name, json.dumps(args), id=cid if cid.isalnum() else mistral_call_id(), text=block)]


def _json_object(text: str) -> dict[str, Any] | None:
    """`text` as the JSON object it holds, or None (not JSON, or JSON of another kind)."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):  # (too deeply nested JSON: RecursionError)
        return None
    return value if isinstance(value, dict) else None


def _parse_block(body: str, fmt: str, tools: list[dict[str, Any]] | None) -> ToolCall | None:
    if fmt == "openai":
        m = _HARMONY_CALL.match(body)
        args = _json_object(m.group(2)) if m is not None else None
        return None if args is None else ToolCall(m.group(1), json.dumps(args))
    if fmt == "kimi_k2":
        m = _KIMI_CALL.match(body)
        args = _json_object(m.group(3)) if m is not None else None
        return None if args is None else ToolCall(m.group(2), json.dumps(args), id=m.group(1))
    if fmt in ("deepseek_v3", "deepseek_v31"):
        m = (_DS_V3_CALL if fmt == "deepseek_v3" else _DS_V31_CALL).match(body)
        args = _json_object(m.group(2)) if m is not None else None
        return None if args is None else ToolCall(m.group(1).strip(), json.dumps(args))
    if fmt == "hermes":
        try:
            obj = json.loads(body.strip())
        except (json.JSONDecodeError, RecursionError):  # (too deeply nested JSON: RecursionError)
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))
    if fmt == "minimax_m2":
        n = _MM_NAME.match(body)
        if n is None:
            return None
        name, pairs = n.group(1).strip(), _MM_PARAM.findall(body, n.end())
    elif fmt == "glm45":
        first = body.find("<arg_key>")
        n = _GLM_NAME.match(body[: first if first != -1 else len(body)])
        if n is None:
            return None
        name, pairs = n.group(1), _GLM_PAIR.findall(body, first if first != -1 else len(body))
    else:
        m = _FUNCTION.search(body)
        if m is None:
            return None
        name, pairs = m.group(1).strip(), _PARAM.findall(m.group(2))
    types = _param_types(tools, name)
    args: dict[str, Any] = {}
    for pname, raw in pairs:
        pname = pname.strip()
        value: Any = raw
        if types.get(pname, "string") != "string":
            try:
                value = json.loads(raw)
            except (json.JSONDecodeError, RecursionError):  # (too deeply nested JSON: RecursionError)
                value = raw
        args[pname] = value
    return ToolCall(name, json.dumps(args))


@dataclass(slots=True)
class ParsedOutput:
    content: str  # text outside the parsed calls (stripped when there are calls), as the server returns it
    calls: list[ToolCall]
    malformed: list[str]  # blocks that open a tool call but do not parse (or never close), verbatim


def split_tool_calls(text: str, fmt: str = "hermes", tools: list[dict[str, Any]] | None = None) -> ParsedOutput:
    """Whole text -> content, calls, and the malformed blocks (which stay part of the content)."""
    if fmt not in PARSERS:
        raise ValueError(f"tool-call parser must be one of {', '.join(PARSERS)}, got {fmt!r}")
    if fmt == "llama3_json":
        llama = _LlamaCalls()
        llama.feed(text, final=True)
        return ParsedOutput(text[llama.at:].strip() if llama.calls else text, llama.calls, llama.malformed)
    calls: list[ToolCall] = []
    malformed: list[str] = []
    content_parts: list[str] = []
    opening = TAGS[fmt][0]
    pos = scan = 0  # text[pos:scan] is content not written yet
    while (start := text.find(opening, scan)) != -1:
        end = _block_end(text, start, fmt, final=True)
        if end is None:
            malformed.append(text[start:])
            break
        found = _calls_of(text[start:end], fmt, tools)
        if found is None:
            malformed.append(text[start:end])
        else:
            content_parts.append(text[pos:start])
            calls += found
            pos = end
        scan = end
    content_parts.append(text[pos:])
    content = _drop_sections("".join(content_parts), fmt)
    return ParsedOutput(content.strip() if calls else content, calls, malformed)


def _calls_of(block: str, fmt: str, tools: list[dict[str, Any]] | None) -> list[ToolCall] | None:
    """The calls of one whole block (opening to end), each keeping its exact text; None when the
    block is not a call of the format."""
    if fmt == "mistral":
        return _mistral_calls(block)
    if fmt == "granite":
        return _list_calls(block, TAGS[fmt][0], mistral_ids=False)
    opening, closing = TAGS[fmt]
    call = _parse_block(block[len(opening):len(block) - len(closing)], fmt, tools)
    if call is None:
        return None
    call.text = block
    return [call]


def _drop_sections(text: str, fmt: str) -> str:
    """`text` without the format's section markers (DeepSeek's), which are never content."""
    for marker in SECTIONS.get(fmt, ()):
        text = text.replace(marker, "")
    return text


def parse_tool_calls(text: str, fmt: str = "hermes", tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ToolCall]]:
    """Whole text -> (content outside tool-call blocks, calls). An unparseable block stays content."""
    parsed = split_tool_calls(text, fmt, tools)
    return parsed.content, parsed.calls


# A call's opening, up to its arguments: hermes `{"name": "N", "arguments": `, qwen3_coder `<function=N>`
_HERMES_OPENING = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_CODER_OPENING = re.compile(r"\s*<function=([^>\n]+)>")
_GLM_OPENING = re.compile(r"\s*([^\s<]+)(?=\s|<)")  # complete once something follows the name
# DeepSeek's, up to the JSON arguments (as _DS_V3_CALL / _DS_V31_CALL read them)
_DS_OPENINGS = {"deepseek_v3": re.compile(r"\s*function" + re.escape(_DS_SEP) + r"([^\n]+)\n```json\n"),
                "deepseek_v31": re.compile(r"\s*([^\s<]+?)\s*" + re.escape(_DS_SEP))}


@dataclass(slots=True)
class CallDelta:
    """A piece of a streamed tool call: the call (its id and name go out with its first piece),
    its index among the text's calls, and the arguments text this piece adds."""

    call: ToolCall
    index: int
    arguments: str
    first: bool = False


@dataclass(slots=True)
class _OpenCall:  # a call being streamed (incremental mode)
    call: ToolCall
    index: int
    start: int  # where its block starts in the text
    args_at: int  # where its arguments start
    emitter: JsonArguments | XmlArguments
    fed: int  # text[:fed] has been given to the emitter


class StreamingToolParser:
    """Feed the growing text; get content deltas and tool calls as they become certain: whole
    calls (`feed`), or pieces of calls (`feed_deltas`; with `incremental`, as they are written)."""

    def __init__(self, fmt: str = "hermes", tools: list[dict[str, Any]] | None = None, incremental: bool = False):
        if fmt not in PARSERS:
            raise ValueError(f"tool-call parser must be one of {', '.join(PARSERS)}, got {fmt!r}")
        self.fmt = fmt
        self.tools = tools
        self.opening, self.closing = TAGS[fmt]
        self.incremental = incremental
        self.sent = 0  # text[:sent] has been accounted for (as content or as calls)
        self._llama = _LlamaCalls() if fmt == "llama3_json" else None
        self._scans: dict[int, _JsonScanner] = {}  # mistral: the JSON values being read, by where they start
        self.calls: list[ToolCall] = []
        self._open: _OpenCall | None = None

    def feed_deltas(self, text: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        """Content and call pieces for the text so far (`final`: it is all there is). Without
        `incremental`, each call comes as one piece once its block closes."""
        if not self.incremental:
            return self._whole_deltas(text, final)
        if self.fmt == "llama3_json":
            return self._llama_deltas(text, final)
        content, deltas = "", []
        while True:
            if self._open is None:
                before, found = self._to_next_call(text, final)
                content += before
                if not found:
                    break
                if not self._begin(text, deltas):  # not a call that can be streamed (yet): whole, as `feed` does
                    text_of, calls, closed = self._whole_block(text, final)
                    content += text_of
                    for call in calls:
                        self.calls.append(call)
                        deltas.append(CallDelta(call, len(self.calls) - 1, call.arguments, first=True))
                    if not closed:
                        break
                    continue
            if not self._advance(text, deltas, final):
                break
        return content, deltas

    def _whole_deltas(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        """`feed`, its new calls as one piece each."""
        first = len(self.calls)
        content, calls = self.feed(text, final)
        return content, [CallDelta(c, first + k, c.arguments, first=True) for k, c in enumerate(calls)]

    def _llama_deltas(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        """Llama 3 with `incremental`: a call the grammar wrote (`{"name": "NAME", "parameters": `
        then the arguments and `}`) streams its arguments as written; anything else at a call's
        place is read whole, as `feed` does (_LlamaCalls)."""
        llama = self._llama
        assert llama is not None
        deltas: list[CallDelta] = []
        n = len(text)
        while True:
            if llama.settled:  # the content has begun: the rest of the text is content as it comes
                content, self.sent = text[max(self.sent, llama.at):], n
                return content, deltas
            o = self._open
            if o is not None:
                if not o.emitter.done:
                    piece = o.emitter.feed(text[o.fed:])
                    o.fed = n
                    if piece:
                        o.call.arguments += piece
                        deltas.append(CallDelta(o.call, o.index, piece))
                e = _skip_space(text, o.args_at + o.emitter.end, n) if o.emitter.done else n
                if e < n and text[e] == "}":
                    o.call.text, llama.at = text[o.start:e + 1], e + 1
                elif e < n or final:  # cut off (max_tokens), or (never under the grammar) not closed by "}"
                    o.call.complete, o.call.text, llama.at = False, text[o.start:e], e
                    llama.settled = True
                else:
                    return "", deltas
                llama.calls.append(o.call)
                self._open = None
                continue
            j = llama.next_start(text)
            rest = text[j:j + len(_LLAMA_TRIGGER)]
            if not final and _LLAMA_TRIGGER.startswith(rest) and j + len(rest) == n:
                return "", deltas  # (all of it so far could be the grammar's opening)
            if rest == _LLAMA_TRIGGER:
                m = _LLAMA_OPENING.match(text, j)
                if m is None and not final and text.find('"parameters": ', j) == -1:
                    return "", deltas
                if m is not None:
                    call = ToolCall(json.loads(m.group(1)), "")
                    self.calls.append(call)
                    self._open = _OpenCall(call, len(self.calls) - 1, j, m.end(), JsonArguments(), m.end())
                    deltas.append(CallDelta(call, self._open.index, "", first=True))
                    continue
            # anything else at a call's place: the next call (or the content's start) read whole
            before = len(llama.calls)
            llama.feed(text, final, one=True)
            for call in llama.calls[before:]:
                self.calls.append(call)
                deltas.append(CallDelta(call, len(self.calls) - 1, call.arguments, first=True))
            if len(llama.calls) == before and not llama.settled:
                return "", deltas  # (not decided yet)

    def _begin(self, text: str, deltas: list[CallDelta]) -> bool:
        """Open a streamed call at `text[self.sent:]` (the format's call opening) once its opening
        is complete; False for a format whose arguments are not streamed as written."""
        at = self.sent + len(self.opening)
        if self.fmt not in _STREAMED_ARGUMENTS:  # no arguments emitter: sent whole, as `feed` does
            return False
        if self.fmt == "hermes":
            m = _HERMES_OPENING.match(text, at)
            if m is None:
                return False
            try:
                name = json.loads(m.group(1))
            except (json.JSONDecodeError, RecursionError):  # (too deeply nested JSON: RecursionError)
                return False
            emitter: JsonArguments | XmlArguments = JsonArguments()
        elif self.fmt == "glm45":
            m = _GLM_OPENING.match(text, at)
            if m is None:
                return False
            name = m.group(1)
            emitter = GlmArguments(_param_types(self.tools, name))
        elif self.fmt in _DS_OPENINGS:
            m = _DS_OPENINGS[self.fmt].match(text, at)
            if m is None:
                return False
            name = m.group(1).strip()
            emitter = JsonArguments()
        elif self.fmt == "minimax_m2":
            m = _MM_NAME.match(text, at)
            if m is None:
                return False
            name = m.group(1).strip()
            emitter = MinimaxArguments(_param_types(self.tools, name))
        else:
            m = _CODER_OPENING.match(text, at)
            if m is None:
                return False
            name = m.group(1).strip()
            emitter = XmlArguments(_param_types(self.tools, name))
        call = ToolCall(name, "")
        self.calls.append(call)
        self._open = _OpenCall(call, len(self.calls) - 1, self.sent, m.end(), emitter, m.end())
        deltas.append(CallDelta(call, self._open.index, "", first=True))
        return True

    def _advance(self, text: str, deltas: list[CallDelta], final: bool) -> bool:
        """Feed the open call what was written since; True once its block has closed."""
        o = self._open
        assert o is not None
        if not o.emitter.done:
            piece = o.emitter.feed(text[o.fed:])
            o.fed = len(text)
            if piece:
                o.call.arguments += piece
                deltas.append(CallDelta(o.call, o.index, piece))
        end = text.find(self.closing, o.args_at + o.emitter.end) if o.emitter.done else -1
        if end == -1:
            if final:  # cut off: a call with the arguments written so far
                o.call.complete, o.call.text = False, text[o.start:]
                self.sent, self._open = len(text), None
            return False
        o.call.text = text[o.start:end + len(self.closing)]
        self.sent, self._open = end + len(self.closing), None
        return True

    def _to_next_call(self, text: str, final: bool) -> tuple[str, bool]:
        """The content up to the next call's opening (`<tool_call>`, or the format's), self.sent
        moved to it, and whether there is one; without one, all of the rest that cannot still
        become one (or a section marker, which is dropped from content)."""
        rest = text[self.sent:]
        start = rest.find(self.opening)
        if start == -1:
            hold = 0 if final else max(partial_suffix(rest, m) for m in (self.opening, *SECTIONS.get(self.fmt, ())))
            self.sent += len(rest) - hold
            return _drop_sections(rest[: len(rest) - hold], self.fmt), False
        self.sent += start
        return _drop_sections(rest[:start], self.fmt), True

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        if self.fmt == "llama3_json":
            return self._feed_llama(text, final)
        content = ""
        new_calls: list[ToolCall] = []
        while True:
            before, found = self._to_next_call(text, final)
            content += before
            if not found:
                break
            text_of, calls, closed = self._whole_block(text, final)
            content += text_of
            new_calls += calls
            if not closed:
                break
        self.calls += new_calls
        return content, new_calls

    def _feed_llama(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """Llama 3: calls as each closes while the output's start may still hold them; once the
        content has begun, the rest of the text is content as it comes."""
        llama = self._llama
        assert llama is not None
        if llama.settled:
            content, self.sent = text[self.sent:], len(text)
            return content, []
        llama.feed(text, final)
        new = llama.calls[len(self.calls):]
        self.calls += new
        if not llama.settled:
            return "", new
        content, self.sent = text[llama.at:], len(text)
        return content, new

    def _whole_block(self, text: str, final: bool) -> tuple[str, list[ToolCall], bool]:
        """The block opening at self.sent, once closed: (the content it is, its calls, whether it
        closed). A block that does not parse is content; an unterminated one is held, or content
        when `final`."""
        end = _block_end(text, self.sent, self.fmt, final, self._scans)
        if end is None:
            held, self.sent = (_drop_sections(text[self.sent:], self.fmt), len(text)) if final else ("", self.sent)
            return held, [], False
        block = text[self.sent:end]
        self.sent = end
        calls = _calls_of(block, self.fmt, self.tools)
        if calls is None:
            return _drop_sections(block, self.fmt), [], True
        return "", calls, True
