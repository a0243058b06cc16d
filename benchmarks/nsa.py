"""Decode attention per step, dense (today's native paged kernel) vs NSA (the native NSA decode
kernel) vs training-free top-k (the native top-k kernel), at the Qwen3-0.6B attention shape (16
query heads, 8 KV heads, head_dim 128, bf16), one layer, contexts 8k-64k, batch 1 and 8. Reports KV
bytes read (dense: every key and value; NSA and top-k: the tokens their kernels say they read,
compressed entries and block summaries included), time per step, and the time the bytes alone would
take at the copy bandwidth measured in the same run; prints a markdown table and can write a PNG
plot. NSA uses the paper's defaults (l=32, d=16, l'=64, n=16, w=512); top-k the engine's default
spec (budget 2048, block 64).

`--prefill CONTEXT` times the prefill of a CONTEXT-token prompt through `LLM.generate` on a random
4-layer NSA checkpoint (Qwen3-0.6B's attention shape, hidden 1024, the paper's NSA defaults; built
here once under ~/.cache/cuttle-bench, no download): every query row on the native NSA kernel
(the engine's path) vs the torch reference per sequence (the path prefill rows took before), the
two engines alternating in one process.

`--plan` times the NSA backend's host-side plan of a decode step (once a step, for every layer).
`--documents K,LEN` times one layer's decode attention over a prefix and K squid documents of LEN
tokens through the backends (dense per part vs NSA per part), and over as many keys in one sequence.

`--e2e CONTEXT` instead times whole decode steps of a random Qwen3-0.6B-shaped model (28 layers,
bf16, batch 1) through the engine's model runner, dense vs `sparse_attention` top-k, with a
CONTEXT-token KV cache filled with random keys and values (a real 32k prefill would take far longer
than the decode being measured on a CPU; the decode step's work does not depend on what the cached
values are, only on how many there are).

    .venv/bin/python benchmarks/nsa.py [--contexts 8192,16384,32768,65536] [--batches 1,8] [--plot out.png]
    .venv/bin/python benchmarks/nsa.py --e2e 32768
    .venv/bin/python benchmarks/nsa.py --prefill 4096
    .venv/bin/python benchmarks/nsa.py --plan [--contexts ...] [--batches ...]
    .venv/bin/python benchmarks/nsa.py --documents 8,4096
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbs, machine_info, markdown_table  # noqa: E402

from cuttle.attention import native_attention  # noqa: E402
from cuttle.attention.native import nsa as native_nsa  # noqa: E402
from cuttle.attention.native import topk as native_topk  # noqa: E402
from cuttle.attention.nsa import NSAConfig  # noqa: E402
from cuttle.attention.nsa_backend import compressed_slots_per_block  # noqa: E402
from cuttle.attention.topk import TopKConfig, summarize  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 64


CLOCK = time.perf_counter  # --clock cpu: time.process_time (this process's CPU seconds)


def _time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = CLOCK()
        fn()
        best = min(best, CLOCK() - t0)
    return best


def run(context: int, batch: int, cfg: NSAConfig, topk: TopKConfig, repeats: int) -> dict:
    nb = context // BLOCK
    g = torch.Generator().manual_seed(0)
    shape = (batch * nb, BLOCK, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
    v = torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
    slots = compressed_slots_per_block(cfg, BLOCK)
    ck = torch.randn(batch * nb, slots, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    cv = torch.randn(batch * nb, slots, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    gates = torch.rand(batch, HEADS, 3, generator=g)
    tables = torch.randperm(batch * nb, generator=g).to(torch.int32).view(batch, nb).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int32)
    rows = torch.arange(batch)
    out = torch.empty_like(q)
    lse = torch.empty(batch, HEADS)
    scale = HEAD_DIM**-0.5

    def dense():
        native_attention.paged_attention_rows(q, k, v, out, lse, rows, rows, tables, lens, scale)

    touched = torch.zeros(batch, KV_HEADS, dtype=torch.int64)

    def nsa():
        native_nsa.nsa_decode(q, k, v, ck, cv, gates, out, rows, tables, lens, cfg, scale, touched=touched)

    # the top-k summaries of the same keys (BLOCK = topk.block: one summary slot per raw block)
    assert topk.block == BLOCK
    summ = summarize(k.transpose(1, 2), topk)[:, None].contiguous()  # [blocks, 1, R, Hkv, D]
    touched_k = torch.zeros(batch, KV_HEADS, dtype=torch.int64)

    def sparse():
        native_topk.topk_decode(q, k, v, summ, out, lse, rows, tables, lens, topk, scale, touched=touched_k)

    t_dense, t_nsa, t_topk = _time(dense, repeats), _time(nsa, repeats), _time(sparse, repeats)
    per_token = 2 * KV_HEADS * HEAD_DIM * 2  # K and V, bf16
    summary_vectors = (context // topk.block) * topk.summary_rows  # read once per KV head
    return dict(context=context, batch=batch, dense_bytes=batch * context * per_token,
                nsa_bytes=int(touched[:, 0].sum()) * per_token, nsa_tokens=int(touched[0, 0]), t_dense=t_dense, t_nsa=t_nsa,
                topk_bytes=int(touched_k[:, 0].sum()) * per_token + batch * summary_vectors * KV_HEADS * HEAD_DIM * 2,
                topk_tokens=int(touched_k[0, 0]), t_topk=t_topk)


def documents_step(num_docs: int, doc_len: int, repeats: int, info: str) -> None:
    """One layer's decode attention (bf16, the 0.6B attention shape) for a query over a prefix and
    `num_docs` documents (squid, `concat`: every document but the first moved by a rope delta) plus
    its own tokens, through the backends as the engine calls them: dense (the torch backend, native
    kernel per part, log-sum-exp merge) vs NSA (per part, docs/nsa.md), and the same number of keys
    as one plain sequence for each. Best of `repeats` after a warm-up."""
    from cuttle.attention.metadata import AttentionMetadata, KVSegment, SeqLayout
    from cuttle.attention.nsa import compress_windows
    from cuttle.attention.nsa_backend import NSABackend
    from cuttle.attention.rope import RotaryEmbedding
    from cuttle.attention.torch_backend import TorchAttentionBackend

    cfg, prefix, own = NSAConfig(compress_fn="mean"), 512, 256 + 7  # the own tokens end mid-stride: no entry completes
    lens = [prefix] + [doc_len] * num_docs + [own]
    nbs = [-(-n // BLOCK) for n in lens]
    total = sum(nbs) + 1
    g = torch.Generator().manual_seed(0)
    shape = (total, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(2)]
    slots = compressed_slots_per_block(cfg, BLOCK)
    caches += [torch.randn(total, slots, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16) for _ in range(2)]
    ids = torch.randperm(total, generator=g).tolist()
    tables, at = [], 0
    for nb in nbs:
        tables.append(ids[at : at + nb])
        at += nb
    rope = RotaryEmbedding(HEAD_DIM, 1 << 20, 1e6, None, torch.device("cpu"))
    segs = [KVSegment(tables[0], prefix, causal=False)]
    for i in range(num_docs):
        segs.append(KVSegment(tables[1 + i], doc_len, causal=False, rope_delta=i * doc_len))
    segs.append(KVSegment(tables[-1], own, causal=True))
    squid = AttentionMetadata.build([SeqLayout(1, segs)], BLOCK, "cpu", rope=rope)
    plain_len = sum(lens)
    plain_ids = ids[: -(-plain_len // BLOCK)]
    plain = AttentionMetadata.build([SeqLayout(1, [KVSegment(plain_ids, plain_len, causal=True)])], BLOCK, "cpu")
    q = torch.randn(1, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    kn = torch.randn(1, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    vn = torch.randn(1, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    gates = torch.rand(1, HEADS, 3, generator=g)
    scale = HEAD_DIM**-0.5
    compressor = lambda wk, wv: (compress_windows(wk, None, cfg), compress_windows(wv, None, cfg))  # noqa: E731
    dense_backend = TorchAttentionBackend()
    nsa_backend = NSABackend(cfg, TorchAttentionBackend(), BLOCK)
    times = {}
    for name, meta in (("documents", squid), ("one sequence", plain)):
        dense_backend.begin_step(meta)
        nsa_backend.begin_step(meta)
        times[name] = (_time(lambda: dense_backend.forward(0, q, kn, vn, caches[0], caches[1], meta, scale), repeats),
                       _time(lambda: nsa_backend.forward_nsa(0, q, kn, vn, gates, tuple(caches), meta, scale, compressor),
                             repeats), _nsa_keys_read(nsa_backend, meta, q, caches, scale))
    print(f"machine: {info}\none layer's decode attention, bf16, {HEADS} / {KV_HEADS} heads of {HEAD_DIM}, batch 1: "
          f"a {prefix}-token prefix, {num_docs} documents of {doc_len}, {own} own tokens ({plain_len} keys), "
          f"NSA paper defaults (phi mean), best of {repeats}\n")
    rows = [[name, f"{td * 1e3:.2f}", f"{tn * 1e3:.2f}", f"{td / tn:.1f}x", read] for name, (td, tn, read) in times.items()]
    print(markdown_table(["keys as", "dense ms", "NSA ms", "NSA speed-up", "NSA keys read per KV head"], rows))


def _nsa_keys_read(backend, meta, q, caches, scale) -> int:
    """KV tokens the NSA kernel reads per KV head for this step's rows, summed over its parts
    (the kernel's own count, `touched`)."""
    plan = backend._plan
    rows_q = q if meta.segments is None else meta.segments.virtual_queries(q)
    n = plan.native_rows.shape[0]
    touched = torch.zeros(n, KV_HEADS, dtype=torch.int64)
    bo = torch.zeros(rows_q.shape[0], HEADS, 3, HEAD_DIM)
    bl = torch.zeros(rows_q.shape[0], HEADS, 3)
    native_nsa.nsa_decode(rows_q, *caches, None, None, plan.native_rows, plan.native_tables, plan.native_lens, backend.cfg,
                          scale, touched=touched, branches=(bo, bl))
    return int(touched[:, 0].sum())


def step_plan(contexts: list[int], batches: list[int], repeats: int, info: str) -> None:
    """The NSA backend's host-side plan of one decode step (`NSAStepPlan`: the entries the step
    completes, each sequence's rows for the native kernel), built once a step for all layers."""
    from cuttle.attention.metadata import AttentionMetadata, KVSegment, SeqLayout
    from cuttle.attention.nsa_backend import NSAStepPlan, compressed_slots_per_block

    cfg, bs = NSAConfig(), 64
    rows = []
    for batch in batches:
        for ctx in contexts:
            nb = -(-ctx // bs)
            layouts = [SeqLayout(1, [KVSegment(list(range(b * nb, (b + 1) * nb)), ctx, causal=True)]) for b in range(batch)]
            meta = AttentionMetadata.build(layouts, bs, "cpu")
            best = float("inf")
            for _ in range(repeats):
                t0 = CLOCK()
                NSAStepPlan(meta, cfg, compressed_slots_per_block(cfg, bs), True)
                best = min(best, CLOCK() - t0)
            rows.append([ctx, batch, f"{best * 1e3:.2f}"])
    print(f"machine: {info}\nNSA step plan (paper defaults, block_size {bs}), best of {repeats}\n")
    print(markdown_table(["context", "batch", "plan ms"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="8192,16384,32768,65536")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--topk", default="topk", help="the top-k spec (block must be 64)")
    ap.add_argument("--e2e", type=int, default=None, metavar="CONTEXT", help="time whole decode steps of the 0.6B shape instead")
    ap.add_argument("--prefill", type=int, default=None, metavar="CONTEXT",
                    help="time an NSA model's prefill of a CONTEXT-token prompt instead (native kernel vs torch reference)")
    ap.add_argument("--documents", default=None, metavar="K,LEN",
                    help="time one layer's decode attention over a prefix and K documents of LEN tokens (squid) instead")
    ap.add_argument("--plan", action="store_true",
                    help="time the NSA backend's per-step plan (host work once a step, shared by every layer) instead")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: one thread, timed in process CPU seconds (a machine shared with other jobs makes wall time "
                         "mostly a measure of the scheduler; CPU time still counts cache and memory contention)")
    args = ap.parse_args()
    global CLOCK
    if args.clock == "cpu":
        torch.set_num_threads(1)
        CLOCK = time.process_time
    if not native_nsa.available():
        raise SystemExit("the native kernel library did not build here")
    from cuttle.attention.topk import parse_sparse_attention

    topk = parse_sparse_attention(args.topk)
    info = machine_info()
    if args.e2e:
        return end_to_end(args.e2e, topk, args.repeats, info)
    if args.prefill:
        return nsa_prefill(args.prefill, args.repeats, info)
    if args.documents:
        k, n = (int(x) for x in args.documents.split(","))
        return documents_step(k, n, args.repeats, info)
    if args.plan:
        return step_plan([int(c) for c in args.contexts.split(",")], [int(b) for b in args.batches.split(",")],
                         args.repeats, info)
    cfg = NSAConfig()
    bw = copy_bandwidth_gbs()
    results = [run(c, b, cfg, topk, args.repeats) for b in map(int, args.batches.split(",")) for c in map(int, args.contexts.split(","))]
    print(f"machine: {info}\ncopy bandwidth: {bw:.1f} GB/s (read + write of one copy)\ntop-k: {topk.spec()}\n"
          f"clock: {args.clock} ({torch.get_num_threads()} threads), best of {args.repeats}\n")
    rows = []
    for r in results:
        rows.append([
            r["context"], r["batch"], r["nsa_tokens"], r["topk_tokens"], f"{r['dense_bytes'] / 2**20:.1f}",
            f"{r['nsa_bytes'] / 2**20:.2f}", f"{r['topk_bytes'] / 2**20:.2f}", f"{r['dense_bytes'] / r['nsa_bytes']:.1f}x",
            f"{r['dense_bytes'] / r['topk_bytes']:.1f}x", f"{r['t_dense'] * 1e3:.2f}", f"{r['t_nsa'] * 1e3:.3f}",
            f"{r['t_topk'] * 1e3:.3f}", f"{r['t_dense'] / r['t_nsa']:.1f}x", f"{r['t_dense'] / r['t_topk']:.1f}x",
            f"{r['dense_bytes'] / (bw * 1e9) * 1e3:.2f}", f"{r['nsa_bytes'] / (bw * 1e9) * 1e3:.3f}",
            f"{r['topk_bytes'] / (bw * 1e9) * 1e3:.3f}",
        ])
    print(markdown_table(
        ["context", "batch", "NSA tokens/row", "top-k tokens/row", "dense MiB", "NSA MiB", "top-k MiB", "bytes ratio NSA",
         "bytes ratio top-k", "dense ms", "NSA ms", "top-k ms", "NSA speedup", "top-k speedup", "dense ms @copy bw",
         "NSA ms @copy bw", "top-k ms @copy bw"], rows))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for b in sorted({r["batch"] for r in results}):
            rs = [r for r in results if r["batch"] == b]
            xs = [r["context"] // 1024 for r in rs]
            ax.plot(xs, [r["t_dense"] * 1e3 for r in rs], "o-", label=f"dense, batch {b}")
            ax.plot(xs, [r["t_nsa"] * 1e3 for r in rs], "s-", label=f"NSA, batch {b}")
            ax.plot(xs, [r["t_topk"] * 1e3 for r in rs], "^--", label=f"top-k, batch {b}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (k tokens)")
        ax.set_ylabel(f"decode attention per step, one layer ({'CPU ' if CLOCK is time.process_time else ''}ms)")
        ax.set_title("Qwen3-0.6B attention shape, bf16, CPU native kernels")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"\nplot: {args.plot}")


def end_to_end(context: int, topk: TopKConfig, repeats: int, info: dict) -> None:
    """Batch-1 decode steps of the random Qwen3-0.6B-shaped checkpoint through the model runner,
    dense vs top-k, over a `context`-token cache of random K/V (summaries built from it)."""
    from common import preset_checkpoint

    from cuttle.attention.metadata import AttentionMetadata
    from cuttle.engine.config import EngineConfig, ModelConfig
    from cuttle.engine.model_runner import ModelRunner, StepInputs

    path = preset_checkpoint("qwen3-0.6b")
    mc = ModelConfig.from_pretrained(path)
    mc.max_position_embeddings = max(mc.max_position_embeddings, context + 64)
    nb = -(-(context + 1) // BLOCK)
    times = {}
    for label, spec in (("dense", None), ("top-k", topk.spec())):
        config = EngineConfig(model=path, dtype="bfloat16", block_size=BLOCK, num_kv_blocks=nb, sparse_attention=spec)
        runner = ModelRunner(config, mc, torch.device("cpu"), torch.bfloat16, nb)
        g = torch.Generator().manual_seed(0)
        for k, v in runner.kv.layers:
            k.copy_(torch.randn(k.shape, generator=g).to(k.dtype))
            v.copy_(torch.randn(v.shape, generator=g).to(v.dtype))
        if runner.topk_cache is not None:  # the summaries of the random keys, as the prefill would have stored them
            for i, summ in enumerate(runner.topk_cache.unbind(0)):
                k = runner.kv.layers[topk.dense_layers + i][0]
                summ.copy_(summarize(k.transpose(1, 2), topk)[:, None])
        table = torch.arange(nb, dtype=torch.int32)[None]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=torch.tensor([context + 1], dtype=torch.int32),
            block_tables=table, slot_mapping=torch.tensor([context], dtype=torch.int64), block_size=BLOCK, max_query_len=1,
            max_seq_len=context + 1, query_lens_cpu=[1], seq_lens_cpu=[context + 1],
        )
        inputs = StepInputs(input_ids=torch.tensor([42]), positions=torch.tensor([context]), meta=meta,
                            logit_rows=torch.tensor([0]), sample_seqs=[], prompt_rows=[])
        times[label] = _time(lambda r=runner: r.run(inputs), repeats)
    print(f"machine: {info}\nQwen3-0.6B shape (28 layers, bf16), batch 1, {context}-token context; top-k: {topk.spec()}; "
          f"{torch.get_num_threads()} threads, best of {repeats}\n")
    print(markdown_table(["context", "dense ms/step", "top-k ms/step", "speedup"],
                         [[context, f"{times['dense'] * 1e3:.1f}", f"{times['top-k'] * 1e3:.1f}",
                           f"{times['dense'] / times['top-k']:.2f}x"]]))


NSA_PREFILL_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 1024, "hidden_size": 1024, "intermediate_size": 1024,
    "num_hidden_layers": 4, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
    "max_position_embeddings": 65536, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "eos_token_id": 1,
    "rope_theta": 1000000.0, "hidden_act": "silu", "torch_dtype": "bfloat16", "nsa": {},
}


def nsa_checkpoint(path: str) -> str:
    """A random NSA checkpoint (NSA_PREFILL_CONFIG) under its HF names, built once with cuttle's own
    model class (transformers has no NSA layer)."""
    import json

    from safetensors.torch import save_file

    from cuttle.engine.config import ModelConfig
    from cuttle.engine.models.loader import hf_state_dict
    from cuttle.engine.models.transformer import CausalLM

    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    from common import _write_byte_tokenizer

    os.makedirs(path, exist_ok=True)
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_hf(NSA_PREFILL_CONFIG), torch.bfloat16, torch.device("cpu"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    save_file({k: v.contiguous().clone() for k, v in hf_state_dict(model).items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(NSA_PREFILL_CONFIG, f)
    _write_byte_tokenizer(path, NSA_PREFILL_CONFIG["vocab_size"], NSA_PREFILL_CONFIG["eos_token_id"])
    return path


def nsa_prefill(context: int, repeats: int, info: dict) -> None:
    """Prefill of a `context`-token prompt, one token generated, native NSA kernel vs the torch
    reference (the engine built with the native kernel reported unavailable), alternating."""
    from unittest import mock

    from common import DEFAULT_CACHE_DIR

    from cuttle.engine import LLM, SamplingParams

    path = nsa_checkpoint(os.path.join(DEFAULT_CACHE_DIR, "nsa-4layer-random"))
    kw = dict(dtype="bfloat16", block_size=BLOCK, max_model_len=context + 64, max_num_batched_tokens=2048,
              enable_prefix_caching=False)
    engines = {"native": LLM(path, **kw)}
    with mock.patch.object(native_nsa, "available", lambda: False):
        engines["reference"] = LLM(path, **kw)
    ids = torch.randint(5, 1000, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    times: dict[str, list[float]] = {k: [] for k in engines}
    first: dict[str, list[int]] = {}
    for name, llm in engines.items():  # warm-up: kernel build, packing, first allocations
        llm.generate([{"prompt_token_ids": ids[:256]}], params, use_tqdm=False)
    for _ in range(repeats):
        for name, llm in engines.items():
            t0 = CLOCK()
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            times[name].append(CLOCK() - t0)
            first[name] = out[0].outputs[0].token_ids
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"machine: {info}\nrandom NSA checkpoint: {NSA_PREFILL_CONFIG['num_hidden_layers']} layers, hidden "
          f"{NSA_PREFILL_CONFIG['hidden_size']}, {HEADS} / {KV_HEADS} heads of {HEAD_DIM}, bf16, NSA {NSAConfig()}; "
          f"block size {BLOCK}, chunks of 2048 tokens; {torch.get_num_threads()} threads, median of {repeats}\n")
    print(markdown_table(["prompt tokens", "native kernel s", "torch reference s", "speedup", "same first token"],
                         [[context, f"{med['native']:.2f}", f"{med['reference']:.2f}", f"{med['reference'] / med['native']:.1f}x",
                           first["native"] == first["reference"]]]))


if __name__ == "__main__":
    main()
