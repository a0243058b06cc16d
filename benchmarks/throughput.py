"""Offline throughput and batch-1 decode: cuttle vs transformers `generate`, vLLM (CPU) and
llama.cpp on the same weights and the same token-id prompts.

    python benchmarks/throughput.py                 # Qwen3-0.6B-shaped random checkpoint, bf16
    python benchmarks/throughput.py --quick         # fewer requests/tokens, for a smoke run
    python benchmarks/throughput.py --model-preset qwen3-moe-small --json out.json
    python benchmarks/throughput.py --peers none    # cuttle and transformers only

cuttle's engines of one run (bf16 and each MXFP8 option) are all kept after their offline runs,
and the batch-1 decode of each of them and of the llama.cpp peers is the median of --decode-rounds
rounds that visit every one in turn (a llama.cpp round is one process run), so the batch-1 ratios
do not ride on the drift of a shared machine's rate (tens of percent over minutes).

Reports output tokens/s, the ratio to transformers, and batch-1 decode as a fraction of the
memory-bandwidth limit (bytes of the weights one token reads / copy bandwidth measured in this run),
plus the offline figure as a fraction of the matmul FLOP limit measured in this run (the --dtype
GEMM's rate, or for bf16 the fp32 GEMM's where that is faster: CPUs without AVX512-BF16/AMX).
The peers run in their own venvs (`bash benchmarks/peers/setup.sh` installs them; a peer that is
not set up is skipped with a message): vLLM via benchmarks/peers/vllm_offline.py (same workload,
same max-num-seqs), llama.cpp via benchmarks/peers/llamacpp_offline.py on the bf16 GGUF (batch-1
decode only, all cores; no offline batched figure; bf16 runs only) and, as `llamacpp-q8_0`, on the
Q8_0 GGUF (8.5 bits per weight; run whatever --dtype, its bandwidth fraction uses its own bytes).
"""
from __future__ import annotations

import argparse
import atexit
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import PRESETS, copy_bandwidth_gbs, machine_info, markdown_table, matmul_gflops, preset_checkpoint  # noqa: E402
from peers.servers import PeerUnavailable, gguf_ready, peer_env, require  # noqa: E402

PEERS = ("vllm", "llamacpp", "llamacpp-q8_0")
Q8_0_BYTES_PER_PARAM = 34 / 32  # llama.cpp's Q8_0 block: 32 int8 weights + one fp16 scale
PEER_TIMEOUT_S = 3600


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def offline_cuttle(path: str, dtype: str, reqs: list[list[int]], out_len: int, max_num_seqs: int, **engine_kw):
    """(the LLM, kept for the batch-1 rounds; offline output tok/s). `engine_kw`: e.g. quantization="mxfp8"."""
    from cuttle.engine import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, max_model_len=len(reqs[0]) + out_len + 16, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=2048, enable_prefix_caching=False, **engine_kw)
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    # warm-up, at batch 2 and batch 1: a decode batch size's kernel graph is captured (and checked
    # against an eager step) the first time it runs, which the timed runs must not pay for, as the
    # peers' timed runs follow warm-up runs too
    llm.generate(reqs[:2], warm, use_tqdm=False)
    llm.generate(reqs[:1], warm, use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(reqs, sp, use_tqdm=False)
    return llm, sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def decode_b1(llm, prompt: list[int], out_len: int) -> float:
    """Batch-1 decode tok/s of one request (prefill and first token not counted)."""
    from cuttle.engine import SamplingParams

    engine = llm.engine
    engine.add_request(f"b1-{time.perf_counter_ns()}", prompt, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    engine.step()  # prefill + first token
    t = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - t)


def interleaved_b1(runners: dict[str, Callable[[], float]], rounds: int, skipped: dict[str, str],
                   peers: frozenset[str] = frozenset()) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Median batch-1 decode tok/s of each runner (a cuttle engine kept alive, or a llama.cpp peer
    process) over `rounds` rounds that visit every runner in turn: the rate of a shared VM drifts by
    tens of percent over minutes, so engines measured one after another would be compared across
    that drift; interleaved, each round sees the same. A runner named in `peers` that raises a peer
    error is dropped and recorded in `skipped` (a cuttle engine's error propagates). Returns
    (medians, every round's figures)."""
    rates: dict[str, list[float]] = {name: [] for name in runners}
    live = dict(runners)
    for _ in range(rounds):
        for name, run in list(live.items()):
            try:
                rates[name].append(run())
            except (PeerUnavailable, RuntimeError, subprocess.TimeoutExpired) as e:
                if name not in peers:
                    raise
                skipped[name] = str(e)
                print(f"{name}: skipped: {e}", flush=True)
                del live[name], rates[name]
    return {name: sorted(r)[len(r) // 2] for name, r in rates.items()}, rates


def bench_cuttle(path: str, dtype: str, reqs: list[list[int]], out_len: int, max_num_seqs: int, **engine_kw) -> tuple[float, float]:
    """(offline output tok/s, batch-1 decode tok/s) of one engine on its own."""
    llm, offline = offline_cuttle(path, dtype, reqs, out_len, max_num_seqs, **engine_kw)
    return offline, decode_b1(llm, reqs[0], out_len)


def bench_transformers(path: str, dtype: torch.dtype, reqs: list[list[int]], out_len: int, batch: int) -> tuple[float, float]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=out_len, max_new_tokens=out_len)
    with torch.inference_mode():
        model.generate(torch.tensor(reqs[:1]), **{**kw, "min_new_tokens": 2, "max_new_tokens": 2})
        t = time.perf_counter()
        total = 0
        for i in range(0, len(reqs), batch):
            out = model.generate(torch.tensor(reqs[i : i + batch]), **kw)
            total += (out.shape[1] - len(reqs[0])) * out.shape[0]
        offline = total / (time.perf_counter() - t)
        x = torch.tensor(reqs[:1])
        t0 = time.perf_counter()
        model.generate(x, **{**kw, "min_new_tokens": 1, "max_new_tokens": 1})
        first = time.perf_counter() - t0
        t = time.perf_counter()
        model.generate(x, **kw)
        decode = (out_len - 1) / (time.perf_counter() - t - first)
    return offline, decode


def run_peer(engine: str, cmd: list[str], timeout: float = PEER_TIMEOUT_S) -> dict:
    """Run a peer's runner script in its venv; its last stdout line is a JSON object."""
    with tempfile.NamedTemporaryFile("w+", prefix=f"cuttle-bench-{engine}-", suffix=".log", delete=False) as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=peer_env(engine), timeout=timeout)
        log.seek(0)
        lines = log.read().splitlines()
    for line in reversed(lines):
        if line.startswith("{") and '"engine"' in line:
            return json.loads(line)
    tail = "\n".join(lines[-25:])
    raise RuntimeError(f"{engine} runner exited with code {rc} without a result; log {log.name}; tail:\n{tail}")


def bench_vllm(path: str, dtype: str, prompts_file: str, out_len: int, max_num_seqs: int, enforce_eager: bool) -> dict:
    cmd = [require("vllm"), os.path.join(HERE, "peers", "vllm_offline.py"), "--model", path, "--prompts", prompts_file,
           "--output-len", str(out_len), "--max-num-seqs", str(max_num_seqs), "--dtype", dtype]
    return run_peer("vllm", cmd + (["--enforce-eager"] if enforce_eager else []))


def bench_llamacpp(path: str, dtype: str, prompts_file: str, out_len: int, outtype: str = "bf16") -> dict:
    if outtype == "bf16" and dtype != "bfloat16":
        raise PeerUnavailable(f"llama.cpp: the bf16 GGUF runs in bf16 runs only (this run is {dtype}; llamacpp-q8_0 runs in any)")
    py, gguf = require("llamacpp"), gguf_ready(path, outtype)
    return run_peer("llamacpp", [py, os.path.join(HERE, "peers", "llamacpp_offline.py"), "--gguf", gguf, "--prompts", prompts_file,
                                 "--output-len", str(out_len), "--threads", str(os.cpu_count() or 1)])


def weight_counts(mc, n_params: int) -> tuple[int, int]:
    """(parameters one decode token reads, parameters of its matmuls other than lm_head).

    Reads: everything but the inactive routed experts and, when untied, the embedding table (one
    row is gathered). Matmuls: the same minus the lm_head (counted apart: prompt tokens skip it)."""
    hf = mc.hf_config
    n_exp = int(hf.get("num_experts") or hf.get("n_routed_experts") or hf.get("num_local_experts") or 0)
    top_k = int(hf.get("num_experts_per_tok") or 0)
    inactive = len(mc.moe_layers) * max(n_exp - top_k, 0) * 3 * mc.hidden_size * mc.moe_intermediate_size if n_exp else 0
    emb = mc.vocab_size * mc.hidden_size
    read = n_params - inactive - (0 if mc.tie_word_embeddings else emb)
    return read, read - emb


def mxfp8_params(mc, quantization: str | None, moe_quant: str | None, lm_head: bool = False) -> int:
    """Parameters one decode token reads in MXFP8 (8.25 bits) under these options: the active
    routed experts (either option), plus every attention and dense-MLP linear (`quantization`),
    plus the lm_head (`quantize_lm_head`)."""
    hf = mc.hf_config
    top_k = int(hf.get("num_experts_per_tok") or 0)
    n = len(mc.moe_layers) * top_k * 3 * mc.hidden_size * mc.moe_intermediate_size if (quantization or moe_quant) else 0
    if quantization:
        q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
        n += mc.num_layers * (mc.hidden_size * (q + 2 * kv) + q * mc.hidden_size)
        n += (mc.num_layers - len(mc.moe_layers)) * 3 * mc.hidden_size * mc.intermediate_size
    if lm_head:
        n += mc.vocab_size * mc.hidden_size
    return n


# cuttle's MXFP8 runs: (results key, label, engine options, the options of `mxfp8_params`)
MXFP8_VARIANTS = {
    "moe_quant": ("cuttle-mxfp8-experts", "cuttle, MXFP8 experts", {"moe_quant": "mxfp8"}, (None, "mxfp8", False)),
    "quantization": ("cuttle-mxfp8", "cuttle, MXFP8 all linears + experts", {"quantization": "mxfp8"}, ("mxfp8", None, False)),
    "quantize_lm_head": ("cuttle-mxfp8-lm-head", "cuttle, MXFP8 all linears + experts + lm_head",
                         {"quantization": "mxfp8", "quantize_lm_head": True}, ("mxfp8", None, True)),
}


def _finite(x):
    """NaN / inf -> None, recursively (strict JSON)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: the --model-preset random one)")
    ap.add_argument("--model-preset", default="qwen3-0.6b", choices=sorted(PRESETS), help="random checkpoint of this shape (default qwen3-0.6b)")
    ap.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/cuttle-bench"))
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--quick", action="store_true", help="16 requests x 32 tokens")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"comma list of peers to run, of {','.join(PEERS)}; 'none' for none (default: all)")
    ap.add_argument("--moe-ab", action="store_true",
                    help="also run cuttle with the routed experts on the torch path (CUTTLE_MOE_NATIVE=0), in this run")
    ap.add_argument("--quantization", choices=["mxfp8"], default=None,
                    help="also run cuttle with every linear (and the routed experts) in MXFP8, in this run")
    ap.add_argument("--moe-quant", choices=["mxfp8"], default=None,
                    help="also run cuttle with the routed experts in MXFP8, in this run")
    ap.add_argument("--quantize-lm-head", action="store_true",
                    help="also run cuttle with every linear, the routed experts and the lm_head in MXFP8, in this run")
    ap.add_argument("--vllm-enforce-eager", action="store_true", help="run vLLM without its torch.compile step")
    ap.add_argument("--decode-rounds", type=int, default=3,
                    help="batch-1 decode: rounds over every cuttle engine of the run, in turn; the median is reported (default 3)")
    ap.add_argument("--json", default=None, metavar="OUT", help="also write every figure to this JSON file")
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.output_len = 16, 32
    peers = [] if args.peers.strip() in ("", "none") else [p.strip() for p in args.peers.split(",")]
    if unknown := set(peers) - set(PEERS):
        ap.error(f"unknown peers {sorted(unknown)}; choose from {PEERS}")
    path = args.model or preset_checkpoint(args.model_preset, args.cache_dir)
    tdtype = getattr(torch, args.dtype)

    info = machine_info()
    bw = copy_bandwidth_gbs()
    flops = flops_dtype = matmul_gflops(tdtype)
    flops_src = f"{args.dtype} matmul"
    if tdtype == torch.bfloat16:
        # bf16 weights widen exactly to fp32 in registers (the AVX2 path does so), so where torch's
        # bf16 GEMM is slower than its fp32 one (a CPU without AVX512-BF16/AMX) the machine's
        # limit is the fp32 rate
        flops_f32 = matmul_gflops(torch.float32)
        if flops_f32 > flops:
            flops, flops_src = flops_f32, f"fp32 matmul (faster than bf16's {flops_dtype:.1f} here)"
    from cuttle.engine.config import ModelConfig

    mc = ModelConfig.from_pretrained(path)
    from cuttle.engine.models import load_model

    n_params = sum(p.numel() for p in load_model(path, mc, tdtype, torch.device("cpu")).parameters())
    read_params, body_params = weight_counts(mc, n_params)
    weight_bytes = read_params * tdtype.itemsize  # dense tied: all the weights
    flop_per_token = 2 * body_params  # matmuls of the active weights but lm_head
    bw_limit = bw * 1e9 / weight_bytes

    reqs = prompts(args.num_requests, args.prompt_len, mc.vocab_size)
    print(f"limits: copy {bw:.1f} GB/s, {flops_src} {flops:.0f} GFLOP/s", flush=True)
    if args.decode_rounds < 1:
        ap.error("--decode-rounds must be >= 1")
    llms: dict[str, object] = {}  # kept for the interleaved batch-1 rounds
    llms["cuttle"], c_off = offline_cuttle(path, args.dtype, reqs, args.output_len, args.max_num_seqs)
    print(f"cuttle: offline {c_off:.1f} out tok/s", flush=True)
    mx_offline: dict[str, tuple[str, float, tuple]] = {}  # results key -> (label, offline, mxfp8_params options)
    for opt, (key, label, kw, n_opts) in MXFP8_VARIANTS.items():
        if getattr(args, opt):
            llms[key], off = offline_cuttle(path, args.dtype, reqs, args.output_len, args.max_num_seqs, **kw)
            mx_offline[key] = (label, off, n_opts)
            print(f"{label} ({kw}): offline {off:.1f} out tok/s", flush=True)
    skipped: dict[str, str] = {}
    with tempfile.NamedTemporaryFile("w", prefix="cuttle-bench-prompts-", suffix=".json", delete=False) as f:
        json.dump(reqs, f)
    atexit.register(os.unlink, f.name)  # the peers read it until the end of the run
    peer_runs: dict[str, dict] = {}  # llama.cpp peer -> its last run's JSON

    def llamacpp_b1(peer: str) -> Callable[[], float]:
        def run() -> float:
            peer_runs[peer] = bench_llamacpp(path, args.dtype, f.name, args.output_len, "q8_0" if peer == "llamacpp-q8_0" else "bf16")
            return peer_runs[peer]["decode_tok_s"]
        return run

    # batch 1: cuttle's engines and the llama.cpp peers (batch-1 engines) in interleaved rounds
    runners: dict[str, Callable[[], float]] = {
        name: (lambda llm=llm: decode_b1(llm, reqs[0], args.output_len)) for name, llm in llms.items()}
    runners.update({peer: llamacpp_b1(peer) for peer in peers if peer.startswith("llamacpp")})
    b1, b1_rounds = interleaved_b1(runners, args.decode_rounds, skipped, frozenset(peers))
    llms.clear()
    runners.clear()
    gc.collect()  # the engines hold reference cycles: free their memory before the next ones start
    c_dec = b1["cuttle"]
    print(f"cuttle: batch-1 decode {c_dec:.2f} tok/s (median of {args.decode_rounds} interleaved rounds)", flush=True)
    mx_runs: dict[str, tuple[str, tuple[float, float], tuple]] = {}  # results key -> (label, figures, mxfp8_params options)
    for key, (label, off, n_opts) in mx_offline.items():
        mx_runs[key] = (label, (off, b1[key]), n_opts)
        print(f"{label}: batch-1 decode {b1[key]:.2f} tok/s", flush=True)
    moe_ab: tuple[float, float] | None = None
    if args.moe_ab:
        from cuttle.attention import native

        os.environ["CUTTLE_MOE_NATIVE"] = "0"
        native.select()  # the kernel set is re-read: the routed experts take the torch path
        moe_ab = bench_cuttle(path, args.dtype, reqs, args.output_len, args.max_num_seqs)
        del os.environ["CUTTLE_MOE_NATIVE"]
        native.select()
        print(f"cuttle, torch expert path: offline {moe_ab[0]:.1f} out tok/s, batch-1 decode {moe_ab[1]:.2f} tok/s", flush=True)
    rows = []
    if args.skip_transformers:
        t_off = t_dec = float("nan")
    else:
        t_off, t_dec = bench_transformers(path, tdtype, reqs, args.output_len, args.hf_batch)
        print(f"transformers: offline {t_off:.1f} out tok/s, batch-1 decode {t_dec:.2f} tok/s", flush=True)
    # every output token costs its decode matmuls + lm_head; every prompt token its prefill matmuls
    lm_head = 2 * mc.vocab_size * mc.hidden_size
    flop_limit = flops * 1e9 / ((flop_per_token + lm_head) + flop_per_token * args.prompt_len / args.output_len)
    results: dict[str, dict] = {
        "cuttle": {"batch": args.max_num_seqs, "offline_tok_s": c_off, "decode_tok_s": c_dec},
        "transformers": {"batch": args.hf_batch, "offline_tok_s": t_off, "decode_tok_s": t_dec},
    }
    for key, (_, fig, n_opts) in mx_runs.items():
        n_mx = mxfp8_params(mc, *n_opts)
        results[key] = {"batch": args.max_num_seqs, "offline_tok_s": fig[0], "decode_tok_s": fig[1],
                        "quantization": n_opts[0], "moe_quant": n_opts[1], "quantize_lm_head": n_opts[2],
                        # bytes a decode token reads: MXFP8 params at 8.25 bits, the rest in the model dtype
                        "weight_bytes_per_param": (n_mx * 8.25 / 8 + (read_params - n_mx) * tdtype.itemsize) / read_params}
    if moe_ab is not None:
        results["cuttle-torch-experts"] = {"batch": args.max_num_seqs, "offline_tok_s": moe_ab[0], "decode_tok_s": moe_ab[1]}
    for name in results:
        if name in b1_rounds:
            results[name]["decode_tok_s_rounds"] = b1_rounds[name]
    for peer in peers:
        if peer in skipped:
            continue
        try:
            if peer == "vllm":
                r = bench_vllm(path, args.dtype, f.name, args.output_len, args.max_num_seqs, args.vllm_enforce_eager)
                r["batch"] = args.max_num_seqs
            else:  # llama.cpp: its rounds ran beside cuttle's batch-1 rounds
                r = {**peer_runs[peer], "decode_tok_s": b1[peer], "decode_tok_s_rounds": b1_rounds[peer], "batch": 1}
                if peer == "llamacpp-q8_0":
                    r["weight_bytes_per_param"] = Q8_0_BYTES_PER_PARAM
        except (PeerUnavailable, RuntimeError, subprocess.TimeoutExpired) as e:
            skipped[peer] = str(e)
            print(f"{peer}: skipped: {e}", flush=True)
            continue
        results[peer] = r
        off = "—" if r.get("offline_tok_s") is None else f"{r['offline_tok_s']:.1f}"
        print(f"{peer}: offline {off} out tok/s, batch-1 decode {r['decode_tok_s']:.2f} tok/s", flush=True)

    def ratio(x: float | None, y: float) -> float | None:
        return None if x is None or not math.isfinite(x) or not math.isfinite(y) or y == 0 else x / y

    def cell(x: float | None) -> float | str:
        return "—" if x is None else x

    shown = ("cuttle", *mx_runs, *(("cuttle-torch-experts",) if moe_ab is not None else ()),
             *(() if args.skip_transformers else ("transformers",)), *[p for p in PEERS if p in results])
    for name in shown:
        r = results[name]
        off, dec = r.get("offline_tok_s"), r["decode_tok_s"]
        own_bw_limit = bw * 1e9 / (read_params * r["weight_bytes_per_param"]) if "weight_bytes_per_param" in r else bw_limit
        r.update(offline_vs_transformers=ratio(off, t_off), offline_of_flop_limit=ratio(off, flop_limit),
                 decode_vs_transformers=ratio(dec, t_dec), decode_of_bandwidth_limit=ratio(dec, own_bw_limit))
        label = {**{k: v[0] for k, v in mx_runs.items()},
                 "cuttle-torch-experts": "cuttle, torch experts (CUTTLE_MOE_NATIVE=0)", "vllm": "vLLM (CPU)",
                 "llamacpp": "llama.cpp (bf16 GGUF)", "llamacpp-q8_0": "llama.cpp (Q8_0 GGUF)"}.get(name, name)
        rows.append([label, str(r["batch"]), cell(off), cell(r["offline_vs_transformers"]), cell(r["offline_of_flop_limit"]),
                     dec, cell(r["decode_vs_transformers"]), cell(r["decode_of_bandwidth_limit"])])
    print(f"\nmachine: {info}")
    print(f"model: {path} ({n_params / 1e6:.0f}M params, {read_params / 1e6:.0f}M read per decode token, {args.dtype}); "
          f"{args.num_requests} requests x ({args.prompt_len} prompt, {args.output_len} output)")
    print(f"measured limits: copy {bw:.1f} GB/s -> batch-1 bound {bw_limit:.1f} tok/s; {flops_src} {flops:.0f} GFLOP/s -> offline bound {flop_limit:.0f} output tok/s\n")
    print(markdown_table(
        ["engine", "batch", "offline out tok/s", "vs transformers", "of FLOP limit", "batch-1 decode tok/s", "vs transformers", "of bandwidth limit"],
        rows,
    ))
    for label, fig, _ in mx_runs.values():
        print(f"\n{label} vs cuttle {args.dtype}, same run: batch-1 decode {ratio(fig[1], c_dec):.2f}x, "
              f"offline {ratio(fig[0], c_off):.2f}x")
    for peer, why in skipped.items():
        print(f"\n{peer} not run: {why}")
    if args.json:
        doc = {"machine": info, "model": path, "model_preset": None if args.model else args.model_preset, "dtype": args.dtype,
               "params": n_params, "params_read_per_decode_token": read_params,
               "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
                            "max_num_seqs": args.max_num_seqs, "hf_batch": args.hf_batch, "decode_rounds": args.decode_rounds},
               "limits": {"copy_gb_s": bw, "matmul_gflop_s": flops, "matmul_limit_source": flops_src,
                          f"{args.dtype}_matmul_gflop_s": flops_dtype, "batch1_bound_tok_s": bw_limit, "offline_bound_tok_s": flop_limit},
               "engines": results, "skipped": skipped}
        with open(args.json, "w") as out:
            json.dump(_finite(doc), out, indent=1)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
