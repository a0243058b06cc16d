"""Thinking text split out of a model's output: `<think>...</think>` becomes `reasoning_content`,
the rest `content` (vLLM's `--reasoning-parser qwen3` / `deepseek_r1` / `glm45`; `seed_oss` is
qwen3's rule over Seed-OSS's `<seed:think>...</seed:think>`), whole or streamed. `gpt_oss` reads
gpt-oss's harmony messages instead of tags (engine/harmony.py): its analysis channel is the
reasoning.

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
Where the output starts is a `Start`: that state and the parser's tags. Reasoning ends at the
first `</think>`; everything after it is content, whatever it contains. An
unclosed block (the model ran out of tokens) is all reasoning. The tool-call parser is fed the
content only, so thinking text never becomes a tool call.

The streaming parser never emits text that could still turn out to be part of a tag, and its
deltas always add up to the whole-text split however the text is cut (the whole split *is* one
final feed).
"""
from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
# parser -> its thinking block's (opening, closing) tags
TAGS = {"qwen3": (OPEN, CLOSE), "deepseek_r1": (OPEN, CLOSE), "glm45": (OPEN, CLOSE), "seed_oss": ("<seed:think>", "</seed:think>")}
HARMONY_PARSER = "gpt_oss"  # harmony messages, not tags (engine/harmony.py)
REASONING_PARSERS = (*TAGS, HARMONY_PARSER)

# Where the parser is in the output.
AWAIT = "await"  # qwen3, no tag in the prompt's tail: the model's first text decides
OPENING = "opening"  # reasoning, but a leading `<think>` (the model opening the block itself) is dropped
REASONING = "reasoning"
CONTENT = "content"
HARMONY = "harmony"  # gpt-oss: the output is harmony messages (HarmonyParser reads it)


@dataclass(frozen=True, slots=True)
class Start:
    """Where a parser starts reading an output, and the tags of its thinking block."""

    state: str
    open: str = OPEN
    close: str = CLOSE


def opens_thinking(parser: str, prompt_tail: str) -> bool:
    """Whether `prompt_tail` leaves the parser's thinking block open (harmony has no such block)."""
    if parser == HARMONY_PARSER:
        return False
    opening, closing = TAGS[parser]
    return prompt_tail.rfind(opening) > prompt_tail.rfind(closing)


def start_state(parser: str, prompt_tail: str, enable_thinking: bool | None = None) -> Start:
    """Where the output of a prompt ending in `prompt_tail` starts (see the module docstring)."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got {parser!r}")
    if parser == HARMONY_PARSER:
        return Start(HARMONY, "", "")
    opening, closing = TAGS[parser]
    opened, closed = prompt_tail.rfind(opening), prompt_tail.rfind(closing)
    if opened > closed:
        state = OPENING
    elif closed != -1:
        state = CONTENT
    elif parser == "deepseek_r1":
        state = OPENING
    else:
        state = CONTENT if enable_thinking is False else AWAIT
    return Start(state, opening, closing)


def partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `token`: what a streaming
    parser holds back, since it could still become the tag (this module's, tool_parsers', tool_args')."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """Feed the growing output text; get (reasoning delta, content delta) as they become certain."""

    __slots__ = ("state", "sent", "open", "close", "harmony")

    def __init__(self, start: Start | str):
        """`start`: where the output starts (`start_state`), or a bare state for `<think>` tags."""
        start = start if isinstance(start, Start) else Start(start)
        if start.state not in (AWAIT, OPENING, REASONING, CONTENT, HARMONY):
            raise ValueError(f"unknown reasoning parser state {start.state!r}")
        self.state, self.open, self.close = start.state, start.open, start.close
        self.sent = 0  # text[:sent] has been accounted for (as reasoning, content, or a dropped tag)
        self.harmony = None
        if start.state == HARMONY:
            from cuttle.engine.harmony import HarmonyParser  # (harmony.py imports this module)

            self.harmony = HarmonyParser()

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        if self.harmony is not None:
            return self.harmony.feed(text, final)
        reasoning = content = ""
        opening, closing = self.open, self.close
        if self.state in (AWAIT, OPENING):
            rest = text[self.sent :]
            lead = rest.lstrip()
            if lead.startswith(opening):  # the model opens the block: the tag (and blanks before it) go
                self.sent += len(rest) - len(lead) + len(opening)
                self.state = REASONING
            elif not final and opening.startswith(lead):  # blank so far, or a partial `<think>`: wait
                return "", ""
            else:
                self.state = CONTENT if self.state == AWAIT else REASONING
        if self.state == REASONING:
            rest = text[self.sent :]
            end = rest.find(closing)
            if end == -1:
                hold = 0 if final else partial_suffix(rest, closing)
                reasoning = rest[: len(rest) - hold]
                self.sent += len(reasoning)
                return reasoning, ""
            reasoning = rest[:end]
            self.sent += end + len(closing)
            self.state = CONTENT
        content = text[self.sent :]
        self.sent = len(text)
        return reasoning, content


def split_reasoning(text: str, start: Start | str) -> tuple[str | None, str | None]:
    """Whole output -> (reasoning, content), None for an empty part (as vLLM returns them)."""
    reasoning, content = ReasoningParser(start).feed(text, final=True)
    return reasoning or None, content or None
