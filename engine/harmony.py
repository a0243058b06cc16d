"""gpt-oss's output read as what it is: harmony messages (`--reasoning-parser gpt_oss`, on by default
for a harmony chat template).

An assistant turn of gpt-oss is a sequence of messages, each a header and a body:

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{"a": 1}<|call|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

(the prompt ends in `<|start|>assistant`, so the first message's header starts at the output's
first token; a recipient `to=...` may also stand before `<|channel|>`). `<|call|>` and
`<|return|>` are stop tokens, so the output's text usually ends without them. The markers are
special tokens: the server keeps them in the text it parses (`skip_special_tokens` false).

`HarmonyParser` (the reasoning parser's state for this format) splits the text by message:

- analysis messages, and messages to a recipient other than a function (a built-in tool the
  server does not run), are reasoning;
- final messages and commentary without a recipient (gpt-oss's preambles) are content;
- a message to `functions.NAME` is content in one canonical form,
  `<|start|>assistant to=functions.NAME<|channel|>commentary<|message|>ARGS<|call|>`, which the
  `openai` tool-call format (tool_parsers.py) reads as a call. Its closing marker is written when
  the message ends, or when the output does.

A header not completed by the end of the output is content, as written after its `<|start|>`. As
`ReasoningParser`, it never emits text that could still turn out to be part of a marker, and its
deltas add up to the whole-text split however the text is cut.
"""
from __future__ import annotations

import re

from cuttle.engine.reasoning_parsers import partial_suffix

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
_BODY_ENDS = (END, CALL, RETURN, START)  # (a body the model leaves without <|end|> ends at the next header)
CALL_OPENING = "<|start|>assistant to=functions."  # the canonical call's opening (tool_parsers' `openai`)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")

HEADER, BODY, BETWEEN = "header", "body", "between"


class HarmonyParser:
    """Feed the growing output text; get (reasoning delta, content delta) as they become certain."""

    __slots__ = ("state", "sent", "route", "call_open")

    def __init__(self) -> None:
        self.state = HEADER  # the prompt's `<|start|>assistant` left a header open
        self.sent = 0  # text[:sent] has been accounted for
        self.route = "content"  # where the current body goes: "reasoning", "content" or "call"
        self.call_open = False  # a canonical call's opening was emitted and its closing not yet

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            rest = text[self.sent:]
            if self.state == BETWEEN:  # after a body's end: the next message's <|start|>
                lead = rest.lstrip()
                if lead.startswith(START):
                    self.sent += len(rest) - len(lead) + len(START)
                    self.state = HEADER
                    continue
                if not final and START.startswith(lead):
                    break
                # text outside any message (not what gpt-oss writes): content, as written
                self.state, self.route = BODY, "content"
                continue
            if self.state == HEADER:
                end = rest.find(MESSAGE)
                if end == -1:
                    if final and rest:
                        content.append(rest)  # an unfinished header: kept as written
                        self.sent = len(text)
                    break
                self._open(rest[:end], content)
                self.sent += end + len(MESSAGE)
                self.state = BODY
                continue
            # BODY: up to the first marker that ends it
            stop, marker = min(((i, m) for m in _BODY_ENDS if (i := rest.find(m)) != -1), default=(-1, ""))
            if stop == -1:
                hold = 0 if final else max(partial_suffix(rest, m) for m in _BODY_ENDS)
                self._emit(rest[: len(rest) - hold], reasoning, content)
                self.sent += len(rest) - hold
                if final:
                    self._close(content)
                break
            self._emit(rest[:stop], reasoning, content)
            self._close(content)
            if marker == START:
                self.sent += stop + len(START)
                self.state = HEADER
            else:
                self.sent += stop + len(marker)
                self.state = BETWEEN
        return "".join(reasoning), "".join(content)

    def _open(self, header: str, content: list[str]) -> None:
        """A message's header is complete: where its body goes."""
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        to = recipient.group(1) if recipient is not None else None
        if to is not None and to.startswith("functions."):
            self.route = "call"
            content.append(f"{CALL_OPENING}{to[len('functions.'):]}{CHANNEL}commentary{MESSAGE}")
            self.call_open = True
        elif to is not None or (channel is not None and channel.group(1) == "analysis"):
            self.route = "reasoning"
        else:
            self.route = "content"

    def _emit(self, piece: str, reasoning: list[str], content: list[str]) -> None:
        if piece:
            (reasoning if self.route == "reasoning" else content).append(piece)

    def _close(self, content: list[str]) -> None:
        if self.call_open:
            content.append(CALL)
            self.call_open = False


def split_harmony(text: str) -> tuple[str, str]:
    """Whole output -> (reasoning, content)."""
    return HarmonyParser().feed(text, final=True)
