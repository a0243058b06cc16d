"""LoRA training for the reference trainer: the adapter's trainable A and B, applied through the
model's LoRA seam (`cuttle.engine.lora.LoRAContext`) by the same formula the engine samples with,
and exported under PEFT's names for the engine's `update_lora` (or `peft` itself).

Owns the adapter's parameters (PEFT's initialisation: A Kaiming-uniform, B zero, so an untrained
adapter is the base model), their stacking into the engine's fused projections (differentiable,
per forward), and the PEFT state dict / adapter_config of what was trained. Never touches the
base weights: the trainer freezes them.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from cuttle.engine.config import ModelConfig
from cuttle.engine.lora import ATTENTION_MODULES, MLP_MODULES, check_adapter_config, peft_key, projection_slots


def adapter_config(lora: dict[str, Any]) -> dict[str, Any]:
    """`TrainerConfig.lora` as a PEFT adapter_config: r, lora_alpha, target_modules, use_rslora."""
    targets = lora.get("target_modules", list(ATTENTION_MODULES))
    return {"peft_type": "LORA", "r": lora.get("r"), "lora_alpha": lora.get("lora_alpha", lora.get("r")),
            "target_modules": list(targets), "use_rslora": bool(lora.get("use_rslora", False)), "bias": "none"}


class _Weights:
    """What `LoRAContext.add` reads of an adapter: (layer, projection) -> (A [R, in], scaled B
    [out, R]), stacked from the parameters at each call, so gradients reach them."""

    def __init__(self, owner: TrainableLoRA) -> None:
        self.owner = owner

    def get(self, key: tuple[int, str]) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.owner.stacked(*key)


class TrainableLoRA(nn.Module):
    """One adapter of `config` (`TrainerConfig.lora`: r, lora_alpha, target_modules, use_rslora)
    over every layer of a model of `cfg`; its `weights` are what the model's LoRA seam applies."""

    def __init__(self, cfg: ModelConfig, lora: dict[str, Any]):
        super().__init__()
        self.config = adapter_config(lora)
        unknown = sorted(set(lora) - {"r", "lora_alpha", "target_modules", "use_rslora"})
        if unknown:
            raise ValueError(f"lora: unknown fields {unknown} (r, lora_alpha, target_modules, use_rslora)")
        self.rank, self.scale = check_adapter_config(self.config, max_lora_rank=2**31, where="TrainerConfig.lora")
        targets = self.config["target_modules"]
        bad = [m for m in targets if m not in ATTENTION_MODULES + MLP_MODULES]
        if not targets or bad:
            raise ValueError(f"lora.target_modules must name some of {', '.join(ATTENTION_MODULES + MLP_MODULES)}; got {targets!r}")
        if cfg.mla is not None:
            raise ValueError("lora: multi-head latent attention models (kv_lora_rank) are not supported")
        self.slots, self.rows = projection_slots(cfg)
        self.modules_of: dict[tuple[int, str], list[str]] = {}  # (layer, projection) -> its modules, in row order
        for layer in range(cfg.num_layers):
            for m in targets:
                if m in MLP_MODULES and layer in cfg.moe_layers:
                    raise ValueError(f"lora.target_modules {m!r}: layer {layer}'s MLP is a routed mixture of experts; "
                                     "LoRA on experts is not supported (target the attention modules)")
                if m in MLP_MODULES and cfg.gelu_mlp:
                    raise ValueError(f"lora.target_modules {m!r}: this model's MLP is StarCoder2's ungated c_fc / c_proj; "
                                     "LoRA on it is not supported (target the attention modules)")
                self.modules_of.setdefault((layer, self.slots[m][0]), []).append(m)
        for mods in self.modules_of.values():
            mods.sort(key=lambda m: self.slots[m][1])
        self.a = nn.ParameterDict()
        self.b = nn.ParameterDict()
        for (layer, _), mods in self.modules_of.items():
            for m in mods:
                _, _, out, fan_in = self.slots[m]
                a = torch.empty(self.rank, fan_in)
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # PEFT's init: B = 0, so the adapter starts as the base
                self.a[f"{layer}_{m}"] = nn.Parameter(a)
                self.b[f"{layer}_{m}"] = nn.Parameter(torch.zeros(out, self.rank))
        self.weights = _Weights(self)

    def stacked(self, layer: int, proj: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A projection's stacked A and block-diagonal scaled B, as `LoRARegistry.build` stacks a
        loaded adapter (so trainer and engine compute one formula)."""
        mods = self.modules_of.get((layer, proj))
        if mods is None:
            return None
        a = torch.cat([self.a[f"{layer}_{m}"] for m in mods])
        width = self.rank * len(mods)
        blocks, row, col = [], 0, 0
        for m in mods:
            _, row0, out, _ = self.slots[m]
            if row0 > row:
                blocks.append(a.new_zeros(row0 - row, width))
            b = self.b[f"{layer}_{m}"] * self.scale
            blocks.append(nn.functional.pad(b, (col, width - col - self.rank)))
            row, col = row0 + out, col + self.rank
        if row < self.rows[proj]:
            blocks.append(a.new_zeros(self.rows[proj] - row, width))
        return a, torch.cat(blocks)

    def peft_state(self) -> dict[str, torch.Tensor]:
        """The adapter under PEFT's names (detached copies): what `update_lora` and
        `peft.set_peft_model_state_dict` take."""
        out = {}
        for (layer, _), mods in self.modules_of.items():
            for m in mods:
                key = peft_key(layer, m)
                out[f"{key}.lora_A.weight"] = self.a[f"{layer}_{m}"].detach().clone()
                out[f"{key}.lora_B.weight"] = self.b[f"{layer}_{m}"].detach().clone()
        return out
