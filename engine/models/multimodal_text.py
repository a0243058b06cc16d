"""The text model of a vision-language checkpoint, served alone: Mistral Small 3.1 / 3.2 and
Magistral / Devstral checkpoints published as `Mistral3ForConditionalGeneration` (a Pixtral vision
encoder, a projector and a Mistral decoder).

Owns the translation only: `text_config_of` turns such a config into its `text_config` as a
causal-LM config (marked `TEXT_OF`), and `text_tensors` renames the decoder's tensors to a causal
LM's names (the older `language_model.model.*` / `language_model.lm_head.*` and transformers 5's
`model.language_model.*` alike) and drops the vision encoder's and the projector's, which cuttle
does not load: image inputs are refused where requests are read (only text parts are accepted).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

TEXT_OF = "text_of"  # set in the translated config: the architecture whose text model it is
VISION_LANGUAGE_ARCHITECTURES = ("Mistral3ForConditionalGeneration",)
# the text models' model_type -> the causal-LM architecture cuttle serves them as
_TEXT_ARCHITECTURES = {"mistral": "MistralForCausalLM", "ministral3": "Ministral3ForCausalLM", "llama": "LlamaForCausalLM"}
_RENAMES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."), ("model.language_model.", "model."))
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_config_of(hf: dict[str, Any], path: str = "") -> dict[str, Any]:
    """A vision-language config -> its text model's config, as a causal LM's config.json reads."""
    arch = next(a for a in hf.get("architectures") or [] if a in VISION_LANGUAGE_ARCHITECTURES)
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{arch} config in {path or 'config'} has no text_config")
    kind = text.get("model_type", "mistral")
    causal = _TEXT_ARCHITECTURES.get(kind)
    if causal is None:
        raise ValueError(f"{arch} in {path or 'config'}: its text model is {kind!r}, which cuttle does not serve "
                         f"(supported: {', '.join(_TEXT_ARCHITECTURES)})")
    out = {"torch_dtype": hf.get("torch_dtype", hf.get("dtype")), **text, "architectures": [causal], "model_type": kind, TEXT_OF: arch}
    for key in ("eos_token_id", "bos_token_id"):
        if out.get(key) is None and hf.get(key) is not None:
            out[key] = hf[key]
    if "tie_word_embeddings" in hf:  # transformers ties the head by the top-level field where it is given
        out["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return out


def text_tensor_name(name: str) -> str | None:
    """A vision-language checkpoint's tensor name -> the causal LM's, or None for the vision side."""
    if name.startswith(_VISION):
        return None
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def text_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in tensors:
        renamed = text_tensor_name(name)
        if renamed is not None:
            yield renamed, t
