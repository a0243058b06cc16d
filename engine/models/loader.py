"""Builds a model from an HF checkpoint directory: architecture check, safetensors (single file
or sharded index, memory-mapped), HF tensor names sliced into the fused parameters.

Owns the name mapping from HF layouts to `CausalLM`: every family's attention (q|k|v or MLA),
dense MLPs, routed experts (per-expert, Mixtral's w1/w2/w3, transformers-5 fused, gpt-oss's
interleaved ones with biases and MXFP4 blocks (`gpt_oss_checkpoint`), MXFP8 as
`cuttle.moe.checkpoint` writes them), routers, expert-choice biases, shared experts, and NSA
layers' gates and compression weights. Every parameter must be filled exactly once from a tensor
of the right shape; anything else is a clear error naming the tensor. Quantizing experts is
`moe_quant`'s job; this module only routes tensors.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open

from cuttle.engine.config import BLOCK_SPARSE_MOE_ARCHITECTURES, DEEPSEEK_MOE_ARCHITECTURES, ModelConfig
from cuttle.engine.models.fp8_checkpoint import dequantized_tensors
from cuttle.engine.models import gpt_oss_checkpoint
from cuttle.engine.models.linear_quant import (MXLinearWeight, prepare_quantized_linears, quantized_linears, refresh_tied,
                                               write_quantized_linear)
from cuttle.engine.models.moe_quant import moe_layers, prepare_quantized_experts, unpack_experts, write_quantized
from cuttle.engine.models.nsa_config import FLA_MARK, fla_tensors
from cuttle.engine.models.multimodal_text import TEXT_OF, text_tensors
from cuttle.engine.models.mtp import MTP_TENSORS
from cuttle.engine.models.transformer import CausalLM
from cuttle.moe import FusedMoE
from cuttle.moe.checkpoint import is_quantized_checkpoint


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise FileNotFoundError(f"checkpoint {path!r} is missing shards listed in its index: {missing}")
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"checkpoint {path!r} has no *.safetensors weights")
    return [os.path.join(path, f) for f in found]


def iter_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Per-expert layouts: Qwen / DeepSeek `mlp.experts.N.{gate,up,down}_proj`, Mixtral
# `block_sparse_moe.experts.N.{w1,w3,w2}` (w1 = gate, w3 = up, w2 = down).
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
# transformers-5 fused layout (its in-memory names, also what a trainer's weight update sends);
# gpt-oss's are transposed and interleaved, with biases (`gpt_oss_checkpoint`)
_FUSED_EXPERTS = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)(_bias)?$")
# the engine's own stacked expert parameters (what a trainer on this model code holds); for an
# MXFP8 layer they are no longer parameters, so they are routed here to be re-quantized
_NATIVE_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.(w13|w2)$")
# MXFP8 experts as `cuttle.moe.checkpoint` writes them: `<experts prefix>.{w13_mx,w13_scale,w2_mx,w2_scale}`
_QUANTIZED = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(w13_mx|w13_scale|w2_mx|w2_scale)$")
# The only checkpoint tensors a load may leave unused, each for a stated reason; any other tensor
# the loader has no place for is an error (a scale, a bias or an adapter dropped silently would
# make the model compute something else).
IGNORED_TENSORS = (
    # RoPE tables some older checkpoints save; cuttle computes its own from the config
    # (per layer, or once under `model.` as transformers' in-memory state dicts name them)
    re.compile(r"^model\.(?:layers\.\d+\.self_attn\.)?rotary_emb\.(?:original_)?inv_freq$"),
)
# (Also skipped, by rule rather than by name: DeepSeek-V3's and GLM-4.5's multi-token-prediction layers, indices
# num_hidden_layers .. + num_nextn_predict_layers, which decoding does not use; and `lm_head.weight`
# of a checkpoint whose config ties it to the embedding.)

_QUANTIZED_DTYPES = {"w13_mx": torch.float8_e4m3fn, "w2_mx": torch.float8_e4m3fn,
                     "w13_scale": torch.float8_e8m0fnu, "w2_scale": torch.float8_e8m0fnu}


def is_expert_tensor(name: str) -> bool:
    """Whether an HF tensor name holds routed-expert weights (any layout, quantized or not)."""
    m = _LAYER.match(name)
    return m is not None and any(r.match(m.group(2)) for r in (_EXPERT, _FUSED_EXPERTS, _QUANTIZED))


def checkpoint_is_quantized(path: str) -> bool:
    """Whether any safetensors file of the checkpoint carries MXFP8 experts (by its header)."""
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            if is_quantized_checkpoint(f.metadata()):
                return True
    return False


Region = tuple  # (expert index, first row, end row): the part of a model tensor one write covered; () for all of it


def _region(index: int | None, rows: slice | None) -> Region:
    return () if index is None and rows is None else (index, *((rows.start, rows.stop) if rows is not None else (None, None)))


class _Filler:
    """Copies checkpoint tensors into (slices of) model tensors and records what was covered;
    `check_only`: checks the shapes and records, writing nothing (a weight update's first pass).
    Coverage is kept per region, so a tensor given twice counts once (`filled` may be a
    `WeightCoverage`'s, carried across loads)."""

    def __init__(self, check_only: bool = False, filled: dict[str, dict[Region, int]] | None = None) -> None:
        self.check_only = check_only
        self.filled: dict[str, dict[Region, int]] = {} if filled is None else filled  # model tensor -> region -> elements

    def put(self, name: str, dst: torch.Tensor, src: torch.Tensor, ckpt_name: str, rows: slice | None = None, index: int | None = None) -> None:
        region = _region(index, rows)
        if index is not None:
            dst = dst[index]
        if rows is not None:
            dst = dst[rows]
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"shape mismatch for {ckpt_name!r}: checkpoint has {tuple(src.shape)}, model expects {tuple(dst.shape)}")
        if not self.check_only:
            with torch.no_grad():
                dst.copy_(src)
        self.count(name, src.numel(), region)

    def count(self, name: str, numel: int, region: Region = ()) -> None:
        self.filled.setdefault(name, {})[region] = numel

    def covered(self, name: str) -> int:
        """Elements of `name` written (all of them once its whole was; the regions' sum otherwise:
        the regions one layout writes do not overlap)."""
        regions = self.filled.get(name, {})
        return regions[()] if () in regions else sum(regions.values())


def expert_layers_named(names: Iterable[str]) -> set[int]:
    """The layers whose routed experts tensors of these names (HF or engine names) write."""
    out = set()
    for name in names:
        m = _NATIVE_EXPERTS.match(name) or (_LAYER.match(name) if is_expert_tensor(name) else None)
        if m is not None:
            out.add(int(m.group(1)))
    return out


def _targets(model: CausalLM, expert_layers: set[int] | None = None) -> tuple[dict[str, torch.Tensor], dict[int, FusedMoE],
                                                                             dict[str, MXLinearWeight]]:
    """Every tensor a load writes, by the engine's name (tied names twice), with the MXFP8 expert
    layers and MXFP8 linears among them. Experts held packed are unpacked first, all of them or
    those of `expert_layers` (writes need the plain tensors; the engine packs them again
    afterwards, ModelRunner.prepack); a layer left packed has no expert targets."""
    unpack_experts(model, expert_layers)
    targets = dict(model.named_parameters(remove_duplicate=False))
    quantized = {i: layer for i, layer in moe_layers(model).items() if layer.quant == "mxfp8" and layer.packed is None}
    for i, layer in quantized.items():
        for field in _QUANTIZED_DTYPES:
            targets[f"layers.{i}.mlp.{field}"] = getattr(layer, field)
    mx_linears = quantized_linears(model)  # MXFP8 linears: written through write_quantized_linear
    if model.cfg.tie_word_embeddings:
        mx_linears.pop("lm_head", None)  # a tied MXFP8 lm_head is derived from the embedding (linear_quant.refresh_tied)
    targets.update({n: w.data for n, w in mx_linears.items()})
    return targets, quantized, mx_linears


def _missing(targets: dict[str, torch.Tensor], filler: _Filler, cfg: ModelConfig) -> list[str]:
    return [n for n, t in targets.items() if filler.covered(n) != t.numel() and not (cfg.tie_word_embeddings and n == "lm_head")]


class WeightCoverage:
    """Which of a model's weights have been written, over any number of loads: after
    `sleep(level=2)` discarded them, the engine takes the weights back through update_weights
    calls (a trainer sends them in buckets) and serves again only once none is missing."""

    def __init__(self, model: CausalLM) -> None:
        self.cfg = model.cfg
        self.targets, _, _ = _targets(model)
        self.filler = _Filler(filled={})
        self._names_of: dict[int, list[str]] = {}  # a tensor's names (a tied embedding has two)
        for n, t in self.targets.items():
            self._names_of.setdefault(id(t), []).append(n)

    def record_whole(self, tensor: torch.Tensor) -> None:
        """`tensor` (one of the model's own, by the engine's name) was written whole."""
        for n in self._names_of.get(id(tensor), []):
            self.filler.count(n, tensor.numel())

    def missing(self) -> list[str]:
        return _missing(self.targets, self.filler, self.cfg)


def load_model(path: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, moe_quant: str | None = None,
               quantization: str | None = None, quantize_lm_head: bool = False, mtp: bool = False) -> CausalLM:
    """Build and fill a model. `moe_quant="mxfp8"` quantizes routed experts as they load; a
    checkpoint whose experts are saved in MXFP8 (`cuttle.moe.checkpoint`) loads quantized either way.
    `quantization="mxfp8"` quantizes every attention and dense-MLP linear (`linear_quant`) and the
    routed experts, if any; `quantize_lm_head` (only with it) the lm_head too. An FP8 block-scaled
    checkpoint (`cfg.fp8_quant`) is dequantized to `dtype` as it loads. `mtp`: the checkpoint's first
    multi-token-prediction layer is loaded too (`CausalLM(mtp=True)`)."""
    if quantize_lm_head and quantization is None:
        raise ValueError("quantize_lm_head=True needs quantization='mxfp8' (the lm_head is quantized with the other linears)")
    model = CausalLM(cfg, dtype, device, mtp=mtp)
    if quantization is not None:
        prepare_quantized_linears(model, quantization, lm_head=quantize_lm_head)
        moe_quant = moe_quant or (quantization if moe_layers(model) else None)
    if moe_quant is not None or checkpoint_is_quantized(path):
        prepare_quantized_experts(model, moe_quant or "mxfp8")
    tensors = iter_tensors(path)
    if cfg.fp8_quant is not None:  # FP8 block-scaled weights, dequantized as they stream in
        tensors = dequantized_tensors(tensors, cfg.fp8_quant, path)
    load_weights(model, tensors, strict=True, source=path)
    model = model.to(device)
    refresh_tied(model)  # a tied MXFP8 lm_head: quantized from the embedding just loaded
    return model


def load_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = False, source: str = "weights",
                 check_only: bool = False, coverage: WeightCoverage | None = None,
                 written: list[torch.Tensor] | None = None) -> list[str]:
    """Copy HF-named tensors into the model's (fused) parameters, in place.

    `strict`: every parameter must be covered (loading a checkpoint); otherwise any subset may be
    given (a weight update). `check_only`: every name mapped and every shape checked, nothing
    written (a weight update checks all of its tensors before writing any). On a tied model,
    `lm_head.weight` is the embedding: a checkpoint's copy is skipped (HF ties it to the
    embedding), an update's is written to the embedding unless the update also names
    `model.embed_tokens.weight`, which it must then equal. Expert tensors for an MXFP8 layer are
    quantized as they are written (MXFP8 ones are copied). Returns the names that have no place in this model and were skipped
    (e.g. `rotary_emb.inv_freq` buffers of old checkpoints, DeepSeek's multi-token-prediction
    layers); a name that maps to a parameter but has the wrong shape is an error. `coverage`
    (written loads only) records what this load covered, added to what earlier loads did;
    `written` receives the model tensors written (their packed copies are then stale). A
    non-strict load given a list unpacks only the expert layers its names write.
    """
    cfg = model.cfg
    layers = expert_layers_named(n for n, _ in tensors) if not strict and isinstance(tensors, list) else None
    targets, quantized, mx_linears = _targets(model, layers)
    table = _layer_table(cfg)
    extra_layers = cfg.num_mtp_layers
    if cfg.hf_config.get(FLA_MARK):  # an fla-org NSA checkpoint: its names, renamed to Llama's
        tensors = fla_tensors(tensors)
    if cfg.hf_config.get(TEXT_OF):  # a vision-language checkpoint: its text model's names, the vision side dropped
        tensors = text_tensors(tensors)
    if cfg.mxfp4_experts:  # gpt-oss: MXFP4 expert blocks and scales, dequantized as they stream in
        tensors = gpt_oss_checkpoint.mxfp4_tensors(tensors)
    filler = _Filler(check_only, filled=coverage.filler.filled if coverage is not None and not check_only else None)
    unused: list[str] = []
    tied_head: tuple[torch.Tensor, str] | None = None  # an update's lm_head.weight on a tied model
    embed_given: torch.Tensor | None = None
    for name, t in tensors:
        if name == "model.embed_tokens.weight":
            filler.put("embed", targets["embed"], t, name)
            embed_given = t
        elif name == "lm_head.weight":
            if "lm_head" in mx_linears:
                filler.count("lm_head", _write_linear(mx_linears["lm_head"], t, name, check_only=check_only))
            elif not cfg.tie_word_embeddings:
                filler.put("lm_head", targets["lm_head"], t, name)
            elif not strict:
                tied_head = (t, name)
        elif name == "lm_head" and cfg.tie_word_embeddings and "lm_head" not in targets:
            # the engine's name for a tied lm_head whose own entry became an MXFP8 copy: it is the embedding
            filler.put("embed", targets["embed"], t, name)
        elif name == "model.norm.weight":
            filler.put("norm.weight", targets["norm.weight"], t, name)
        elif name == "model.norm.bias" and "norm.bias" in targets:  # StarCoder2's LayerNorm
            filler.put("norm.bias", targets["norm.bias"], t, name)
        elif name in mx_linears:  # the engine's own name (a trainer on this model code)
            filler.count(name, _write_linear(mx_linears[name], t, name, check_only=check_only))
        elif (n := _NATIVE_EXPERTS.match(name)) is not None and int(n.group(1)) in quantized:
            i, which = int(n.group(1)), n.group(2)
            data, scale = _write_quantized(quantized[i], which, t, name, check_only=check_only)
            filler.count(f"layers.{i}.mlp.{which}_mx", data.numel())
            filler.count(f"layers.{i}.mlp.{which}_scale", scale.numel())
        elif name in targets and _NATIVE_EXPERTS.match(name) is not None:
            # the engine's name for plain experts that were held packed when the caller looked
            # (LLMEngine.update_weights lists parameters before this unpacks them)
            filler.put(name, targets[name], t, name)
        elif (m := _LAYER.match(name)) is not None:
            i, rest = int(m.group(1)), m.group(2)
            if i >= cfg.num_layers + extra_layers:
                raise ValueError(f"tensor {name!r} is for layer {i} but the config has {cfg.num_layers} layers")
            if i >= cfg.num_layers and (model.mtp is None or i != model.mtp.layer_index):
                unused.append(name)  # DeepSeek's / GLM's multi-token-prediction modules, unless drafting with the first
            elif i >= cfg.num_layers and rest in MTP_TENSORS:  # the MTP layer's norms, projection, embedding, head
                pname = f"mtp.{MTP_TENSORS[rest]}"
                filler.put(pname, targets[pname], t, name)
            elif _load_expert_tensor(model, i, rest, t, name, targets, filler, quantized.get(i)):
                continue
            elif (target := table.get(rest)) is not None:
                pname, rows = f"layers.{i}.{target[0]}", target[1]
                if pname not in targets:
                    raise ValueError(f"tensor {name!r} has no place in layer {i} of this {cfg.architecture} model")
                if pname in mx_linears:
                    filler.count(pname, _write_linear(mx_linears[pname], t, name, rows, check_only=check_only), _region(None, rows))
                else:
                    filler.put(pname, targets[pname], t, name, rows=rows)
            else:
                unused.append(name)
        else:
            unused.append(name)
    if tied_head is not None:
        t, name = tied_head
        if embed_given is None:
            filler.put("embed", targets["embed"], t, name)
        elif tuple(t.shape) != tuple(embed_given.shape) or not torch.equal(t, embed_given):
            raise ValueError(f"{name!r} differs from 'model.embed_tokens.weight' in this update, but this model ties "
                             "them (tie_word_embeddings): give one, or both equal")
    if written is not None and not check_only:
        written.extend({id(targets[n]): targets[n] for n in filler.filled if n in targets}.values())
    if strict:
        foreign = [n for n in unused if not any(r.match(n) for r in IGNORED_TENSORS) and not _is_mtp_layer(n, cfg)]
        if foreign:
            raise ValueError(
                f"checkpoint {source!r} has tensors this {cfg.architecture} model has no place for: "
                f"{foreign[:8]}{' ...' if len(foreign) > 8 else ''} (a quantized or adapter checkpoint? cuttle refuses "
                "rather than dropping them)"
            )
        missing = _missing(targets, filler, cfg)
        if missing:
            raise ValueError(f"checkpoint {source!r} does not provide: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    return unused


def _is_mtp_layer(name: str, cfg: ModelConfig) -> bool:  # (one not loaded: `CausalLM(mtp=True)` loads the first)
    m = _LAYER.match(name)
    return m is not None and cfg.num_layers <= int(m.group(1)) < cfg.num_layers + cfg.num_mtp_layers


def _load_expert_tensor(
    model: CausalLM, i: int, rest: str, t: torch.Tensor, name: str,
    targets: dict[str, torch.Tensor], filler: _Filler, quantized: FusedMoE | None,
) -> bool:
    """Routed-expert tensors of layer i, in any layout; False if `rest` is not one."""
    p = f"layers.{i}.mlp."
    mi = model.cfg.moe_intermediate_size
    if (e := _EXPERT.match(rest)) is not None:
        eid, part = int(e.group(1)), _EXPERT_PART[e.group(2)]
        which = "w2" if part == "down" else "w13"
        rows = None if part == "down" else (slice(0, mi) if part == "gate" else slice(mi, 2 * mi))
        index: int | None = eid
    elif (f := _FUSED_EXPERTS.match(rest)) is not None:
        which, rows, index = ("w13" if f.group(1) == "gate_up_proj" else "w2"), None, None
        if model.cfg.architecture == "GptOssForCausalLM":
            t = gpt_oss_checkpoint.to_engine(f.group(1) + (f.group(2) or ""), t)
        if f.group(2):  # an expert bias (gpt-oss): a plain parameter, MXFP8 layer or not
            if p + which + "_bias" not in targets:
                raise ValueError(f"tensor {name!r} is an expert bias, which this {model.cfg.architecture} model has no place for")
            filler.put(p + which + "_bias", targets[p + which + "_bias"], t, name)
            return True
    elif (q := _QUANTIZED.match(rest)) is not None:
        field = q.group(1)
        if quantized is None:
            raise ValueError(f"tensor {name!r} is an MXFP8 expert tensor but layer {i} does not hold MXFP8 experts")
        if t.dtype != _QUANTIZED_DTYPES[field]:
            raise ValueError(f"tensor {name!r} is {t.dtype}, expected {_QUANTIZED_DTYPES[field]}")
        filler.put(p + field, targets[p + field], t, name)
        return True
    else:
        return False
    if not isinstance(model.layers[i].mlp, FusedMoE):
        raise ValueError(f"tensor {name!r} is an expert weight but layer {i} is not a MoE layer here")
    if quantized is not None:
        data, scale = _write_quantized(quantized, which, t, name, index=index, rows=rows, check_only=filler.check_only)
        filler.count(p + which + "_mx", data.numel(), _region(index, rows))
        filler.count(p + which + "_scale", scale.numel(), _region(index, rows))
    else:
        filler.put(p + which, targets[p + which], t, name, rows=rows, index=index)
    return True


def _write_quantized(
    layer: FusedMoE, which: str, t: torch.Tensor, name: str, index: int | None = None, rows: slice | None = None,
    check_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        return write_quantized(layer, which, t, index=index, rows=rows, check_only=check_only)
    except ValueError as err:
        raise ValueError(f"shape mismatch for {name!r}: {err}") from None


def _write_linear(weight: MXLinearWeight, t: torch.Tensor, name: str, rows: slice | None = None,
                  check_only: bool = False) -> int:
    try:
        return write_quantized_linear(weight, t, rows, check_only)
    except ValueError as err:
        raise ValueError(f"shape mismatch for {name!r}: {err}") from None


def _layer_table(cfg: ModelConfig) -> dict[str, tuple[str, slice | None]]:
    """Maps the part of an HF name after `model.layers.N.` to (parameter under `layers.N.`, rows)."""
    table: dict[str, tuple[str, slice | None]] = {
        "input_layernorm.weight": ("input_norm.weight", None),
        "post_attention_layernorm.weight": ("post_attn_norm.weight", None),
        "post_feedforward_layernorm.weight": ("post_ff_norm.weight", None),  # OLMo 2 / 3
        "self_attn.o_proj.weight": ("attn.o_weight", None),
        "mlp.down_proj.weight": ("mlp.down_weight", None),
        "mlp.gate_proj.weight": ("mlp.gate_up_weight", slice(0, cfg.intermediate_size)),
        "mlp.up_proj.weight": ("mlp.gate_up_weight", slice(cfg.intermediate_size, 2 * cfg.intermediate_size)),
        "mlp.gate.weight": ("mlp.gate_weight", None),
        "block_sparse_moe.gate.weight": ("mlp.gate_weight", None),
        "mlp.gate.e_score_correction_bias": ("mlp.e_score_correction_bias", None),
        "block_sparse_moe.e_score_correction_bias": ("mlp.e_score_correction_bias", None),  # MiniMax-M2's
        "mlp.e_score_correction_bias": ("mlp.e_score_correction_bias", None),  # MiniMax-M2's in transformers' memory
        "mlp.router.weight": ("mlp.gate_weight", None),  # gpt-oss's router, with its bias
        "mlp.router.bias": ("mlp.gate_bias", None),
        "self_attn.sinks": ("attn.sinks", None),  # gpt-oss's per-head sink logits
        # StarCoder2: LayerNorm biases, o_proj's bias, the ungated MLP
        "input_layernorm.bias": ("input_norm.bias", None),
        "post_attention_layernorm.bias": ("post_attn_norm.bias", None),
        "self_attn.o_proj.bias": ("attn.o_bias", None),
        "mlp.c_fc.weight": ("mlp.fc_weight", None),
        "mlp.c_fc.bias": ("mlp.fc_bias", None),
        "mlp.c_proj.weight": ("mlp.proj_weight", None),
        "mlp.c_proj.bias": ("mlp.proj_bias", None),
    }
    si = cfg.shared_expert_intermediate_size
    for shared in ("shared_expert", "shared_experts"):  # Qwen2-MoE, DeepSeek-V3
        table[f"mlp.{shared}.gate_proj.weight"] = ("shared.w13", slice(0, si))
        table[f"mlp.{shared}.up_proj.weight"] = ("shared.w13", slice(si, 2 * si))
        table[f"mlp.{shared}.down_proj.weight"] = ("shared.w2", None)
    table["mlp.shared_expert_gate.weight"] = ("shared.gate_weight", None)
    if cfg.mla is not None:
        m = cfg.mla
        q_rows = m.q_lora_rank if m.q_lora_rank is not None else cfg.num_heads * m.qk_head_dim
        table.update({
            "self_attn.q_proj.weight": ("attn.a_weight", slice(0, q_rows)),
            "self_attn.q_a_proj.weight": ("attn.a_weight", slice(0, q_rows)),
            "self_attn.kv_a_proj_with_mqa.weight": ("attn.a_weight", slice(q_rows, None)),
            "self_attn.q_a_proj.bias": ("attn.q_a_bias", None),
            "self_attn.kv_a_proj_with_mqa.bias": ("attn.kv_a_bias", None),
            "self_attn.q_a_layernorm.weight": ("attn.q_a_norm.weight", None),
            "self_attn.kv_a_layernorm.weight": ("attn.kv_a_norm.weight", None),
            "self_attn.q_b_proj.weight": ("attn.q_b_weight", None),
            "self_attn.kv_b_proj.weight": ("attn.kv_b_weight", None),
            "self_attn.o_proj.bias": ("attn.o_bias", None),
        })
        return table
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    # NSA layers (cuttle.engine.models.nsa_config): gates under fla-org's name, phi's weights
    table["self_attn.g_proj.weight"] = ("attn.g_weight", None)
    table["self_attn.compress_k.weight"] = ("attn.ck_weight", None)
    table["self_attn.compress_v.weight"] = ("attn.cv_weight", None)
    table["self_attn.q_norm.weight"] = ("attn.q_norm.weight", None)
    table["self_attn.k_norm.weight"] = ("attn.k_norm.weight", None)
    for proj, rows in (("q_proj", slice(0, q)), ("k_proj", slice(q, q + kv)), ("v_proj", slice(q + kv, q + 2 * kv))):
        table[f"self_attn.{proj}.weight"] = ("attn.qkv_weight", rows)
        table[f"self_attn.{proj}.bias"] = ("attn.qkv_bias", rows)
    # Phi-3 / Phi-4 write both as one tensor, rows in this decoder's order ([q; k; v], [gate; up])
    table.update(_PHI3_FUSED)
    return table


_PHI3_FUSED = {"self_attn.qkv_proj.weight": ("attn.qkv_weight", None), "mlp.gate_up_proj.weight": ("mlp.gate_up_weight", None)}
_SPLIT = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.gate_proj.weight",
          "mlp.up_proj.weight")


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's parameters under the HF names its family's checkpoints use: the inverse of
    `load_weights`, derived from the same name table (`_layer_table`), so that what it returns
    loads back into identical parameters. Values are views of the (fused) parameters, not copies;
    routed experts come out per expert (gpt-oss's in its fused, interleaved layout: copies). MXFP8 experts have no HF layout and are refused."""
    cfg = model.cfg
    if any(layer.quant == "mxfp8" for layer in moe_layers(model).values()):
        raise ValueError("hf_state_dict: this model holds MXFP8 experts, which have no HF layout")
    if quantized_linears(model):
        raise ValueError("hf_state_dict: this model holds MXFP8 linears (quantization='mxfp8'), which have no HF layout")
    if any(layer.packed is not None for layer in moe_layers(model).values()):
        raise ValueError("hf_state_dict: this model's experts are held packed for the native kernels (an engine's model); "
                         "call cuttle.engine.models.moe_quant.unpack_experts(model) first")
    params = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.norm.weight}
    covered = {"embed": model.embed.numel(), "norm.weight": model.norm.weight.numel()}
    if "norm.bias" in params:
        out["model.norm.bias"] = model.norm.bias
        covered["norm.bias"] = model.norm.bias.numel()
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head
        covered["lm_head"] = model.lm_head.numel()
    elif "lm_head" in params:
        covered["lm_head"] = model.lm_head.numel()  # the embedding itself
    table = _layer_table(cfg)
    mixtral = cfg.architecture in BLOCK_SPARSE_MOE_ARCHITECTURES
    # per-expert names of this family: Mixtral's w1/w3/w2, everyone else's {gate,up,down}_proj
    expert_names = [n for n in _EXPERT_PART if n.startswith("w") == mixtral]
    for i, layer in enumerate(model.layers):
        for rest, (target, rows) in table.items():
            pname = f"layers.{i}.{target}"
            if pname in params and _hf_name_used(cfg, rest):
                t = params[pname] if rows is None else params[pname][rows]
                out[f"model.layers.{i}.{rest}"] = t
                covered[pname] = covered.get(pname, 0) + t.numel()
        if isinstance(layer.mlp, FusedMoE) and cfg.architecture == "GptOssForCausalLM":
            # transformers' fused, interleaved layout (new tensors, not views)
            prefix, moe = f"model.layers.{i}.mlp.experts", layer.mlp
            for part, pname in (("gate_up_proj", "w13"), ("gate_up_proj_bias", "w13_bias"), ("down_proj", "w2"),
                                ("down_proj_bias", "w2_bias")):
                out[f"{prefix}.{part}"] = gpt_oss_checkpoint.to_hf(part, getattr(moe, pname))
                covered[f"layers.{i}.mlp.{pname}"] = getattr(moe, pname).numel()
        elif isinstance(layer.mlp, FusedMoE):
            moe, mi = layer.mlp, cfg.moe_intermediate_size
            prefix = f"model.layers.{i}.{'block_sparse_moe' if mixtral else 'mlp'}.experts"
            for e in range(moe.w13.shape[0]):
                parts = {"gate": moe.w13[e, :mi], "up": moe.w13[e, mi:], "down": moe.w2[e]}
                for name in expert_names:
                    out[f"{prefix}.{e}.{name}.weight"] = parts[_EXPERT_PART[name]]
            covered[f"layers.{i}.mlp.w13"] = moe.w13.numel()
            covered[f"layers.{i}.mlp.w2"] = moe.w2.numel()
    if model.mtp is not None:  # the MTP layer's own tensors, under its layer as the checkpoint names them
        for rest, pname in MTP_TENSORS.items():
            out[f"model.layers.{model.mtp.layer_index}.{rest}"] = params[f"mtp.{pname}"]
            covered[f"mtp.{pname}"] = params[f"mtp.{pname}"].numel()
    wrong = [n for n, p in params.items() if covered.get(n, 0) != p.numel()]
    if wrong:
        raise ValueError(f"hf_state_dict: no single HF name covers {wrong[:8]} of this {cfg.architecture} model")
    return out


def _hf_name_used(cfg: ModelConfig, rest: str) -> bool:
    """Of the HF names `_layer_table` accepts for one parameter, whether `rest` (the part after
    `model.layers.N.`) is the one `cfg`'s family writes."""
    if rest.startswith("mlp.router."):
        return cfg.architecture == "GptOssForCausalLM"
    if rest.startswith("block_sparse_moe.") or rest == "mlp.gate.weight":
        return (rest.startswith("block_sparse_moe.") == (cfg.architecture in BLOCK_SPARSE_MOE_ARCHITECTURES)
                and cfg.architecture != "GptOssForCausalLM")
    if rest.endswith("e_score_correction_bias"):  # DeepSeek's and GLM's under the gate, MiniMax's beside it
        return rest == ("block_sparse_moe.e_score_correction_bias" if cfg.architecture in BLOCK_SPARSE_MOE_ARCHITECTURES
                        else "mlp.gate.e_score_correction_bias")
    if rest.startswith(("mlp.shared_expert.", "mlp.shared_experts.")):
        return rest.startswith("mlp.shared_experts.") == (cfg.architecture in DEEPSEEK_MOE_ARCHITECTURES)
    if cfg.mla is not None and rest.startswith(("self_attn.q_proj.", "self_attn.q_a_proj.")):
        return rest.startswith("self_attn.q_a_proj.") == (cfg.mla.q_lora_rank is not None)
    if rest in _PHI3_FUSED or rest in _SPLIT:  # Phi-3's fused names, everyone else's split ones
        return (rest in _PHI3_FUSED) == (cfg.architecture == "Phi3ForCausalLM")
    return True
