"""Text <-> token ids for a checkpoint: `tokenizers` (tokenizer.json, or Mistral's tekken.json read
by engine/ranked_bpe.py), the chat template from tokenizer_config.json rendered with jinja2
(sandboxed), and incremental detokenization.

Owns the special-token and template conventions of HF checkpoints; the template is rendered as
transformers' `apply_chat_template` renders it (the same sandbox, extensions and filters, its
`continue_final_message` cut, reasoning fields aliased), so a prompt equals the oracle's. A
template other than the checkpoint's (`--chat-template`, a request's `chat_template`) is
compiled once and cached. The incremental detokenizer never emits a partial UTF-8 character:
text is released only once the bytes decode cleanly.
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from datetime import datetime
from typing import Any

import jinja2.ext
from jinja2 import meta
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from cuttle.engine.ranked_bpe import tekken_tokenizer


def _token_content(tok: Any) -> str | None:
    if tok is None:
        return None
    return tok["content"] if isinstance(tok, dict) else str(tok)


class Tokenizer:
    def __init__(self, path: str):
        tok_file = os.path.join(path, "tokenizer.json")
        tekken = os.path.join(path, "tekken.json")
        cfg: dict[str, Any] = {}
        if os.path.isfile(tok_file):
            self.tok = HFTokenizer.from_file(tok_file)
        elif os.path.isfile(tekken):  # Mistral's own vocabulary file (engine/ranked_bpe.py)
            self.tok = tekken_tokenizer(tekken)
            # (such a repo may have no tokenizer_config.json: its BOS / EOS are Mistral's)
            cfg = {k: v for k, v in (("bos_token", "<s>"), ("eos_token", "</s>")) if self.tok.token_to_id(v) is not None}
        else:
            how = (" (it has tiktoken.model, a vocabulary cuttle does not read: convert it to tokenizer.json, e.g. with "
                   "transformers' TikTokenConverter, and save it beside it)" if os.path.isfile(os.path.join(path, "tiktoken.model")) else "")
            raise FileNotFoundError(f"model directory {path!r} has no tokenizer.json{how}")
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            with open(cfg_file) as f:
                cfg.update(json.load(f))
        self.chat_template: str | None = cfg.get("chat_template")
        tmpl_file = os.path.join(path, "chat_template.jinja")
        if self.chat_template is None and os.path.isfile(tmpl_file):
            with open(tmpl_file) as f:
                self.chat_template = f.read()
        processor_file = os.path.join(path, "chat_template.json")  # where a vision-language repo's processor keeps it
        if self.chat_template is None and os.path.isfile(processor_file):
            with open(processor_file) as f:
                self.chat_template = json.load(f).get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take the default one
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default", next(iter(named.values())))
        self.bos_token = _token_content(cfg.get("bos_token"))
        self.eos_token = _token_content(cfg.get("eos_token"))
        self.eos_token_id = self.tok.token_to_id(self.eos_token) if self.eos_token else None
        self.special_ids = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        # transformers' environment: loop controls ({% break %}), its tojson (no HTML escaping)
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        self._env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )
        self._env.globals["raise_exception"] = _raise
        self._env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._compiled = self._env.from_string(self.chat_template) if self.chat_template else None
        self._other: OrderedDict[str, Any] = OrderedDict()  # other templates, compiled (LRU)
        self._variables: dict[str, frozenset[str]] = {}
        self._developer: dict[str, bool] = {}  # template source -> whether it renders a developer message
        self._mapping_args: dict[str, bool] = {}  # template source -> whether it needs tool-call arguments as objects
        self._token_text: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_continuation(self, prompt_ids: list[int], output_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `output_ids` as it reads after the prompt (the same text the incremental
        detokenizer streams: spacing between the prompt and the output is kept)."""
        ctx = prompt_ids[-5:]
        prefix = self.decode(ctx, skip_special_tokens)
        full = self.decode(ctx + output_ids, skip_special_tokens)
        # a prompt ending inside a UTF-8 character decodes with a trailing U+FFFD that the output
        # completes: the character counts as the prompt's, as the incremental detokenizer has it
        if full.startswith(prefix.rstrip("\ufffd")) and len(full) >= len(prefix):
            return full[len(prefix) :]
        return self.decode(output_ids, skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text with special tokens kept (`Logprob.decoded_token`, logprob pieces);
        cached, as logprobs ask for the same few thousand ids again and again."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tok.decode([token_id], skip_special_tokens=False)
        return text

    def compile_template(self, source: str | None) -> Any:
        """The compiled template: the checkpoint's for None, else `source` (cached; a syntax
        error is a ValueError)."""
        if source is None or source == self.chat_template:
            if self._compiled is None:
                raise ValueError("this checkpoint's tokenizer_config.json has no chat_template (give one with --chat-template)")
            return self._compiled
        compiled = self._other.get(source)
        if compiled is None:
            try:
                compiled = self._env.from_string(source)
            except TemplateError as e:
                raise ValueError(f"chat template does not compile: {e}") from e
            self._other[source] = compiled
            if len(self._other) > 16:
                self._other.popitem(last=False)
        else:
            self._other.move_to_end(source)
        return compiled

    def template_variables(self, source: str | None) -> frozenset[str]:
        """The names a template reads from its context (what `chat_template_kwargs` can set)."""
        self.compile_template(source)  # a template that does not compile is refused first
        source = self.chat_template if source is None else source
        names = self._variables.get(source)
        if names is None:
            # the environment's own globals (range, namespace, raise_exception) are not the caller's to set
            names = frozenset(meta.find_undeclared_variables(self._env.parse(source))) - set(self._env.globals)
            self._variables[source] = names
            if len(self._variables) > 32:
                self._variables.pop(next(iter(self._variables)))
        return names

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The template's text for `messages`, as transformers renders it. `continue_final_message`:
        the text ends where the final message's content ends (no end-of-turn), for the model
        to go on with it; it excludes `add_generation_prompt`."""
        compiled = self.compile_template(chat_template)
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        messages = [_alias_reasoning(m) for m in messages]
        if any(_string_arguments(m) for m in messages) and self._needs_mapping_arguments(chat_template):
            # Qwen3-Coder's and GLM-4.5's templates iterate a call's arguments as an object, and
            # Mistral's, Llama 3.1's and Qwen2.5's write them with tojson (what transformers
            # documents, and vLLM sends): OpenAI's JSON text becomes one for them
            messages = [_object_arguments(m, i) for i, m in enumerate(messages)]
        if any(isinstance(m, dict) and m.get("role") == "developer" for m in messages) and not self._renders_developer(chat_template):
            # OpenAI's developer role is its system role: a template that would drop the message
            # (Qwen3's renders system, user, assistant and tool only) gets it as a system message
            messages = [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m for m in messages]
        final = None
        if continue_final_message:
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise ValueError("continue_final_message needs a final message with text content")
            # a marker after the final content shows where it ends once rendered (transformers' way)
            final = messages[-1]["content"]
            messages[-1] = {**messages[-1], "content": final + _CONTINUE_TAG}
        try:
            text = compiled.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except (TemplateError, TypeError) as e:  # (jinja's `items` filter on a non-mapping raises TypeError)
            raise ValueError(f"chat template failed: {e}") from e
        if final is not None:
            if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
                raise ValueError("continue_final_message: the chat template does not render the final message's content as given")
            at = text.rindex(_CONTINUE_TAG.strip())
            # a template that trims the content's trailing blanks also trimmed the marker's space
            text = text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        return text

    def _needs_mapping_arguments(self, chat_template: str | None) -> bool:
        """Whether the template wants a tool call's arguments as an object: it renders one, and
        fails on JSON text (Qwen3-Coder's `|items`) or writes that text as a JSON string (Mistral's
        `arguments|tojson`: the model would see its arguments quoted and escaped). Probed once per
        template, with a call id of 9 letters or digits, which Mistral's templates demand."""
        source = self.chat_template if chat_template is None else chat_template
        known = self._mapping_args.get(source or "")
        if known is None:
            compiled = self.compile_template(chat_template)

            def rendered(arguments: Any) -> str | None:
                call = {"id": "probecall", "type": "function", "function": {"name": "probe", "arguments": arguments}}
                try:
                    return compiled.render(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}],
                                           tools=None, add_generation_prompt=False, bos_token=self.bos_token or "", eos_token=self.eos_token or "")
                except Exception:  # noqa: BLE001 - any failure of the probe means "not this way"
                    return None

            as_text = rendered('{"k": 1}')
            known = rendered({"k": 1}) is not None and (as_text is None or '{\\"k\\": 1}' in as_text)
            self._mapping_args[source or ""] = known
            if len(self._mapping_args) > 32:
                self._mapping_args.pop(next(iter(self._mapping_args)))
        return known

    def _renders_developer(self, chat_template: str | None) -> bool:
        """Whether the template writes a developer message's content (probed once per template)."""
        source = self.chat_template if chat_template is None else chat_template
        known = self._developer.get(source or "")
        if known is None:
            probe = "\x1fdeveloper-probe\x1f"
            try:
                text = self.compile_template(chat_template).render(
                    messages=[{"role": "developer", "content": probe}, {"role": "user", "content": "hi"}], tools=None,
                    add_generation_prompt=True, bos_token=self.bos_token or "", eos_token=self.eos_token or "")
                known = probe in text
            except TemplateError:  # a template that refuses the role outright: send it as system
                known = False
            self._developer[source or ""] = known
            if len(self._developer) > 32:
                self._developer.pop(next(iter(self._developer)))
        return known

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        validate_messages(messages)
        # Templates already spell out BOS and role markers, so no special tokens are added again.
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


ROLES = ("system", "developer", "user", "assistant", "tool")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(m: dict[str, Any]) -> dict[str, Any]:
    """A message's reasoning under every name templates read (transformers does the same):
    `reasoning_content` (Qwen3), `thinking` (gpt-oss), from whichever the client sent."""
    if not isinstance(m, dict):
        return m
    reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
    return m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning}


def _string_arguments(m: Any) -> bool:
    return isinstance(m, dict) and any(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                       and isinstance(c["function"].get("arguments"), str) for c in m.get("tool_calls") or ())


def _object_arguments(m: Any, i: int) -> Any:
    """`m` (messages[i]) with each tool call's JSON-text arguments as the object they encode, for
    a template that takes them as one; text that is not a JSON object is refused, naming it (such
    a template would fail on it, or quote it as a string the model never saw there)."""
    if not _string_arguments(m):
        return m
    calls = []
    for j, c in enumerate(m["tool_calls"]):
        args = c.get("function", {}).get("arguments") if isinstance(c, dict) else None
        if isinstance(args, str):
            try:
                parsed = json.loads(args) if args.strip() else {}
            except (json.JSONDecodeError, RecursionError):  # (too deeply nested JSON: RecursionError)
                parsed = None
            if not isinstance(parsed, dict):
                raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object as text: the chat "
                                 f"template writes a call's arguments as an object (got {args[:60]!r})")
            c = {**c, "function": {**c["function"], "arguments": parsed}}
        calls.append(c)
    return {**m, "tool_calls": calls}


def validate_messages(messages: list[dict[str, Any]]) -> None:
    """Chat messages as the OpenAI API defines them; templates render missing fields silently."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
        content = m.get("content")
        if content is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise ValueError(f"messages[{i}].content is required")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts")


def _raise(msg: str) -> None:
    raise TemplateError(msg)


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas (the offsets scheme vLLM and TGI use).

    `prefix_offset..read_offset` is a window of already-emitted tokens decoded again for context
    (byte-level BPE and sentencepiece spacing depend on neighbours); text from `read_offset` on is
    emitted only when it does not end in U+FFFD, i.e. when its UTF-8 is complete.
    """

    __slots__ = ("tokenizer", "skip_special", "prefix_offset", "read_offset")

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.read_offset = len(prompt_ids)
        self.prefix_offset = max(len(prompt_ids) - 5, 0)

    def step(self, all_ids: list[int]) -> str:
        dec = self.tokenizer.decode
        prefix = dec(all_ids[self.prefix_offset : self.read_offset], self.skip_special)
        full = dec(all_ids[self.prefix_offset :], self.skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(all_ids)
            return full[len(prefix) :]
        return ""
