"""Beam search (engine/beam_search.py) against vLLM's, on the same checkpoint and token-id prompts:
`P` prompts, width `W`, `T` tokens, `ignore_eos`. Each engine also decodes the same prompts greedily
in one batch for the same `T` tokens, in the same process: beam search's cost is reported as a
multiple of that (a width-W search reads the weights once a step for all its beams, like a batch).
cuttle runs each live beam as an engine session (one token a beam a step); vLLM re-admits each
step as W x P one-token requests with their whole prefix. cuttle's server (`use_beam_search` on
/v1/completions, `cuttle serve` in its own process) is timed twice: with sessions, and with its
fallback where the session limit leaves no room (one-token requests, as vLLM's).
Columns: seconds for the greedy batch and the beam search, their ratio, and how many prompts'
best beams are the same tokens in both engines (bf16: rounding can reorder near-tied beams).

    python benchmarks/beam_search.py [--model-preset qwen3-0.6b] [--prompts 4] [--prompt-len 64] [--width 4] [--output-len 32]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, markdown_table, preset_checkpoint  # noqa: E402
from peers.servers import peer_python  # noqa: E402


def run_cuttle(ckpt: str, prompts: list[list[int]], width: int, out_len: int) -> dict:
    from cuttle.engine import LLM, BeamSearchParams, SamplingParams

    llm = LLM(ckpt, dtype="bfloat16", max_model_len=max(map(len, prompts)) + out_len + 16, max_num_seqs=64)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    llm.beam_search(prompts[:1], BeamSearchParams(beam_width=width, max_tokens=2, ignore_eos=True))
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True), use_tqdm=False)
    greedy_s = time.perf_counter() - t
    t = time.perf_counter()
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=out_len, ignore_eos=True))
    beam_s = time.perf_counter() - t
    beams = [o.sequences[0].tokens[len(p):] for o, p in zip(outs, prompts)]
    del llm  # (the servers below load their own)
    served = [{"engine": f"cuttle server ({how})", "greedy_s": greedy_s, **run_served(ckpt, prompts, width, out_len, sessions)}
              for sessions, how in [(True, "sessions"), (False, "one-token requests")]]
    for r in served:
        if r.pop("beams") != beams:  # the same engine and kernels: the same beams
            raise RuntimeError(f"{r['engine']}: its best beams differ from the offline search's")
    return [{"engine": "cuttle", "greedy_s": greedy_s, "beam_s": beam_s, "beams": beams}, *served]


def run_served(ckpt: str, prompts: list[list[int]], width: int, out_len: int, sessions: bool) -> dict:
    """`use_beam_search` over HTTP against `cuttle serve` on the checkpoint (its own process, bf16);
    without `sessions` it runs with --max-sessions 0, so the server takes its one-token-request driver."""
    import httpx

    from peers.servers import free_port, launch

    opts = {"max_model_len": max(map(len, prompts)) + out_len + 16, "max_num_seqs": 64}
    with launch("cuttle", ckpt, free_port(), name="bench", max_sessions=None if sessions else 0, **opts) as (base, name):
        def search(tokens: int) -> httpx.Response:
            body = {"model": name, "prompt": prompts, "use_beam_search": True, "n": width, "max_tokens": tokens,
                    "ignore_eos": True, "return_token_ids": True}
            r = httpx.post(f"{base}/completions", json=body, timeout=3600)
            r.raise_for_status()
            return r

        search(2)  # warm-up
        t = time.perf_counter()
        choices = search(out_len).json()["choices"]
        beam_s = time.perf_counter() - t
    return {"beam_s": beam_s, "beams": [choices[i * width]["token_ids"] for i in range(len(prompts))]}


def run_vllm(ckpt: str, prompts: list[list[int]], width: int, out_len: int) -> dict | None:
    py = peer_python("vllm")
    if py is None:
        print("vLLM peer not installed (bash benchmarks/peers/setup.sh): cuttle only", file=sys.stderr)
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}"),
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    here = os.path.dirname(os.path.abspath(__file__))
    t = time.perf_counter()
    r = subprocess.run([py, os.path.join(here, "peers", "vllm_beam_search.py"), "--model", ckpt, "--prompts", f.name,
                        "--width", str(width), "--output-len", str(out_len)], capture_output=True, text=True, env=env)
    print(f"vLLM subprocess: {time.perf_counter() - t:.0f} s in all (start-up and compile included)", flush=True)
    os.unlink(f.name)
    if r.returncode != 0:
        print(r.stderr[-3000:], file=sys.stderr)
        raise RuntimeError("vLLM beam search failed")
    return json.loads(next(line for line in reversed(r.stdout.splitlines()) if line.startswith('{"engine"')))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-preset", default="qwen3-0.6b")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ckpt = preset_checkpoint(args.model_preset)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 20000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    results = run_cuttle(ckpt, prompts, args.width, args.output_len)
    for r in results:
        print(f"{r['engine']}: greedy {r['greedy_s']:.2f} s, beam search {r['beam_s']:.2f} s", flush=True)
    same = None
    if not args.no_peer:
        peer = run_vllm(ckpt, prompts, args.width, args.output_len)
        if peer is not None:
            results.append(peer)
            same = sum(a == b for a, b in zip(results[0]["beams"], peer["beams"]))
    rows = [[r["engine"], f"{r['greedy_s']:.2f}", f"{r['beam_s']:.2f}", f"{r['beam_s'] / r['greedy_s']:.2f}"] for r in results]
    print(f"{machine_info()}\npreset {args.model_preset}, {args.prompts} prompts x {args.prompt_len} tokens, width {args.width}, "
          f"{args.output_len} tokens, bf16" + ("" if same is None else f"; best beams equal in both engines: {same} of {args.prompts}"))
    print(markdown_table(["engine", "greedy batch s", "beam search s", "beam / greedy"], rows))
    if args.json:
        print(json.dumps({"results": [{k: v for k, v in r.items() if k != "beams"} for r in results], "same_best": same}))


if __name__ == "__main__":
    main()
