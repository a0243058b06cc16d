"""Huge-page host memory for streamed weights (cuttle.attention.native.hugepages): the values never
change, ties survive, moving is idempotent, and the memory really is MADV_HUGEPAGE-advised."""
import gc
import re

import pytest
import torch
from torch import nn

from cuttle.attention.native import hugepages

needs_thp = pytest.mark.skipif(not hugepages.available(), reason="transparent huge pages are off on this machine "
                               "(/sys/kernel/mm/transparent_hugepage/enabled is [never] or missing)")


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping holding addr (/proc/self/smaps)."""
    span = None
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                span = (int(m.group(1), 16), int(m.group(2), 16))
            elif line.startswith("VmFlags") and span and span[0] <= addr < span[1]:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@needs_thp
def test_empty_is_advised_writable_and_freed_with_the_tensor():
    t = hugepages.empty((1024, 1024), torch.float32)
    assert t.shape == (1024, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    assert "hg" in _vm_flags(t.data_ptr())  # MADV_HUGEPAGE on the mapping
    assert hugepages.is_backed(t)
    t.fill_(2.5)
    assert float(t.sum()) == 2.5 * 1024 * 1024
    entry = hugepages._ours[t.data_ptr()]
    del t
    gc.collect()
    assert entry[1]() is None  # the mapping went with the tensor


def test_small_tensors_and_the_switch_keep_plain_memory(monkeypatch):
    small = hugepages.empty((16, 16), torch.bfloat16)
    assert small.shape == (16, 16) and not hugepages.is_backed(small)
    monkeypatch.setenv("CUTTLE_HUGEPAGES", "0")
    assert not hugepages.available()
    big = torch.randn(1024, 1024)
    assert hugepages.backed(big) is big
    assert not hugepages.is_backed(hugepages.empty((1024, 1024), torch.float32))


@needs_thp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_backed_copies_bit_for_bit_and_is_idempotent(dtype):
    src = torch.randn(2100, 1031).to(dtype)  # 2.1 MB even at one byte an element
    moved = hugepages.backed(src)
    assert moved is not src and hugepages.is_backed(moved)
    assert moved.dtype == dtype and moved.shape == src.shape
    assert torch.equal(moved.view(torch.uint8), src.view(torch.uint8))
    assert hugepages.backed(moved) is moved  # already there: not copied again
    view = src[:, :10]  # a view of a larger storage stays put (it is not the whole weight)
    assert hugepages.backed(view) is view


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Parameter(torch.randn(2048, 256))
        self.lm_head = self.embed  # one Parameter under two names, as a tied lm_head
        self.proj = nn.Linear(256, 4096, bias=False)
        self.small = nn.Linear(4, 4)
        self.register_buffer("table", torch.randn(1024, 1024))


@needs_thp
def test_back_module_keeps_values_parameters_and_ties():
    torch.manual_seed(0)
    m = _Tied()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    params = {name: p for name, p in m.named_parameters(remove_duplicate=False)}
    x = torch.randn(3, 256)
    y0 = m.proj(x)
    moved = hugepages.back_module(m)
    assert moved == (2048 * 256 + 4096 * 256 + 1024 * 1024) * 4
    assert all(p is params[name] for name, p in m.named_parameters(remove_duplicate=False))
    assert m.lm_head is m.embed
    for name in ("embed", "proj.weight", "table"):
        assert hugepages.is_backed(m.get_buffer(name) if name == "table" else m.get_parameter(name)), name
    assert not hugepages.is_backed(m.small.weight)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(m.proj(x), y0)
    assert hugepages.back_module(m) == 0  # a second prepack moves nothing


@needs_thp
def test_engine_streams_its_weights_from_huge_pages(tmp_path, monkeypatch):
    """On CPU the engine moves its weights (and packs the routed experts) into huge-page memory at
    load; the greedy tokens and logprobs are those of plain memory, exactly."""
    from helpers import make_checkpoint

    from cuttle.engine import LLM, SamplingParams

    make_checkpoint(str(tmp_path), "qwen3_moe", seed=3)
    monkeypatch.setattr(hugepages, "MIN_BYTES", 4096)  # the tiny model's tensors are a few KiB
    sp = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
    prompts = [[5, 9, 2, 7, 11], [3] * 17]

    def run():
        llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return llm, [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                     for o in outs]

    llm, fast = run()
    model = llm.engine.runner.model
    assert hugepages.is_backed(model.lm_head) and hugepages.is_backed(model.embed)
    assert hugepages.is_backed(model.layers[0].attn.qkv_weight)
    packed = model.layers[0].mlp.packed
    assert packed is not None and hugepages.is_backed(packed.w13) and hugepages.is_backed(packed.w2)
    monkeypatch.setenv("CUTTLE_HUGEPAGES", "0")
    llm2, plain = run()
    assert not hugepages.is_backed(llm2.engine.runner.model.lm_head)
    for (t1, l1), (t2, l2) in zip(fast, plain):
        assert t1 == t2
        assert [float(getattr(a, "logprob", a)) for a in l1] == [float(getattr(b, "logprob", b)) for b in l2]


@needs_thp
def test_packed_bf16_weight_copies_are_advised():
    """The packed copy the AVX512-BF16 GEMM reads instead of a bf16 weight is streamed like it, so
    it lives in huge-page memory too (it is what a decode step reads for the lm_head)."""
    from cuttle.attention import native
    from cuttle.attention.native import gemm

    if not native.kernels().packed_gemm:
        pytest.skip("no packed CPU GEMM here (needs the native library and AVX512-BF16)")
    w = torch.randn(2048, 1024).bfloat16()  # 4 MiB packed
    packed = gemm._packed(w)
    assert hugepages.is_backed(packed) and "hg" in _vm_flags(packed.data_ptr())
