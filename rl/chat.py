"""The chat template as token deltas: a conversation grown turn by turn without re-tokenizing.

Owns turning a chat (system prompt with the tool schemas, the task, then model turns and tool
results) into the token stream a multi-turn trajectory is: the first prompt is the template's
rendering encoded once; after that, each turn appends the model's own sampled ids and then only
the ids of the text the template adds (the closing glue after the model's end-of-turn token, the
tool results, the next generation prompt). Past turns are never encoded again, so the engine's
prefix cache, the trainer and the policy all see exactly the ids that were sampled.

Append-only check: after every turn the whole conversation is rendered again and must start with
the text of the stream so far (prompt text + the decoded sampled ids); the appended delta is the
rest. Where a template is not append-only (it rewrites earlier turns when a later one arrives:
Qwen3's stripping of past `<think>` blocks after a new user query, a template that renders the
last assistant turn differently from earlier ones, a turn closed by a token other than the
template's own) the check fails and `TemplateNotAppendOnly` names the turn and the first
differing characters; the trajectory ends there with that reason instead of silently training on
a history the model never produced. Must never call `encode` on text that contains sampled tokens.

The conversation kept here (`ChatState.messages`) is the template's view: an assistant message's
`content` is the model's exact text of its turn (tool-call blocks included, the end-of-turn token
excluded), which the template renders verbatim. The product view (content and `tool_calls`, as
`cuttle serve` returns them) is built by the agent loop from the parsed calls.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cuttle.engine.tokenizer import Tokenizer


class TemplateNotAppendOnly(ValueError):
    """Rendering the grown conversation does not extend the token stream: where and how it differs."""


@dataclass(slots=True)
class ChatState:
    messages: list[dict[str, Any]]  # what the template renders (assistant content = the model's exact text)
    text: str  # the text of the token stream so far (the decoded sampled ids in their places)
    num_turns: int = 0
    # (start, end) of each sampled span in `text`, for checks and logs
    sampled_spans: list[tuple[int, int]] = field(default_factory=list)


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class ChatTokens:
    """A tokenizer's chat template, with `tools`, rendered as appended token ids."""

    def __init__(self, tokenizer: Tokenizer, tools: list[dict[str, Any]] | None, eos_token_ids: set[int] | list[int]):
        self.tok = tokenizer
        self.tools = tools
        self.eos_token_ids = set(eos_token_ids)
        self.end_of_turn_id = self._end_of_turn_id()

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=self.tools, add_generation_prompt=generation_prompt)

    def _end_of_turn_id(self) -> int:
        """The EOS token the template writes right after an assistant turn's content: sampling it
        is how the model ends a turn in a way the conversation can continue from."""
        probe = "\u20634417\u2063"  # no letters: survives a template that changes case
        rendered = self._render([{"role": "user", "content": "u"}, {"role": "assistant", "content": probe}], False)
        if probe not in rendered:
            raise ValueError("the chat template does not render an assistant message's content verbatim")
        after = rendered[rendered.index(probe) + len(probe):]
        for i in sorted(self.eos_token_ids):
            text = self.tok.decode([i], skip_special_tokens=False)
            if text and after.startswith(text):
                return i
        raise ValueError(f"the chat template closes an assistant turn with {after[:20]!r}, which starts with none of the "
                         f"EOS tokens {sorted(self.eos_token_ids)}: a model could not end a turn the template can continue")

    def start(self, messages: list[dict[str, Any]]) -> tuple[ChatState, list[int]]:
        """The first prompt: the conversation rendered with the generation prompt, encoded once."""
        text = self._render(messages, True)
        return ChatState(list(messages), text), self.tok.encode(text, add_special_tokens=False)

    def turn_text(self, sampled_ids: list[int]) -> tuple[str, bool]:
        """(the model's text of a turn without its end-of-turn token, whether it ended with that token)."""
        ended = bool(sampled_ids) and sampled_ids[-1] == self.end_of_turn_id
        body = sampled_ids[:-1] if ended else sampled_ids
        return self.tok.decode(body, skip_special_tokens=False), ended

    def append_turn(self, state: ChatState, sampled_ids: list[int], new_messages: list[dict[str, Any]]) -> list[int]:
        """Record the model's turn (its exact text as the assistant message) and `new_messages`
        (tool results, a user turn); return the ids to append after the sampled ones: the
        template's text between the end-of-turn token and the next generation prompt, inclusive."""
        content, ended = self.turn_text(sampled_ids)
        if not ended:
            raise TemplateNotAppendOnly(f"turn {state.num_turns + 1} did not end with the template's end-of-turn token "
                                        f"{self.end_of_turn_id}; it cannot be continued")
        stream = state.text + self.tok.decode(sampled_ids, skip_special_tokens=False)
        messages = state.messages + [{"role": "assistant", "content": content}] + new_messages
        rendered = self._render(messages, True)
        if not rendered.startswith(stream):
            i = _first_difference(rendered, stream)
            raise TemplateNotAppendOnly(
                f"turn {state.num_turns + 1}: the template's rendering of the conversation differs from the token stream "
                f"at character {i}: rendered {rendered[i:i + 40]!r}, stream {stream[i:i + 40]!r}")
        state.sampled_spans.append((len(state.text), len(stream)))
        state.messages, state.text = messages, rendered
        state.num_turns += 1
        # The delta starts right after a special token, where BPE pre-tokenization starts afresh,
        # so its ids are the ones encoding the whole text would give there.
        return self.tok.encode(rendered[len(stream):], add_special_tokens=False)

    def finish_turn(self, state: ChatState, sampled_ids: list[int]) -> None:
        """Record a last turn (nothing is appended after it)."""
        content, _ = self.turn_text(sampled_ids)
        start = len(state.text)
        state.text += self.tok.decode(sampled_ids, skip_special_tokens=False)
        state.sampled_spans.append((start, len(state.text)))
        state.messages = state.messages + [{"role": "assistant", "content": content}]
        state.num_turns += 1
