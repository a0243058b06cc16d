"""LoRA adapters (vLLM's `enable_lora` / `LoRARequest`): PEFT adapters held beside the base
weights and applied per request, any mix of adapters (and none) in one step; never merged.

Owns: reading a PEFT adapter (adapter_config.json + adapter_model.safetensors, or tensors handed
over in memory) and checking it against the model; the registry of adapter names and the cache of
loaded adapters (`LoRARegistry`: past `max_loras`, the least recently used one that a directory
can give again is dropped); and the step's map
of rows to adapters (`LoRABatch`) that the projections read through `LoRAContext`, the model's one
seam: an attention layer's q|k|v and o projections and a dense MLP's gate|up and down add
`LoRAContext.add(...)` to their output when a step has adapter rows; nothing else in the forward
knows about adapters.

An adapter's A and B are stacked per fused projection (q|k|v's A rows one after another, B
block-diagonal over the output slices), its scale (lora_alpha / r, or / sqrt(r) under
use_rslora) folded into B, so a projection's delta is two GEMMs, (x A^T) B^T, per adapter in the
step. They are kept and computed in fp32 whatever the model's dtype (a few percent of the base
weights' bytes; these thin shapes, K = r or N = r, ran faster in fp32 than in the bf16 kernels
here, docs/benchmarks.md 'LoRA adapters'), and the delta is added to the projection once, rounded
once. On CPU it is a native kernel (attention/native/lora_delta.py; A^T and (sB)^T are the stored
copies there), whose result for a row depends on that row alone, so decode steps under one
adapter can replay kernel graphs; elsewhere torch's GEMMs, batch-invariant ones
(`native.gemm.linear`) under batch-invariant mode.

It must never apply an adapter to another request's rows, nor let KV computed under one adapter be
reused under another: the engine mixes `LoadedAdapter.key` (a hash of the adapter's weights) into
the request's prefix-cache key, so base and adapter requests, and two adapters, never share KV,
while the same adapter reloaded later hits its own cache again.
"""
from __future__ import annotations

import json
import math
import os
import re
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import xxhash
from safetensors import safe_open

from cuttle.attention.native import invariance
from cuttle.attention.native.gemm import linear
from cuttle.attention.native.lora_delta import add_rows
from cuttle.engine.config import ModelConfig

# the PEFT modules cuttle adapts (`projection_slots`: where each sits in the fused projections)
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.([A-Za-z0-9_.]+)\.lora_(A|B)\.weight$")
# adapter_config.json fields that change what an adapter computes; each is honoured or refused
_REFUSED_CONFIG = {
    "use_dora": "DoRA adapters (use_dora) are not supported",
    "fan_in_fan_out": "fan_in_fan_out adapters (Conv1D-style weights) are not supported",
}


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: which adapter a request runs under. `lora_name` names it (the server's `model`
    field); `lora_path` is a PEFT adapter directory (may be empty for a name already registered:
    `LLM.load_lora_adapter`, `--lora-modules`). `lora_int_id` and `base_model_name` are kept for
    vLLM compatibility and change nothing (the id must be >= 1): adapters are told apart by name,
    and every adapter applies to the engine's one base model."""

    lora_name: str
    lora_int_id: int = 1
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a string, got {type(self.lora_path).__name__}")


@dataclass(eq=False)
class LoadedAdapter:
    """One adapter ready to apply: per (layer, projection) the stacked A [R, in] and scaled B
    [out, R], fp32."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    key: bytes = b""  # xxh3-128 of the weights: what the prefix cache is keyed by
    # on CPU, the same weights transposed (A^T [in, R], (sB)^T [R, out]) for the native kernel
    # (attention/native/lora_delta.py), which reads both products as contiguous runs
    transposed: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        h = xxhash.xxh3_128()
        for (layer, proj), (a, b) in sorted(self.weights.items()):
            h.update(f"{layer}.{proj}.{a.dtype}".encode())
            for t in (a, b):
                h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        self.key = h.digest()
        # on CPU the transposed copies are the storage: `weights` become views of them (torch's
        # GEMMs read a transposed weight as it is), so an adapter's memory is not doubled
        self.transposed = {k: (a.t().contiguous(), b.t().contiguous()) for k, (a, b) in self.weights.items() if a.is_cpu}
        for k, (at, bt) in self.transposed.items():
            self.weights[k] = (at.t(), bt.t())

    @property
    def nbytes(self) -> int:
        """The adapter's memory (and what a step under it reads)."""
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _read_config(path: str) -> dict[str, Any]:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"LoRA adapter {path!r} has no adapter_config.json (a PEFT adapter directory is expected)")
    with open(cfg_path) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"LoRA adapter {path!r}: adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json must hold an object")
    return cfg


def check_adapter_config(cfg: dict[str, Any], max_lora_rank: int, where: str) -> tuple[int, float]:
    """(rank, scale) of a PEFT LoRA config, or a ValueError naming the field cuttle cannot honour."""
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not supported (LORA only)")
    for name, why in _REFUSED_CONFIG.items():
        if cfg.get(name):
            raise ValueError(f"{where}: {why} ({name}={cfg[name]!r})")
    bias = cfg.get("bias", "none")
    if bias != "none":
        raise ValueError(f"{where}: bias={bias!r} is not supported (trained biases would change the base layers; 'none' only)")
    for name in ("modules_to_save", "rank_pattern", "alpha_pattern", "trainable_token_indices"):
        if cfg.get(name):
            raise ValueError(f"{where}: {name} is not supported (set in adapter_config.json: {cfg[name]!r})")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{where}: r must be an integer >= 1, got {r!r}")
    if r > max_lora_rank:
        raise ValueError(f"{where}: rank r={r} exceeds max_lora_rank ({max_lora_rank}; --max-lora-rank)")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{where}: lora_alpha must be a finite number, got {alpha!r}")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scale)


def projection_slots(cfg: ModelConfig) -> tuple[dict[str, tuple[str, int, int, int]], dict[str, int]]:
    """Where each PEFT module sits in the engine's fused projections: module -> (projection, first
    output row, rows, in features), and each projection's output rows."""
    q, kv, inter, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size, cfg.hidden_size
    slots = {
        "q_proj": ("qkv", 0, q, h), "k_proj": ("qkv", q, kv, h), "v_proj": ("qkv", q + kv, kv, h), "o_proj": ("o", 0, h, q),
        "gate_proj": ("gate_up", 0, inter, h), "up_proj": ("gate_up", inter, inter, h), "down_proj": ("down", 0, h, inter),
    }
    return slots, {"qkv": q + 2 * kv, "o": h, "gate_up": 2 * inter, "down": h}


def peft_key(layer: int, module: str) -> str:
    """The PEFT name prefix of a module's LoRA weights (`<prefix>.lora_A.weight`)."""
    block = "self_attn" if module in ATTENTION_MODULES else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{module}"


class LoRARegistry:
    """Adapter names (`register`: name -> PEFT directory), and the adapters loaded, from those
    directories or sent in memory, at most `max_loras` at once: past it the least recently used
    one that a directory can give again is dropped (`_keep`); a request that holds one keeps
    computing with it, so dropping never changes a running request."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_lora_rank: int, device: torch.device | str = "cpu"):
        if cfg.mla is not None:
            raise ValueError("enable_lora: LoRA on multi-head latent attention models (kv_lora_rank) is not supported")
        self.cfg = cfg
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.device = torch.device(device)  # the model's: adapters live beside its weights
        self.paths: dict[str, str] = {}
        self.loaded: OrderedDict[str, LoadedAdapter] = OrderedDict()
        self._slots, self._rows = projection_slots(cfg)

    # ---- names ---------------------------------------------------------------------------------
    def register(self, name: str, path: str) -> None:
        """Make `name` resolvable to the PEFT directory `path` (its config checked now, its
        weights read on first use). Re-registering a name with another path replaces the
        adapter for new requests."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"lora_name must be a non-empty string, got {name!r}")
        if not isinstance(path, str) or not os.path.isdir(path):
            raise ValueError(f"LoRA adapter {name!r}: lora_path {path!r} is not a directory")
        check_adapter_config(_read_config(path), self.max_lora_rank, f"LoRA adapter {name!r}")
        if self.paths.get(name) != path:
            self.loaded.pop(name, None)
        self.paths[name] = path

    def unregister(self, name: str) -> None:
        if name not in self.paths and name not in self.loaded:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        self.paths.pop(name, None)
        self.loaded.pop(name, None)

    def names(self) -> list[str]:
        return list(dict.fromkeys([*self.paths, *self.loaded]))

    def resolve(self, req: LoRARequest | str) -> LoadedAdapter:
        """The adapter a request runs under (loaded now if it is not)."""
        if isinstance(req, str):
            req = LoRARequest(req)
        if not isinstance(req, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(req).__name__}")
        name = req.lora_name
        if req.lora_path and self.paths.get(name) != req.lora_path:
            self.register(name, req.lora_path)
        adapter = self.loaded.get(name)
        if adapter is not None:
            self.loaded.move_to_end(name)
            return adapter
        path = self.paths.get(name)
        if path is None:
            raise ValueError(f"no LoRA adapter named {name!r}: give its lora_path, or load it first "
                             f"(known: {', '.join(self.names()) or 'none'})")
        return self._keep(self.read(name, path))

    # ---- loading -------------------------------------------------------------------------------
    def read(self, name: str, path: str) -> LoadedAdapter:
        where = f"LoRA adapter {name!r} ({path})"
        cfg = _read_config(path)
        rank, scale = check_adapter_config(cfg, self.max_lora_rank, where)
        file = os.path.join(path, "adapter_model.safetensors")
        if not os.path.isfile(file):
            extra = " (adapter_model.bin is a pickle, which cuttle does not load: save with safe_serialization)" \
                if os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""
            raise ValueError(f"{where}: no adapter_model.safetensors{extra}")
        with safe_open(file, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        return self.build(name, path, tensors, rank, scale)

    def load_tensors(self, name: str, tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any]) -> LoadedAdapter:
        """An adapter from tensors in memory (PEFT names, e.g. a trainer's `get_peft_model_state_dict`)
        and its adapter_config as a dict: the weight sync of LoRA training. Replaces any adapter of
        that name for new requests."""
        rank, scale = check_adapter_config(config, self.max_lora_rank, f"LoRA adapter {name!r}")
        adapter = self._keep(self.build(name, "", dict(tensors), rank, scale))
        self.paths.pop(name, None)
        return adapter

    def _keep(self, adapter: LoadedAdapter) -> LoadedAdapter:
        """Hold `adapter`, dropping the least recently used that can be read again from a directory
        (an adapter sent in memory stays until replaced or unloaded: nothing could reload it)."""
        in_memory = [n for n, a in self.loaded.items() if not a.path and n != adapter.name]
        if not adapter.path and len(in_memory) >= self.max_loras:
            raise ValueError(f"LoRA adapter {adapter.name!r}: {len(in_memory)} adapters sent in memory are held already, "
                             f"max_loras is {self.max_loras} (unload one, or raise max_loras)")
        self.loaded[adapter.name] = adapter
        self.loaded.move_to_end(adapter.name)
        while len(self.loaded) > self.max_loras:
            victim = next((n for n, a in self.loaded.items() if a.path and n != adapter.name), None)
            if victim is None:
                break
            del self.loaded[victim]  # running requests keep their reference
        return adapter

    def build(self, name: str, path: str, tensors: dict[str, torch.Tensor], rank: int, scale: float) -> LoadedAdapter:
        """Check every tensor against the model and stack them per projection."""
        where = f"LoRA adapter {name!r}" + (f" ({path})" if path else "")
        cfg = self.cfg
        parts: dict[tuple[int, str], dict[str, dict[str, torch.Tensor]]] = {}
        for key, t in tensors.items():
            m = _KEY.match(key)
            if m is None:
                raise ValueError(f"{where}: tensor {key!r} is not a LoRA weight of a supported module "
                                 f"(q/k/v/o_proj of attention, gate/up/down_proj of a dense MLP)")
            layer, block, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
            if layer >= cfg.num_layers:
                raise ValueError(f"{where}: tensor {key!r} names layer {layer}; the model has {cfg.num_layers}")
            ok = module in (ATTENTION_MODULES if block == "self_attn" else MLP_MODULES)
            if not ok:
                raise ValueError(f"{where}: tensor {key!r}: LoRA on {block}.{module} is not supported "
                                 "(q/k/v/o_proj of attention, gate/up/down_proj of a dense MLP)")
            if block == "mlp" and layer in cfg.moe_layers:
                raise ValueError(f"{where}: tensor {key!r}: layer {layer}'s MLP is a routed mixture of experts; "
                                 "LoRA on experts is not supported")
            if block == "mlp" and cfg.gelu_mlp:  # StarCoder2's c_fc / c_proj: no seam for deltas there
                raise ValueError(f"{where}: tensor {key!r}: this model's MLP is StarCoder2's ungated c_fc / c_proj; "
                                 "LoRA on it is not supported (attention's q/k/v/o_proj are)")
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
                raise ValueError(f"{where}: tensor {key!r} must be a 2-D floating-point tensor")
            parts.setdefault((layer, self._slots[module][0]), {}).setdefault(module, {})[ab] = t
        if not parts:
            raise ValueError(f"{where}: no LoRA weights (no lora_A / lora_B tensors)")
        weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for (layer, proj), modules in sorted(parts.items()):
            a_rows, blocks = [], []
            col = 0
            for module in sorted(modules, key=lambda mod: self._slots[mod][1]):
                ab = modules[module]
                label = f"layer {layer} {module}"
                if set(ab) != {"A", "B"}:
                    raise ValueError(f"{where}: {label} has lora_{next(iter(ab))} but not lora_{'B' if 'A' in ab else 'A'}")
                _, row0, rows, fan_in = self._slots[module]
                a, b = ab["A"], ab["B"]
                if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (rows, rank):
                    raise ValueError(f"{where}: {label}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}; the model and "
                                     f"r={rank} need {(rank, fan_in)} / {(rows, rank)}")
                for which, t in (("lora_A", a), ("lora_B", b)):
                    if not bool(torch.isfinite(t).all()):
                        raise ValueError(f"{where}: {label} {which} holds a NaN or infinity")
                a_rows.append(a.float())
                blocks.append((row0, rows, col, b.float() * scale))
                col += rank
            big_b = torch.zeros(self._rows[proj], col)
            for row0, rows, c0, b in blocks:
                big_b[row0 : row0 + rows, c0 : c0 + rank] = b
            weights[(layer, proj)] = (torch.cat(a_rows).contiguous().to(self.device), big_b.contiguous().to(self.device))
        return LoadedAdapter(name, path, rank, weights)


@dataclass(slots=True)
class LoRABatch:
    """A step's rows per adapter: each entry (adapter, rows), rows None when they are every row of
    the step, a slice when they are one run, else an index tensor; rows of no entry run on the
    base weights alone."""

    groups: list[tuple[LoadedAdapter, slice | torch.Tensor | None]] = field(default_factory=list)

    @staticmethod
    def build(rows: list[tuple[LoadedAdapter | None, int]], device: torch.device | str = "cpu") -> LoRABatch | None:
        """From each scheduled sequence's (adapter or None, rows) in batch order (index tensors on
        `device`, the activations'); None when no row has an adapter."""
        runs: dict[int, tuple[LoadedAdapter, list[tuple[int, int]]]] = {}
        start = 0
        for adapter, n in rows:
            if adapter is not None and n:
                spans = runs.setdefault(id(adapter), (adapter, []))[1]
                if spans and spans[-1][1] == start:
                    spans[-1] = (spans[-1][0], start + n)
                else:
                    spans.append((start, start + n))
            start += n
        if not runs:
            return None
        batch = LoRABatch()
        for adapter, spans in runs.values():
            if spans == [(0, start)]:
                batch.groups.append((adapter, None))
            elif len(spans) == 1:
                batch.groups.append((adapter, slice(*spans[0])))
            else:
                batch.groups.append((adapter, torch.cat([torch.arange(a, b) for a, b in spans]).to(device)))
        return batch


class LoRAContext:
    """What the projections read: the step's `LoRABatch` (None: no adapter rows this step)."""

    __slots__ = ("batch",)

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> torch.Tensor:
        """y (the base projection of x, a fresh tensor) plus each adapter's delta on its rows.

        On CPU the native kernel computes it (attention/native/lora_delta.py): a row's value then
        depends on that row alone (any batch, chunk or thread count), a decode step can replay
        from a kernel graph, and it kept pace with torch's fp32 GEMMs from 1 to 512 rows and ran
        ~3x faster at 2048 here (benchmarks/lora_kernel.py).
        Elsewhere (an accelerator, the trainer's adapter under autograd) torch's GEMMs in fp32
        (batch-invariant ones under invariance); both sum in fp32 and round once."""
        batch = self.batch
        if batch is None:
            return y
        native = y.is_cpu
        mm = linear if invariance.on() else F.linear
        for adapter, rows in batch.groups:
            w = adapter.weights.get((layer, proj))
            if w is None:
                continue
            t = getattr(adapter, "transposed", {}).get((layer, proj)) if native else None
            if t is not None and add_rows(y, x, t[0], t[1], rows):
                continue
            a, b = w
            if rows is None:
                y.add_(mm(mm(x.float(), a), b))
            elif isinstance(rows, slice):
                y[rows].add_(mm(mm(x[rows].float(), a), b))
            else:  # summed in fp32 and rounded once, as add_ does: the row's value whatever its grouping
                d = mm(mm(x.index_select(0, rows).float(), a), b)
                y.index_copy_(0, rows, (y.index_select(0, rows) + d).to(y.dtype))
        return y
