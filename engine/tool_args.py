"""A tool call's arguments written out as the model writes them, for streamed responses.

Owns the emitters that take the text of one call's arguments as it grows (fed in any pieces) and
return, piece by piece, the OpenAI `arguments` string the whole-text parse (tool_parsers) gives
the finished call, so streamed argument deltas add up to exactly that string:

- `JsonArguments` (the hermes format, `{"name": ..., "arguments": VALUE}`): VALUE re-written as
  `json.dumps(json.loads(VALUE))` writes it: separators ", " and ": ", whitespace between tokens
  dropped, strings decoded and escaped again (non-ASCII as \\uXXXX), numbers and literals as
  Python writes them back (held until they end). A string VALUE is the arguments themselves
  (hermes' rule), written as its decoded text.
- `XmlArguments` (the qwen3_coder format, `<parameter=K>VALUE</parameter>` blocks up to
  `</function>`): `json.dumps({K: value, ...})`, string values written character by character
  (the one whitespace beside each tag is the format's separator, so the last one is held until
  the closing tag shows whether it is), typed values (the tool's schema type is not "string")
  held until their closing tag, then `json.loads`ed, or kept as a string when they are not JSON.
- `GlmArguments` (the glm45 format, `<arg_key>K</arg_key><arg_value>VALUE</arg_value>` pairs up
  to `</tool_call>`, with or without GLM-4.5's newlines between tags): the same object by the same
  rules (xgrammar's glm_xml style, like qwen_xml, takes one whitespace character beside each
  value tag as a separator, outside the value's schema bounds).

- `MinimaxArguments` (the minimax_m2 format, `<parameter name="K">VALUE</parameter>` entries up
  to `</invoke>`): the same object by the same rules (xgrammar's minimax_xml style).

All four assume text the tool-call grammar admits (engine/structured_output.tool_call_structure):
valid JSON, each key once. On other text their pieces could differ from a whole parse (json.loads
keeps the last of two equal keys, where these emitters have already written the first), which is
why the streaming parser uses them only for calls generated under that grammar.
"""
from __future__ import annotations

import json

from cuttle.engine.reasoning_parsers import partial_suffix

_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_PARAM_OPEN, _PARAM_CLOSE, _FUNCTION_CLOSE = "<parameter=", "</parameter>", "</function>"
_SEPARATORS = " \t\r\n"  # the whitespace a qwen3_coder tag may have beside it (tool_parsers._PARAM)


def _escaped(text: str) -> str:
    """`text` as it stands inside a JSON string that json.dumps writes."""
    return json.dumps(text)[1:-1] if text else ""


class JsonArguments:
    """The hermes arguments value, fed as it grows; `done` once it has ended, `end` the number of
    fed characters it took (what follows is the call's closing)."""

    def __init__(self) -> None:
        self.depth = 0
        self.done = False
        self.end = 0
        self.fed = 0
        self.in_string = False
        self.bare = False  # a string VALUE: the arguments are its decoded text, unquoted
        self.escape = ""  # an escape sequence begun ("\\", "\\u12", ...)
        self.atom = ""  # a number or literal begun
        self.chars: list[str] = []  # decoded string characters not written yet

    def feed(self, text: str) -> str:
        out: list[str] = []
        for i, c in enumerate(text):
            if self.done:
                break
            if self.in_string:
                if self.escape:
                    self.escape += c
                    if self.escape[1] == "u":
                        if len(self.escape) < 6:
                            continue
                        self.chars.append(chr(int(self.escape[2:6], 16)))
                    else:
                        self.chars.append(_ESCAPES.get(c, c))
                    self.escape = ""
                elif c == "\\":
                    self.escape = c
                elif c == '"':
                    out.append(self._string_text(closing=True))
                    self.in_string = False
                    if self.bare:
                        self._finish(i + 1)
                    else:
                        out.append('"')
                else:
                    self.chars.append(c)
                continue
            if self.atom and (c in _SEPARATORS or c in '{}[],:"'):
                out.append(json.dumps(json.loads(self.atom)))
                self.atom = ""
                if self.depth == 0:  # a number or literal VALUE ends at the character after it
                    self._finish(i)
                    break
            if c in _SEPARATORS:
                continue
            if c in "{[":
                self.depth += 1
                out.append(c)
            elif c in "}]":
                self.depth -= 1
                out.append(c)
                if self.depth == 0:
                    self._finish(i + 1)
            elif c == ",":
                out.append(", ")
            elif c == ":":
                out.append(": ")
            elif c == '"':
                self.in_string = True
                if self.depth == 0:
                    self.bare = True
                else:
                    out.append('"')
            else:
                self.atom += c
        if self.in_string:
            out.append(self._string_text(closing=False))
        if not self.done:
            self.fed += len(text)
        return "".join(out)

    def _finish(self, i: int) -> None:
        self.done, self.end = True, self.fed + i

    def _string_text(self, closing: bool) -> str:
        """The decoded characters so far, as written out (escaped again inside VALUE; as text for
        a string VALUE, where a high surrogate waits for its low half: json.loads joins the two)."""
        if self.bare:
            keep = 1 if not closing and self.chars and "\ud800" <= self.chars[-1] <= "\udbff" else 0
            text = "".join(self.chars[:len(self.chars) - keep])
            self.chars = self.chars[len(self.chars) - keep:]
            return text.encode("utf-16", "surrogatepass").decode("utf-16", "surrogatepass") if text else ""
        text, self.chars = "".join(self.chars), []
        return _escaped(text)


class XmlArguments:
    """The qwen3_coder parameters of one call (the text after `<function=NAME>`), fed as it grows;
    `done` once `</function>` has been read, `end` the number of fed characters up to its end."""

    VALUE_CLOSE = _PARAM_CLOSE
    SEPARATORS = _SEPARATORS  # the one character beside a value tag that is not the value's

    def __init__(self, types: dict[str, str]) -> None:
        self.types = types  # parameter -> its schema type (absent: "string")
        self.buf = ""  # fed text not decided yet
        self.fed = 0  # characters fed before `buf`
        self.keys = 0
        self.value_of: str | None = None  # the parameter whose value is being read
        self.started = False  # its first value character was seen (the leading separator decided)
        self.typed = ""  # a typed value, held whole
        self.done = False
        self.end = 0

    def feed(self, text: str) -> str:
        self.buf += text
        out: list[str] = []
        while not self.done:
            if self.value_of is None:
                if not self._tag(out):
                    break
            elif not self._value(out):
                break
        return "".join(out)

    def _take(self, n: int) -> None:
        self.buf, self.fed = self.buf[n:], self.fed + n

    def _next_tag(self, opening: str, closing: str, out: list[str], end_after_closing: bool) -> int | None:
        """Between values, every format: where the next `opening` starts in `buf`, or None when the
        call's `closing` comes first (the object closed, `done`; `end` before the closing tag, or
        after it with `end_after_closing`) or neither is in sight yet (the text that cannot begin
        either taken, as the whole-text parse skips it)."""
        p, f = self.buf.find(opening), self.buf.find(closing)
        if f != -1 and (p == -1 or f < p):
            out.append("}" if self.keys else "{}")
            self.done, self.end = True, self.fed + f + (len(closing) if end_after_closing else 0)
            return None
        if p == -1:
            keep = max(partial_suffix(self.buf, opening), partial_suffix(self.buf, closing))
            self._take(len(self.buf) - keep)
            return None
        return p

    def _tag(self, out: list[str]) -> bool:
        """Between parameters: the next `<parameter=K>` or `</function>` (other text is not part
        of any value: the whole-text parse skips it too); False when more text is needed."""
        p = self._next_tag(_PARAM_OPEN, _FUNCTION_CLOSE, out, end_after_closing=True)
        if p is None:
            return False
        close = self.buf.find(">", p)
        if close == -1:
            self._take(p)
            return False
        self._open_value(out, self.buf[p + len(_PARAM_OPEN):close].strip())
        self._take(close + 1)
        return True

    def _value(self, out: list[str]) -> bool:
        """Inside a value: written (a string) or held (typed) up to `</parameter>`; the one
        separator character beside each tag dropped. False when more text is needed."""
        if not self.started:
            if not self.buf:
                return False
            self.started = True
            if self.buf[0] in self.SEPARATORS:
                self._take(1)
        string = self.types.get(self.value_of, "string") == "string"
        e = self.buf.find(self.VALUE_CLOSE)
        if e == -1:
            keep = partial_suffix(self.buf, self.VALUE_CLOSE)
            if len(self.buf) > keep and self.buf[len(self.buf) - keep - 1] in self.SEPARATORS:
                keep += 1  # perhaps the separator before the closing tag
            piece = self.buf[:len(self.buf) - keep]
            if string:
                out.append(_escaped(piece))
            else:
                self.typed += piece
            self._take(len(piece))
            return False
        piece = self.buf[:e]
        if piece and piece[-1] in self.SEPARATORS:
            piece = piece[:-1]
        if string:
            out.append(_escaped(piece) + '"')
        else:
            raw = self.typed + piece
            try:
                value = json.loads(raw)
            except (json.JSONDecodeError, RecursionError):  # (too deeply nested JSON: RecursionError)
                value = raw
            out.append(json.dumps(value))
        self.value_of = None
        self._take(e + len(self.VALUE_CLOSE))
        return True

    def _open_value(self, out: list[str], name: str) -> None:
        """Write the key of the value that follows, and start reading it."""
        string = self.types.get(name, "string") == "string"
        out.append(("{" if not self.keys else ", ") + json.dumps(name) + ": " + ('"' if string else ""))
        self.keys += 1
        self.value_of, self.started, self.typed = name, False, ""


_KEY_OPEN, _KEY_CLOSE, _VALUE_OPEN, _CALL_CLOSE = "<arg_key>", "</arg_key>", "<arg_value>", "</tool_call>"


class GlmArguments(XmlArguments):
    """The glm45 arguments of one call (the text after its name), fed as it grows; `done` once
    `</tool_call>` is in sight, `end` the number of fed characters before it (the streaming parser
    reads the closing tag itself)."""

    VALUE_CLOSE = "</arg_value>"

    def _tag(self, out: list[str]) -> bool:
        """Between pairs: the next `<arg_key>K</arg_key>` and the `<arg_value>` after it, or the
        call's end (text elsewhere is no value's: the whole-text parse skips it too)."""
        k = self._next_tag(_KEY_OPEN, _CALL_CLOSE, out, end_after_closing=False)
        if k is None:
            return False
        self._take(k)
        close = self.buf.find(_KEY_CLOSE)
        v = self.buf.find(_VALUE_OPEN, close) if close != -1 else -1
        if v == -1:
            return False
        if self.buf[close + len(_KEY_CLOSE):v].strip():  # not a pair: skipped as the whole-text parse skips it
            self._take(len(_KEY_OPEN))
            return True
        self._open_value(out, self.buf[len(_KEY_OPEN):close].strip())
        self._take(v + len(_VALUE_OPEN))
        return True


_MM_PARAM_OPEN, _MM_KEY_END, _INVOKE_CLOSE = '<parameter name="', '">', "</invoke>"


class MinimaxArguments(XmlArguments):
    """The minimax_m2 parameters of one call (the text after `<invoke name="NAME">`), fed as it
    grows; `done` once `</invoke>` is in sight, `end` the number of fed characters before it (the
    streaming parser reads the closing tag itself)."""

    def _tag(self, out: list[str]) -> bool:
        """Between parameters: the next `<parameter name="K">` or the call's end (text elsewhere is
        no value's: the whole-text parse skips it too)."""
        p = self._next_tag(_MM_PARAM_OPEN, _INVOKE_CLOSE, out, end_after_closing=False)
        if p is None:
            return False
        close = self.buf.find(_MM_KEY_END, p + len(_MM_PARAM_OPEN))
        if close == -1:
            self._take(p)
            return False
        self._open_value(out, self.buf[p + len(_MM_PARAM_OPEN):close].strip())
        self._take(close + len(_MM_KEY_END))
        return True
