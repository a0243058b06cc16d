"""Fill in the middle: the prompt a code model trained on infilling reads for "the code between
this prefix and this suffix" (the OpenAI completions `suffix` field).

Owns which infilling format a checkpoint speaks and how a prefix and a suffix become its prompt
ids; nothing about sampling (the model writes the middle as any completion, ending at its end of
sequence token or a stop string). A format is three special tokens in prefix-suffix-middle order
(PSM), the layout these families were trained on:

- `qwen`: `<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>` (Qwen2.5-Coder, Qwen3-Coder,
  CodeGemma),
- `starcoder`: `<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>` (StarCoder / StarCoder2,
  SantaCoder, Granite Code),
- `deepseek`: `<｜fim▁begin｜>{prefix}<｜fim▁hole｜>{suffix}<｜fim▁end｜>` (DeepSeek-Coder), after
  its BOS.

and one in suffix-prefix order with no middle marker:

- `mistral`: `<s>[SUFFIX]{suffix}[PREFIX]{prefix}` (Codestral, Devstral: mistral_common's
  `encode_fim`), the suffix encoded as mistral_common encodes an infill (`"☺" + suffix` with its
  first two tokens dropped: a SentencePiece vocabulary's dummy-prefix space goes with them), the
  middle written after the prefix. Checked against mistral_common on its own Tekken and
  SentencePiece v3 vocabularies, converted to tokenizer.json as the HF repos ship them.

An infilling request also stops at the format's control tokens the vocabulary has (its three
markers, and the family's pad and repository / file separators): a model that writes one has
left the middle, and its text would otherwise run on into the next file.

A checkpoint's format is the one whose three tokens are all single tokens of its tokenizer;
none (the embedded model, a chat model without them, Code Llama's spaced `▁<PRE>` layout) means
`suffix` is refused, naming the field: a guessed layout would give
plausible but untrained text. The ids equal the tokenizer's encoding of the documented template
string as a whole (added tokens split text before the pre-tokenizer, so the pieces are encoded
alone), which tests check against `tokenizers` and transformers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cuttle.engine.tokenizer import Tokenizer

# name -> (prefix, suffix, middle) token texts, in the order detection tries them
FORMATS: dict[str, tuple[str, str, str]] = {
    "qwen": ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    "starcoder": ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    "deepseek": ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
}
# name -> the family's other control tokens an infill stops at (where the vocabulary has them)
STOP_TEXTS: dict[str, tuple[str, ...]] = {
    "qwen": ("<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"),
    "starcoder": ("<fim_pad>", "<reponame>", "<filename>", "<file_sep>"),
    "deepseek": (),
}
# Mistral's infilling tokens (prefix, suffix, middle: all three are in its vocabularies; the
# prompt uses the first two) and the BOS its prompts always start with
MISTRAL = ("[PREFIX]", "[SUFFIX]", "[MIDDLE]")
MISTRAL_BOS = "<s>"


@dataclass(frozen=True)
class FimFormat:
    """One checkpoint's infilling tokens (ids in its vocabulary)."""

    name: str
    prefix_id: int
    suffix_id: int
    middle_id: int
    stop_ids: tuple[int, ...] = ()  # the control tokens an infill stops at
    head_ids: tuple[int, ...] = ()  # what the tokenizer puts before a text (DeepSeek-Coder's BOS), or the format's own (Mistral's)

    @classmethod
    def of(cls, tok: Tokenizer) -> FimFormat | None:
        """The format whose three tokens `tok` has, or None."""
        for name, texts in FORMATS.items():
            ids = [tok.tok.token_to_id(t) for t in texts]
            if all(i is not None for i in ids):
                extra = [tok.tok.token_to_id(t) for t in STOP_TEXTS[name]]
                return cls(name, *ids, stop_ids=tuple(ids) + tuple(i for i in extra if i is not None),
                           head_ids=tuple(_leading_specials(tok)))
        ids = [tok.tok.token_to_id(t) for t in (*MISTRAL, MISTRAL_BOS)]
        if all(i is not None for i in ids):
            return cls("mistral", *ids[:3], stop_ids=tuple(ids[:3]), head_ids=(ids[3],))
        return None

    def prompt_ids(self, tok: Tokenizer, prefix: str | list[int], suffix: str, head: bool = True) -> list[int]:
        """The infilling prompt: a text prefix is encoded as a text prompt is (with the
        tokenizer's BOS where it adds one, ahead of the prefix token); a token-id prefix is
        taken as given (no BOS added, as for a token-id prompt). `head=False` leaves the BOS
        out: the query after squid documents, whose layout starts with it instead."""
        if isinstance(prefix, str):
            lead = list(self.head_ids) if head else []
            body = tok.encode(prefix, add_special_tokens=False)
        else:
            lead, body = [], list(prefix)
        if self.name == "mistral":  # mistral_common's encode_fim: BOS, suffix first, the middle after the prefix
            infill = tok.encode("☺" + suffix, add_special_tokens=False)[2:] if suffix else []
            return [*lead, self.suffix_id, *infill, self.prefix_id, *body]
        return [*lead, self.prefix_id, *body, self.suffix_id, *tok.encode(suffix, add_special_tokens=False), self.middle_id]


def _leading_specials(tok: Tokenizer) -> list[int]:
    """The ids the tokenizer's post-processor puts before a text (a BOS, for DeepSeek-Coder's;
    none for Qwen's or StarCoder's): the head of a marker's encoding with special tokens, where
    the marker alone gives none."""
    marker = "a"
    bare = tok.encode(marker, add_special_tokens=False)
    full = tok.encode(marker, add_special_tokens=True)
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return full[:i]
    return []
