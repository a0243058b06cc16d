"""Thinking text split out of a model's output: `<think>...</think>` becomes `reasoning_content`,
the rest `content` (vLLM's `--reasoning-parser qwen3` / `deepseek_r1` / `glm45`), whole or streamed.

Owns only text -> (reasoning, content). Where the output starts is decided from the prompt's
tail (what the chat template wrote after the conversation: the generation prompt, or the final
message being continued), so the same parser serves every template style:
- the tail left a `<think>` open (DeepSeek-R1, Qwen3-Thinking-2507, Qwen3.5): the output starts
  in reasoning; a `<think>` the model writes again at the start is dropped;
- the tail closed one (`<think>\\n\\n</think>\\n\\n`: Qwen3 with `enable_thinking: false`): all content;
- no tag in the tail: `deepseek_r1` starts in reasoning (as vLLM's parser: no `</think>`, all
  thinking); `qwen3` waits for the model's first non-blank text: `<think>` opens reasoning,
  anything else is content (and with `enable_thinking: false` it is content from the start).
  `glm45` is the same rule: GLM-4.5 writes its own `<think>` after `<|assistant|>` (its template
  closes an empty block for `enable_thinking: false`; GLM-4.7's leaves one open).
Reasoning ends at the first `</think>`; everything after it is content, whatever it contains. An
unclosed block (the model ran out of tokens) is all reasoning. The tool-call parser is fed the
content only, so thinking text never becomes a tool call.

The streaming parser never emits text that could still turn out to be part of a tag, and its
deltas always add up to the whole-text split however the text is cut (the whole split *is* one
final feed).
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1", "glm45")

# Where the parser is in the output.
AWAIT = "await"  # qwen3, no tag in the prompt's tail: the model's first text decides
OPENING = "opening"  # reasoning, but a leading `<think>` (the model opening the block itself) is dropped
REASONING = "reasoning"
CONTENT = "content"


def start_state(parser: str, prompt_tail: str, enable_thinking: bool | None = None) -> str:
    """Where the output of a prompt ending in `prompt_tail` starts (see the module docstring)."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got {parser!r}")
    opened, closed = prompt_tail.rfind(OPEN), prompt_tail.rfind(CLOSE)
    if opened > closed:
        return OPENING
    if closed != -1:
        return CONTENT
    if parser == "deepseek_r1":
        return OPENING
    return CONTENT if enable_thinking is False else AWAIT


def partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `token`: what a streaming
    parser holds back, since it could still become the tag (this module's, tool_parsers', tool_args')."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """Feed the growing output text; get (reasoning delta, content delta) as they become certain."""

    __slots__ = ("state", "sent")

    def __init__(self, state: str):
        if state not in (AWAIT, OPENING, REASONING, CONTENT):
            raise ValueError(f"unknown reasoning parser state {state!r}")
        self.state = state
        self.sent = 0  # text[:sent] has been accounted for (as reasoning, content, or a dropped tag)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        reasoning = content = ""
        if self.state in (AWAIT, OPENING):
            rest = text[self.sent :]
            lead = rest.lstrip()
            if lead.startswith(OPEN):  # the model opens the block: the tag (and blanks before it) go
                self.sent += len(rest) - len(lead) + len(OPEN)
                self.state = REASONING
            elif not final and OPEN.startswith(lead):  # blank so far, or a partial `<think>`: wait
                return "", ""
            else:
                self.state = CONTENT if self.state == AWAIT else REASONING
        if self.state == REASONING:
            rest = text[self.sent :]
            end = rest.find(CLOSE)
            if end == -1:
                hold = 0 if final else partial_suffix(rest, CLOSE)
                reasoning = rest[: len(rest) - hold]
                self.sent += len(reasoning)
                return reasoning, ""
            reasoning = rest[:end]
            self.sent += end + len(CLOSE)
            self.state = CONTENT
        content = text[self.sent :]
        self.sent = len(text)
        return reasoning, content


def split_reasoning(text: str, state: str) -> tuple[str | None, str | None]:
    """Whole output -> (reasoning, content), None for an empty part (as vLLM returns them)."""
    reasoning, content = ReasoningParser(state).feed(text, final=True)
    return reasoning or None, content or None
