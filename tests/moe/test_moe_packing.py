"""Routed experts held packed (`FusedMoE.pack_`; the engine packs at load and after every weight
update): the packing is an exact permutation (`unpack` gives the bytes back), a packed layer
computes what the unpacked one does (native path bit for bit, torch fallback under autograd),
its plain copy is gone (expert memory not doubled), and in the engine nothing is packed during a
request, also after `update_weights` (engine names and HF names), with outputs equal to an engine
that never packs ahead."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from cuttle.attention.native import moe as native_moe
from cuttle.engine import LLM, SamplingParams
from cuttle.engine.models import moe_quant
from cuttle.moe import FusedMoE, RoutingConfig
from helpers import make_checkpoint, parity_prompts

pytestmark = pytest.mark.skipif(not native_moe.available(), reason="native MoE kernels not loaded (or CUTTLE_MOE_NATIVE=0)")


def _layer(dtype: torch.dtype, H: int, I: int, E: int = 6, seed: int = 0) -> FusedMoE:
    routing = RoutingConfig.from_hf({"model_type": "qwen3_moe", "num_experts": E, "num_experts_per_tok": 2, "norm_topk_prob": True})
    layer = FusedMoE(H, I, routing, dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (layer.gate_weight, layer.w13, layer.w2):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return layer


def _padded_elements(fmt: int, E: int, H: int, I: int) -> int:
    """Elements of a layer's panels in format `fmt`, zero padding included (csrc/moe_experts.c)."""
    if fmt in (native_moe.W_BF16_DOT, native_moe.W_MXFP8_DOT):  # 32 gate + 32 up rows / 64 rows a panel, K in pairs
        return E * (-(-I // 32) * 64 * -(-H // 2) * 2 + -(-H // 64) * 64 * -(-I // 2) * 2)
    return E * (-(-I // native_moe.P13) * native_moe.P13 * 2 * H + -(-H // native_moe.P2) * native_moe.P2 * I)


@pytest.fixture
def bf16_dot(request):
    """set_bf16_dot(request.param) for the test (skips where the dot tiles cannot be switched on)."""
    if native_moe.set_bf16_dot(request.param) != request.param:
        pytest.skip("library built without AVX512-BF16 (this CPU lacks it)")
    yield request.param
    native_moe.set_bf16_dot(True)


@pytest.mark.parametrize("dtype,H,I,bf16_dot", [
    (torch.float32, 40, 20, True), (torch.bfloat16, 64, 32, False), (torch.bfloat16, 64, 32, True),
    (torch.bfloat16, 33, 17, True), ("mxfp8", 64, 96, True), ("mxfp8-bf16", 96, 64, True), ("mxfp8-bf16", 96, 64, False),
], indirect=["bf16_dot"])
def test_pack_unpack_is_exact_and_forward_unchanged(dtype, H: int, I: int, bf16_dot: bool) -> None:
    # (40, 20): neither H a multiple of the w2 panel (16) nor I of the w13 panel (8): padding rows;
    # (33, 17) in the dot layout: odd K on both GEMMs (a zero half of the last k-pair) and part panels
    mx = dtype in ("mxfp8", "mxfp8-bf16")  # MXFP8 experts in an fp32 / a bf16 layer
    layer = _layer({"mxfp8": torch.float32, "mxfp8-bf16": torch.bfloat16}.get(dtype, dtype), H, I)
    if mx:
        layer.quantize_("mxfp8")
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(1)).to(layer.gate_weight.dtype)
    before = [t.clone() for t in (layer.state_dict().values())]
    names = list(layer.state_dict())
    bytes_plain = layer.expert_weight_bytes()
    out = layer(x)  # unpacked layer: native path on a lazily made packed copy
    assert layer.pack_() and layer.packed is not None
    assert not any(n in dict(layer.named_parameters()) or n in dict(layer.named_buffers())
                   for n in ("w13", "w2", "w13_mx", "w13_scale", "w2_mx", "w2_scale"))
    fmt = layer.packed.fmt
    assert fmt == {torch.float32: native_moe.W_F32, "mxfp8": native_moe.W_MXFP8,
                   "mxfp8-bf16": native_moe.W_MXFP8_DOT if bf16_dot and native_moe._lib().moe_mx_dot_available() else native_moe.W_MXFP8,
                   }.get(dtype, native_moe.W_BF16_DOT if bf16_dot else native_moe.W_BF16)
    # only the panels are resident now: the same bytes, plus zero rows where H or I is not a panel multiple
    padded = _padded_elements(fmt, layer.routing.num_experts, H, I)
    per = 1 if mx else layer.gate_weight.element_size()
    assert layer.expert_weight_bytes() == padded * per + (padded // 32 if mx else 0)
    if (H, I) != (33, 17):  # that one is mostly padding by design
        assert layer.expert_weight_bytes() <= bytes_plain * 1.25
    assert torch.equal(layer(x), out)
    # state_dict round trip through packed and unpacked layers: same names, same bytes
    assert list(layer.state_dict()) == names
    twin = _layer(layer.gate_weight.dtype, H, I, seed=9)
    if mx:
        twin.quantize_("mxfp8")
    assert twin.pack_()
    twin.load_state_dict(layer.state_dict())
    assert twin.packed is not None and torch.equal(twin(x), out)
    # the torch path (autograd) reads unpacked copies: it equals the unpacked layer's torch path
    xg = x.clone().requires_grad_(True)
    packed_grad = layer(xg)
    layer.unpack_()
    assert layer.packed is None and names == list(layer.state_dict())
    assert all(torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b) for a, b in zip(before, layer.state_dict().values()))
    assert torch.equal(layer(x.clone().requires_grad_(True)), packed_grad)


def test_not_packed_where_the_native_path_cannot_run() -> None:
    layer = _layer(torch.float32, 32, 32)
    layer.quantize_("mxfp8", activations=True)  # MXFP8 activations: torch path only
    assert not layer.pack_() and layer.packed is None
    layer = _layer(torch.float32, 32, 32)
    layer.w13.requires_grad_(True)
    assert not layer.pack_() and "w13" in dict(layer.named_parameters())


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe_pack")
    out = {"a": str(root / "a"), "b": str(root / "b")}
    make_checkpoint(out["a"], "qwen3_moe", seed=11)
    make_checkpoint(out["b"], "qwen3_moe", seed=12)
    return out


def _generate(llm: LLM):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
            for o in llm.generate([parity_prompts()[i] for i in (0, 2, 4)], sp, use_tqdm=False)]


@pytest.mark.parametrize("quant", [None, "mxfp8"])
def test_engine_packs_at_load_and_update_not_in_a_request(ckpts, quant, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = dict(dtype="float32", num_kv_blocks=64, moe_quant=quant)
    llm = LLM(ckpts["a"], **kw)
    model = llm.engine.runner.model
    layers = moe_quant.moe_layers(model).values()
    assert layers and all(layer.packed is not None for layer in layers)  # packed right after load
    assert not any(".mlp.w13" in n or ".mlp.w2" in n for n, _ in model.named_parameters())
    assert not any("_mx" in n or "_scale" in n for n, _ in model.named_buffers())
    # the oracle: an engine that leaves its experts plain (packed lazily, beside them)
    with monkeypatch.context() as m:
        m.setattr("cuttle.engine.model_runner.pack_experts", lambda model: 0)
        lazy = LLM(ckpts["a"], **kw)
        lazy_b = LLM(ckpts["b"], **kw)
    assert all(layer.packed is None for layer in moe_quant.moe_layers(lazy.engine.runner.model).values())
    want_a, want_b = _generate(lazy), _generate(lazy_b)
    made: list[str] = []

    def counting(fn):
        def wrapped(*a, **k):
            made.append(fn.__name__)
            return fn(*a, **k)
        return wrapped

    for name in ("_pack_w13", "_pack_w2", "_pack_mx"):
        monkeypatch.setattr(native_moe, name, counting(getattr(native_moe, name)))
    assert _generate(llm) == want_a
    assert made == []  # no packing during requests
    # update: layer 0 by the engine's stacked names (plain experts only: MXFP8 ones are written from
    # them too), the rest by HF names; packed again by the update itself
    other = load_file(os.path.join(ckpts["b"], "model.safetensors"))
    src = lazy_b.engine.runner.model
    engine_named = [(f"layers.0.mlp.{w}", getattr(src.layers[0].mlp, w)) for w in ("w13", "w2")] if quant is None else []
    hf = [(n, t) for n, t in other.items() if not (engine_named and n.startswith("model.layers.0.mlp.experts."))]
    llm.update_weights(engine_named + hf)
    assert made and all(layer.packed is not None for layer in layers)
    made.clear()
    assert _generate(llm) == want_b
    assert made == []


@pytest.mark.parametrize("quant", [None, "mxfp8"])
def test_an_update_repacks_only_the_expert_layers_it_writes(ckpts, quant) -> None:
    """A trainer's weight sync comes in buckets: an update that writes layer 1's experts unpacks
    and repacks layer 1 alone (layer 0 keeps its packed copy, the same object), one that writes
    no expert repacks none, and after the buckets the engine equals one loaded from the new
    weights, bit for bit."""
    kw = dict(dtype="float32", num_kv_blocks=64, moe_quant=quant)
    llm = LLM(ckpts["a"], **kw)
    want_b = _generate(LLM(ckpts["b"], **kw))
    layers = list(moe_quant.moe_layers(llm.engine.runner.model).values())
    other = load_file(os.path.join(ckpts["b"], "model.safetensors"))
    packed = [layer.packed for layer in layers]
    norm = [(n, t) for n, t in other.items() if n == "model.norm.weight"]
    llm.update_weights(norm)
    assert [layer.packed for layer in layers] == packed and all(p is not None for p in packed)
    layer1 = [(n, t) for n, t in other.items() if n.startswith("model.layers.1.mlp.experts.")]
    assert layer1
    llm.update_weights(layer1)
    assert layers[0].packed is packed[0] and layers[1].packed is not None and layers[1].packed is not packed[1]
    llm.update_weights([(n, t) for n, t in other.items() if n != "model.norm.weight" and not n.startswith("model.layers.1.mlp.experts.")])
    assert all(layer.packed is not None for layer in layers)
    assert _generate(llm) == want_b
