"""How a chat request's messages become prompt text, for /v1/chat/completions and /tokenize: the
template (the request's `chat_template`, else the server's `--chat-template`, else the
checkpoint's), `chat_template_kwargs`, `add_generation_prompt` / `continue_final_message`, and the
prompt's tail that a reasoning parser starts from, and the replay of the model's exact text for
assistant turns whose tool calls this server produced.

Owns those fields' checks, each a 400 naming the field, `load_chat_template` (the
`--chat-template` argument, vLLM's rules) and `ToolCallReplay`. It renders through
`Tokenizer.apply_chat_template` and never tokenizes, places documents or decides tool calls.
"""
from __future__ import annotations

import codecs
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from cuttle.engine.openai_protocol import OpenAIError, get_bool, get_str
from cuttle.engine.tokenizer import Tokenizer

# What the server itself passes to a template: a request sets these through their own fields
# (or not at all), never through chat_template_kwargs.
_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template", "bos_token",
                       "eos_token", "documents"})


@dataclass(slots=True)
class ChatOptions:
    """The server's chat settings (the `cuttle serve` flags)."""

    tool_parser: str = "hermes"
    reasoning_parser: str | None = None  # qwen3 | deepseek_r1 | glm45 (reasoning_parsers.py)
    chat_template: str | None = None  # --chat-template's text (None: the checkpoint's)
    trust_request_chat_template: bool = False  # a request's own chat_template is refused unless set
    enable_auto_tool_choice: bool = True  # tool_choice "auto" parses tool calls (vLLM needs the flag; cuttle's default)
    foreign_tool_format: str | None = None  # the template teaches a tool-call format no parser reads: tools are refused


@dataclass(slots=True)
class ChatTemplate:
    """One request's template fields, checked."""

    source: str | None
    kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def render(self, tok: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool | None = None, continue_final_message: bool | None = None) -> str:
        """The prompt text (a template failure is a 400 naming messages)."""
        agp = self.add_generation_prompt if add_generation_prompt is None else add_generation_prompt
        cfm = self.continue_final_message if continue_final_message is None else continue_final_message
        try:
            return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=agp, continue_final_message=cfm,
                                           chat_template=self.source, **self.kwargs)
        except (ValueError, TypeError) as e:  # the template could not render these messages
            raise OpenAIError(str(e), param="messages") from None

    def tail(self, tok: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, text: str) -> str:
        """What the template wrote for the turn the model goes on with: the generation prompt
        (`text` less the rendering without it), or the final message's turn when it is
        continued (`text` less the rendering of the messages before it; its content alone when
        that is not a prefix: a template may close a thinking block before it, as Qwen3's does).
        A reasoning parser reads where the output starts from it."""
        if not (self.add_generation_prompt or self.continue_final_message):
            return ""
        before = messages[:-1] if self.continue_final_message else messages
        fallback = messages[-1]["content"] if self.continue_final_message else ""
        try:
            head = tok.apply_chat_template(before, tools=tools, add_generation_prompt=False, chat_template=self.source,
                                           **self.kwargs) if before else ""
        except (ValueError, TypeError):
            return fallback
        return text[len(head):] if text.startswith(head) else fallback


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's reasoning effort values


def effort_kwargs(effort: Any, template_reads: set[str], param: str, what: str) -> dict[str, Any]:
    """A reasoning effort as the chat template reads it: its own `reasoning_effort` variable where
    it has one (gpt-oss's), or "none" as `enable_thinking: false` (Qwen3's); any other effort on a
    template without the variable is a 400 naming `param`, since it would change nothing. `what`
    names the field in messages (`reasoning_effort`, `reasoning.effort`)."""
    if effort not in EFFORTS:
        raise OpenAIError(f"{what} {effort!r} is not one of {', '.join(EFFORTS)}", param=param)
    if "reasoning_effort" in template_reads:
        return {"reasoning_effort": effort}
    if effort == "none" and "enable_thinking" in template_reads:
        return {"enable_thinking": False}
    raise OpenAIError(f"{what} {effort!r} is not supported by this model's chat template: it reads no reasoning_effort "
                      "variable" + (" (effort 'none' turns thinking off)" if "enable_thinking" in template_reads else ""),
                      param=param)


def read_chat_template(body: dict[str, Any], tok: Tokenizer, opts: ChatOptions) -> ChatTemplate:
    """The request's `chat_template`, `chat_template_kwargs`, `reasoning_effort` (OpenAI's chat
    field: `effort_kwargs`), `add_generation_prompt` and `continue_final_message`, as vLLM reads
    them; anything cuttle cannot honour is a 400."""
    source = opts.chat_template
    own = get_str(body, "chat_template")
    if own is not None:
        if not opts.trust_request_chat_template:
            raise OpenAIError("chat_template in a request is refused: this server was not started with "
                              "--trust-request-chat-template", param="chat_template")
        source = own
    try:
        names = tok.template_variables(source)
    except ValueError as e:
        raise OpenAIError(str(e), param="chat_template" if own is not None else "messages") from None
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise OpenAIError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    for k in kwargs:
        if k in _RESERVED:
            raise OpenAIError(f"chat_template_kwargs.{k} is refused: the server sets {k} itself (use the request field "
                              "of that name where there is one)", param="chat_template_kwargs")
        if k not in names:
            # passing it would change nothing: refused, never silently dropped
            readable = sorted(n for n in names if n not in _RESERVED)
            raise OpenAIError(f"chat_template_kwargs.{k} is not read by the chat template (it reads: "
                              f"{', '.join(readable) or 'nothing else'})", param="chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None:
        extra = effort_kwargs(effort, names, "reasoning_effort", "reasoning_effort")
        clash = [k for k, v in extra.items() if k in kwargs and kwargs[k] != v]
        if clash:
            raise OpenAIError(f"reasoning_effort sets {clash[0]}, which chat_template_kwargs sets otherwise", param="reasoning_effort")
        kwargs = {**kwargs, **extra}
    agp = get_bool(body, "add_generation_prompt", True)
    cfm = get_bool(body, "continue_final_message", False)
    if agp and cfm:
        raise OpenAIError("continue_final_message and add_generation_prompt cannot both be true (set "
                          "add_generation_prompt: false to continue the final message)", param="continue_final_message")
    return ChatTemplate(source, dict(kwargs), agp, cfm)


def check_continuable(messages: list[dict[str, Any]], tmpl: ChatTemplate) -> None:
    """continue_final_message goes on with the final message's text: there must be some."""
    if tmpl.continue_final_message and not (isinstance(messages[-1].get("content"), str) and messages[-1]["content"]):
        raise OpenAIError("continue_final_message needs a final message with non-empty text content",
                          param="continue_final_message")


def load_chat_template(arg: str | None) -> str | None:
    """`--chat-template`: a file's text, or the argument itself when it is inline Jinja (vLLM's
    rule: an argument that cannot be opened is a template if it holds `{`, `}` or a newline, with
    backslash escapes such as `\\n` decoded; otherwise it was meant as a path, and the error says so)."""
    if arg is None:
        return None
    try:
        with open(arg) as f:
            return f.read()
    except OSError as e:
        if not any(c in arg for c in "{}\n"):
            raise ValueError(f"--chat-template {arg!r} looks like a file path, but it cannot be opened: {e}") from None
        return codecs.decode(arg, "unicode_escape")


class ToolCallReplay:
    """The model's exact text for the assistant turns this server answered with tool calls.

    A client sends a tool-calling turn back as `content` + `tool_calls` (arguments as JSON text);
    the template re-serializes those its own way (spacing, key order, escapes), so the next prompt
    would hold other tokens than the model sampled and the prefix cache would miss from the first
    call on. The server remembers, per turn, the ids of the calls it returned (random, never
    chosen by a client), their names and arguments, the content it returned and the model's whole
    text of the turn; an assistant message that names exactly those calls with the same names,
    arguments and content is rendered from that text instead (the template writes an assistant
    `content` verbatim). Anything else (an unknown id, another argument, edited content, a turn
    evicted from the bounded map) is rendered by the template as sent, so a client can never make
    the server render text it did not produce for those very calls. Turns with reasoning split out
    (`--reasoning-parser`) or echoed text are not recorded: their exact text is not what the
    client holds.
    """

    def __init__(self, max_turns: int = 4096):
        self.max_turns = max_turns
        self._turns: OrderedDict[tuple[str, ...], tuple[str, str, list[tuple[str, str]]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._turns)

    def record(self, text: str, content: str | None, calls: list[dict[str, Any]]) -> None:
        """`text`: the model's whole turn; `content` and `calls` (OpenAI tool_calls) as returned."""
        if not calls:
            return
        key = tuple(c["id"] for c in calls)
        self._turns[key] = (text, (content or "").strip(), [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
        self._turns.move_to_end(key)
        while len(self._turns) > self.max_turns:
            self._turns.popitem(last=False)

    def restore(self, messages: list[dict[str, Any]], keep_last: bool = False) -> list[dict[str, Any]]:
        """`messages` with every recognised assistant tool-call turn rendered from the model's text
        (`keep_last`: the final message is left as sent, e.g. when it is being continued)."""
        out = []
        for i, m in enumerate(messages):
            exact = None if keep_last and i == len(messages) - 1 else self._exact(m)
            out.append(m if exact is None else {"role": "assistant", "content": exact})
        return out

    def _exact(self, m: dict[str, Any]) -> str | None:
        calls = m.get("tool_calls")
        if m.get("role") != "assistant" or not calls or m.get("reasoning_content"):
            return None
        entry = self._turns.get(tuple(c.get("id") for c in calls))
        if entry is None:
            return None
        text, content, sent = entry
        if not isinstance(m.get("content") or "", str) or (m.get("content") or "").strip() != content:
            return None
        for c, (name, arguments) in zip(calls, sent):
            f = c["function"]
            args = f.get("arguments", "")
            if f["name"] != name or not _same_arguments(args, arguments):
                return None
        return text


def _same_arguments(sent_back: str | dict[str, Any], ours: str) -> bool:
    if isinstance(sent_back, str):
        return sent_back == ours
    try:  # a client may send the arguments back parsed, as an object
        return json.loads(ours) == sent_back
    except (json.JSONDecodeError, RecursionError):  # (too deeply nested JSON: RecursionError)
        return False
