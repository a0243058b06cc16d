"""Tool calls parsed out of a model's text: the Qwen3 / Hermes `<tool_call>{json}</tool_call>`
format and the Qwen3-Coder `<tool_call><function=NAME><parameter=P>value</parameter></function>`
format, whole or streamed.

Owns only text -> (content, tool calls). The streaming parser never emits text that could still
turn out to be part of a tool call, and its deltas always add up to the whole-text parse, however
the text is split. Every parsed call keeps the exact block the model wrote (`ToolCall.text`,
`<tool_call>` to `</tool_call>`), so a caller that must reproduce the model's tokens (an agent's
next turn, an RL trajectory) never has to re-serialize the arguments.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
# One whitespace character next to each tag is the format's separator, not the value's: the
# template writes a newline there, and the structured-output grammar (xgrammar's qwen_xml style)
# admits any one of space / tab / CR / LF, so stripping exactly one keeps a constrained string
# within its schema's maxLength.
_PARAM = re.compile(r"<parameter=([^>\n]+)>[ \t\r\n]?(.*?)[ \t\r\n]?</parameter>", re.S)

PARSERS = ("hermes", "qwen3_coder")


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (the OpenAI wire format)
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])
    text: str = ""  # the model's exact block, "<tool_call>...</tool_call>" (not sent on the wire)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


def parser_for_template(chat_template: str | None) -> str:
    """The format a checkpoint's chat template teaches its model."""
    return "qwen3_coder" if chat_template and "<function=" in chat_template else "hermes"


def _param_types(tools: list[dict[str, Any]] | None, name: str) -> dict[str, str]:
    for t in tools or []:
        f = t.get("function", t)
        if f.get("name") == name:
            return {k: v.get("type", "string") for k, v in (f.get("parameters") or {}).get("properties", {}).items()}
    return {}


def _parse_block(body: str, fmt: str, tools: list[dict[str, Any]] | None) -> ToolCall | None:
    if fmt == "hermes":
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))
    m = _FUNCTION.search(body)
    if m is None:
        return None
    name = m.group(1).strip()
    types = _param_types(tools, name)
    args: dict[str, Any] = {}
    for pname, raw in _PARAM.findall(m.group(2)):
        pname = pname.strip()
        value: Any = raw
        if types.get(pname, "string") != "string":
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
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
    calls: list[ToolCall] = []
    malformed: list[str] = []
    content_parts: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        call = _parse_block(m.group(1), fmt, tools)
        if call is None:
            malformed.append(m.group(0))
            continue
        call.text = m.group(0)
        content_parts.append(text[pos : m.start()])
        calls.append(call)
        pos = m.end()
    content_parts.append(text[pos:])
    last_close = text.rfind(CLOSE)
    unterminated = text.find(OPEN, last_close + len(CLOSE) if last_close >= 0 else 0)
    if unterminated != -1:
        malformed.append(text[unterminated:])
    content = "".join(content_parts)
    return ParsedOutput(content.strip() if calls else content, calls, malformed)


def parse_tool_calls(text: str, fmt: str = "hermes", tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ToolCall]]:
    """Whole text -> (content outside tool-call blocks, calls). An unparseable block stays content."""
    parsed = split_tool_calls(text, fmt, tools)
    return parsed.content, parsed.calls


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `token`."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


class StreamingToolParser:
    """Feed the growing text; get content deltas and completed tool calls as they become certain."""

    def __init__(self, fmt: str = "hermes", tools: list[dict[str, Any]] | None = None):
        if fmt not in PARSERS:
            raise ValueError(f"tool-call parser must be one of {', '.join(PARSERS)}, got {fmt!r}")
        self.fmt = fmt
        self.tools = tools
        self.sent = 0  # text[:sent] has been accounted for (as content or as calls)
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        content = ""
        new_calls: list[ToolCall] = []
        while True:
            rest = text[self.sent :]
            start = rest.find(OPEN)
            if start == -1:
                hold = 0 if final else _partial_suffix(rest, OPEN)
                content += rest[: len(rest) - hold]
                self.sent += len(rest) - hold
                break
            content += rest[:start]
            self.sent += start
            end = rest.find(CLOSE, start)
            if end == -1:
                if final:  # an unterminated call is just text
                    content += text[self.sent :]
                    self.sent = len(text)
                break
            block_end = end + len(CLOSE)
            call = _parse_block(rest[start + len(OPEN) : end], self.fmt, self.tools)
            if call is None:
                content += rest[start:block_end]
            else:
                call.text = rest[start:block_end]
                new_calls.append(call)
            self.sent += block_end - start
        self.calls += new_calls
        return content, new_calls
