"""gpt-oss's conversations as token deltas: `ChatTokens` for a model whose turns are harmony messages.

The first prompt is the chat template's rendering (tools in its developer message), encoded once,
as for any model. After that nothing is rendered by the template: gpt-oss's template does not
render a past turn as the model wrote it (it re-serializes calls, drops analysis once an answer
follows), so the append-only check of `ChatTokens` would end every episode at its first turn.
Instead each turn appends the model's sampled ids as they are, closed by the stop token it
sampled (`<|call|>` for a turn of tool calls), then the harmony messages of the tool results,
written as the template writes them,

    <|start|>functions.NAME to=assistant<|channel|>commentary<|message|>RESULT<|end|>

(a user message `<|start|>user<|message|>TEXT<|end|>`), and the next generation prompt
`<|start|>assistant`. Every delta starts right after a special token, where byte-level BPE starts
afresh, so its ids are those encoding the whole stream would give there; the sampled ids are never
encoded again.

A turn ends with `<|call|>` (calls: the episode goes on) or `<|return|>` (the answer); both are
end-of-turn here. A turn that ended with `<|return|>` cannot be continued (the model has answered).
"""
from __future__ import annotations

from typing import Any

from cuttle.engine.tokenizer import Tokenizer
from cuttle.rl.chat import ChatState, ChatTokens, TemplateNotAppendOnly

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>")


class HarmonyChatTokens(ChatTokens):
    """`ChatTokens` for harmony turns: its rendering of the first prompt and its `finish_turn`,
    its own end of turn (two stop tokens) and its own appended messages."""

    def __init__(self, tokenizer: Tokenizer, tools: list[dict[str, Any]] | None, eos_token_ids: set[int] | list[int]):
        # (not ChatTokens.__init__: its end-of-turn probe reads a template that renders a turn verbatim)
        self.tok = tokenizer
        self.tools = tools
        self.eos_token_ids = set(eos_token_ids)
        ids = {}
        for m in MARKERS:
            enc = tokenizer.encode(m, add_special_tokens=False)
            if len(enc) != 1:
                raise ValueError(f"a harmony conversation needs {m!r} as one token; this tokenizer encodes it as {enc}")
            ids[m] = enc[0]
        missing = [m for m in ("<|call|>", "<|return|>") if ids[m] not in set(eos_token_ids)]
        if missing:
            raise ValueError(f"{missing} must be among the model's EOS tokens {sorted(eos_token_ids)}: they end harmony turns")
        self.end_of_turn_id = ids["<|call|>"]  # the end of a turn the conversation continues from
        self.answer_id = ids["<|return|>"]

    def start(self, messages: list[dict[str, Any]]) -> tuple[ChatState, list[int]]:
        """The first prompt: the conversation rendered by the template, encoded once."""
        state, ids = super().start(messages)
        if not state.text.endswith("<|start|>assistant"):
            raise ValueError(f"the chat template's generation prompt ends with {state.text[-30:]!r}, not harmony's "
                             "'<|start|>assistant'")
        return state, ids

    def turn_text(self, sampled_ids: list[int]) -> tuple[str, bool]:
        """(the model's text of a turn without its stop token, whether it ended with `<|call|>` or `<|return|>`)."""
        ended = bool(sampled_ids) and sampled_ids[-1] in (self.end_of_turn_id, self.answer_id)
        body = sampled_ids[:-1] if ended else sampled_ids
        return self.tok.decode(body, skip_special_tokens=False), ended

    def append_turn(self, state: ChatState, sampled_ids: list[int], new_messages: list[dict[str, Any]]) -> list[int]:
        """Record the model's turn and `new_messages` (tool results with their `name`, or a user
        turn); return the ids that follow the sampled ones: those messages and `<|start|>assistant`."""
        content, ended = self.turn_text(sampled_ids)
        if not ended or sampled_ids[-1] != self.end_of_turn_id:
            how = "was cut before its stop token" if not ended else "ended with <|return|> (the answer)"
            raise TemplateNotAppendOnly(f"turn {state.num_turns + 1} {how}; a harmony conversation goes on only after <|call|>")
        delta = "".join(self._message(m) for m in new_messages) + "<|start|>assistant"
        start = len(state.text)
        state.text += self.tok.decode(sampled_ids, skip_special_tokens=False)
        state.sampled_spans.append((start, len(state.text)))
        state.text += delta
        state.messages = state.messages + [{"role": "assistant", "content": content}] + new_messages
        state.num_turns += 1
        return self.tok.encode(delta, add_special_tokens=False)

    @staticmethod
    def _message(m: dict[str, Any]) -> str:
        role, content = m.get("role"), m.get("content")
        if not isinstance(content, str):
            raise ValueError(f"a {role} message's content must be text here, got {type(content).__name__}")
        if role == "tool":
            name = m.get("name") or "tool"
            return f"<|start|>functions.{name} to=assistant<|channel|>commentary<|message|>{content}<|end|>"
        if role == "user":
            return f"<|start|>user<|message|>{content}<|end|>"
        raise ValueError(f"a {role!r} message cannot follow a turn in a harmony conversation (tool or user)")
