"""The `cuttle` command: serve, generate, chat.

Owns argument parsing and wiring only. `serve` runs the OpenAI server on the embedded default
model unless a model is given (`cuttle serve MODEL` as in vLLM, or --model); `generate` streams
one completion to the terminal; `chat` is an interactive loop over the chat template. Heavy
imports happen inside the subcommands, so `cuttle --help` is instant. The environment server is
the sandbox's own command, `cuttle-env-server`: the engine never imports `cuttle.sandbox`.
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import sys
from collections.abc import Callable
from typing import Any, NoReturn

DEFAULT_MODEL_NAME = "cuttle-tiny-coder"


def _engine_args(p: argparse.ArgumentParser) -> None:
    # No defaults here: an option left out is not passed on, so `EngineConfig` stays the one
    # source of engine defaults.
    g = p.add_argument_group("engine (defaults: EngineConfig's)")
    g.add_argument("--model", default=None, help="HF checkpoint directory, or a Hugging Face repo id in the local HF cache (default: the embedded tiny coding model)")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--block-size", type=int, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, help="KV pool size in blocks (default: from --kv-cache-memory-gb)")
    g.add_argument("--kv-cache-memory-gb", type=float)
    g.add_argument("--max-num-batched-tokens", type=int, help="token budget of one engine step")
    g.add_argument("--max-num-seqs", type=int, help="sequences running at once (a request's n samples count n)")
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"],
                   help="fcfs (default): arrival order; priority: by each request's priority, lower first (vLLM's)")
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action=argparse.BooleanOptionalAction,
                   default=None, help="reuse the KV of shared prompt prefixes (default: on)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_const", const=False,
                   help="the same as --no-enable-prefix-caching")
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton", "flashinfer"])
    g.add_argument("--seed", type=int)
    g.add_argument("--moe-quant", choices=["mxfp8"], help="quantize MoE expert weights at load")
    g.add_argument("--quantization", choices=["mxfp8"], help="quantize every attention / dense-MLP linear and the routed experts at load")
    g.add_argument("--quantize-lm-head", action="store_true", default=None,
                   help="with --quantization mxfp8: the lm_head too (a tied one gets an MXFP8 copy beside the embedding)")
    g.add_argument("--squid-positions", choices=["shared", "concat"], help="where cached documents sit (docs/squid.md; default: the model's, else concat)")
    g.add_argument("--max-documents", type=int, help="documents one request may carry")
    g.add_argument("--max-sessions", type=int,
                   help="engine sessions open at once (each live beam of a use_beam_search request holds one; "
                        "where none is left, beam search runs as one-token requests)")
    g.add_argument("--max-session-kv-blocks", type=int, help="KV blocks sessions may pin (default: half the pool)")
    g.add_argument("--sparse-attention", help="training-free top-k attention, e.g. 'topk:budget=2048,block=64,dense_layers=2,summary=quest' (docs/nsa.md)")
    g.add_argument("--kv-offloading-size", type=float, help="GiB of host memory for the KV host tier under the device pool (docs/kv_tiers.md; default 0: off)")
    g.add_argument("--num-host-kv-blocks", type=int, help="host tier size in blocks (instead of --kv-offloading-size)")
    g.add_argument("--kv-cache-dir", help="directory of the disk KV tier under the host tier; survives restarts")
    g.add_argument("--kv-cache-dir-gb", type=float, help="size bound of --kv-cache-dir in GiB")
    # vLLM's flags (docs/server.md, "vLLM compatibility")
    g.add_argument("--revision", help="of a Hugging Face repo id MODEL: a branch, tag or commit in the local HF cache")
    g.add_argument("--tokenizer", help="tokenizer directory or repo id (default: the model's)")
    g.add_argument("--gpu-memory-utilization", type=float,
                   help="KV pool = this fraction of free device memory (CPU: available RAM) less the weights (instead of --kv-cache-memory-gb)")
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="run every step eagerly (no replayed kernel graphs for CPU decode steps)")
    g.add_argument("--cpu-graph-max-batch", type=int,
                   help="CPU decode steps of up to this many sequences replay recorded kernel calls (default 8; 0: never)")
    g.add_argument("--cpu-graph-hot-batches", type=int,
                   help="besides those, this many larger decode batch sizes get a kernel graph once they recur "
                        "(least recently used dropped; default 4; 0: none)")
    g.add_argument("--generation-config", help="'auto' (default): sampling defaults from the model's generation_config.json; "
                                               "'vllm': ignore it; or a directory holding one")
    g.add_argument("--kv-read-in-place", choices=["auto", "never", "always"],
                   help="host-tier hits: read where they are or copy in (default auto: the cost model chooses)")
    g.add_argument("--speculative-config", type=_json_dict, metavar="JSON",
                   help='speculative decoding by prompt lookup, vLLM\'s JSON: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2, '
                        '"disable_by_batch_size": 4}\' (the last: no drafts in steps of more running sequences; '
                        'default 4, null: never; vLLM\'s default is never)')
    g.add_argument("--enable-sleep-mode", action="store_true", default=None,
                   help="allow POST /sleep and /wake_up: an idle engine gives its KV cache's memory back to a colocated "
                        "trainer (docs/server.md, 'Sleep mode')")
    g.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters beside the base model (--lora-modules; docs/server.md, 'LoRA adapters')")
    g.add_argument("--max-loras", type=int, help="LoRA adapters kept loaded at once (least recently used dropped; default 8)")
    g.add_argument("--max-lora-rank", type=int, help="the largest adapter rank accepted (default 16)")
    g.add_argument("--batch-invariant", action="store_true", default=None,
                   help="each request's tokens and logprobs independent of what else runs beside it, of prompt "
                        "chunking and of preemption (CPU kernels; docs/architecture.md, 'Batch invariance')")


_ENGINE_OPTIONS = ("dtype", "block_size", "num_kv_blocks", "kv_cache_memory_gb", "max_num_batched_tokens", "max_num_seqs",
                   "max_model_len", "enable_prefix_caching", "attention_backend", "seed", "moe_quant", "quantization", "quantize_lm_head", "squid_positions",
                   "max_documents", "kv_offloading_size", "num_host_kv_blocks", "kv_cache_dir", "kv_cache_dir_gb", "kv_read_in_place",
                   "sparse_attention")
_ENGINE_OPTIONS += ("revision", "tokenizer", "gpu_memory_utilization", "enforce_eager", "cpu_graph_max_batch", "cpu_graph_hot_batches",
                   "generation_config", "batch_invariant", "speculative_config", "scheduling_policy", "enable_sleep_mode",
                   "max_sessions", "max_session_kv_blocks", "enable_lora", "max_loras", "max_lora_rank")


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules entry: 'name=path', or vLLM's JSON {"name": ..., "path": ...}."""
    if text.lstrip().startswith("{"):
        value = _json_dict(text)
        name, path = value.get("name"), value.get("path")
        extra = sorted(set(value) - {"name", "path", "base_model_name"})
        if extra:
            raise argparse.ArgumentTypeError(f"unknown fields {extra} (name, path, base_model_name)")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"must be name=path or a JSON object, got {text!r}")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise argparse.ArgumentTypeError(f"needs a non-empty name and path, got {text!r}")
    return name, path


def _build_llm(args: argparse.Namespace):
    from cuttle.engine import LLM

    given = {k: getattr(args, k) for k in _ENGINE_OPTIONS if getattr(args, k) is not None}
    return LLM(model=args.model, **given)


# the fields whose errors start with their name, as the flags that set them
_ENGINE_FLAGS = {name: "--" + name.replace("_", "-") for name in _ENGINE_OPTIONS}
_SAMPLING_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
                   "seed": "--sample-seed"}


def _refuse(cmd: str, msg: str) -> NoReturn:
    """Exit 2 with one line, as argparse does for its own checks (a bad engine option used to end
    in a traceback through the engine's constructors)."""
    sys.stderr.write(f"cuttle {cmd}: {msg}\n")
    sys.exit(2)


def _built(cmd: str, build: Callable[[], Any], flags: dict[str, str] = _ENGINE_FLAGS) -> Any:
    """`build()` (the engine, or the sampling parameters, from the flags), with the errors a flag
    causes refused as one line; a message that starts with a field's name (EngineConfig's and
    SamplingParams' do) names its flag instead (block_size -> --block-size)."""
    try:
        return build()
    except (ValueError, FileNotFoundError, NotImplementedError, OverflowError) as e:
        msg = str(e).strip()
        m = re.match(r"[a-z_]+(?![\w.\[])", msg)
        if m and m.group(0) in flags:
            msg = flags[m.group(0)] + msg[m.end():]
        _refuse(cmd, msg)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sample-seed", type=int, default=None, help="seed of this request's sampling")


def cmd_serve(args: argparse.Namespace) -> None:
    import logging
    import os

    import uvicorn

    from cuttle.engine.async_engine import AsyncEngine
    from cuttle.engine.server import create_app
    from cuttle.engine.server.chat_prompt import load_chat_template
    from cuttle.engine.server.lora_routes import runtime_updating_from_env

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            sys.exit(f"cuttle serve: the model is given twice ({args.model_tag!r} and --model {args.model!r})")
        args.model = args.model_tag
    try:
        chat_template = load_chat_template(args.chat_template)
    except ValueError as e:
        sys.exit(f"cuttle serve: {e}")
    if not 0 <= args.port <= 65535:  # checked before the model loads (bind() failed after it)
        _refuse("serve", f"--port must be in [0, 65535], got {args.port}")
    if not (args.shutdown_timeout >= 0 and args.shutdown_timeout < float("inf")):
        _refuse("serve", f"--shutdown-timeout must be a finite number of seconds >= 0, got {args.shutdown_timeout}")
    if args.max_pending < 1:  # 0 served /health and answered every request 503, forever
        _refuse("serve", f"--max-pending must be >= 1 (requests in flight before a 503), got {args.max_pending}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # built on the engine thread, which then steps it: one thread does all the OpenMP work
    aeng = _built("serve", lambda: AsyncEngine.launch(lambda: _build_llm(args).engine, max_pending=args.max_pending))
    from cuttle.engine.hf_cache import is_repo_id

    # a repo id is served under its own name, as vLLM does; a directory under its folder's name
    name = args.served_model_name or (DEFAULT_MODEL_NAME if args.model is None else
                                      args.model if is_repo_id(args.model) else os.path.basename(os.path.normpath(args.model)))
    try:
        app = create_app(aeng, name, args.api_key, args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                         chat_template=chat_template, trust_request_chat_template=args.trust_request_chat_template,
                         enable_auto_tool_choice=args.enable_auto_tool_choice,
                         return_tokens_as_token_ids=args.return_tokens_as_token_ids, lora_modules=dict(args.lora_modules or []),
                         allow_runtime_lora_updating=args.allow_runtime_lora_updating or runtime_updating_from_env())
    except ValueError as e:
        aeng.shutdown()
        _refuse("serve", str(e))
    print(f"cuttle: serving {name!r} on http://{args.host}:{args.port}/v1 (max_model_len {aeng.engine.max_model_len})", flush=True)
    # uvicorn drains connections and runs the shutdown hooks on SIGTERM, then re-raises the signal
    # under the handler that was installed before it; this one turns that into a clean exit 0.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    grace = args.shutdown_timeout
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=grace + 10)  # a backstop: the engine ends its requests at `grace`
    try:
        _server(config, lambda: aeng.begin_shutdown(grace)).run()
    except KeyboardInterrupt:  # Ctrl-C, re-raised by uvicorn once it has shut down
        sys.exit(130)


def _server(config: Any, on_first_signal: Callable[[], None]) -> Any:
    """uvicorn's server with the shutdown cuttle wants: the first SIGTERM / SIGINT stops new
    requests and starts the grace period for the ones in flight (`AsyncEngine.begin_shutdown`);
    a second signal of either kind exits at once (uvicorn forces its exit only on a second SIGINT).
    Defined here because uvicorn is imported only by `serve`."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit:
                self.force_exit = True
            else:
                on_first_signal()
            super().handle_exit(sig, frame)

    return Server(config)


def _params(args: argparse.Namespace):
    from cuttle.engine import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sample_seed)


def _stream(llm: Any, prompt: str | list[int], params: Any) -> str:
    engine = llm.engine
    rid = f"cli-{id(params)}-{len(engine.requests)}"
    engine.add_request(rid, prompt, params, stream=True)
    shown = 0
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
    return text


def cmd_generate(args: argparse.Namespace) -> None:
    params = _built("generate", lambda: _params(args), _SAMPLING_FLAGS)  # before the model loads
    llm = _built("generate", lambda: _build_llm(args))
    sys.stdout.write(args.prompt)
    _stream(llm, args.prompt, params)
    sys.stdout.write("\n")


def cmd_chat(args: argparse.Namespace) -> None:
    params = _built("chat", lambda: _params(args), _SAMPLING_FLAGS)  # before the model loads
    llm = _built("chat", lambda: _build_llm(args))
    tok = llm.get_tokenizer()
    messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    print("cuttle chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        sys.stdout.write("assistant> ")
        reply = _stream(llm, tok.encode_chat(messages), params)
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="cuttle", description="cuttle: a paged-KV LLM engine for coding models with RL sampling built in")
    sub = ap.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="serve a model over the OpenAI API", description="OpenAI-compatible server (completions, chat, tools, metrics)")
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="HF checkpoint directory or repo id (the same as --model)")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    s.add_argument("--served-model-name", default=None, help=f"model id clients must use (default: {DEFAULT_MODEL_NAME} for the embedded model, else the checkpoint's folder name)")
    s.add_argument("--tool-call-parser", default=None, help="default: chosen from the chat template",
                   choices=["hermes", "qwen3_coder", "seed_oss", "glm45", "deepseek_v3", "deepseek_v31", "minimax_m2", "mistral",
                            "granite", "llama3_json", "kimi_k2", "openai"])
    s.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=True,
                   help="tool_choice 'auto' parses the model's tool calls (default: on; vLLM needs this flag for it, cuttle "
                        "accepts it so vLLM command lines work; --no-enable-auto-tool-choice refuses 'auto' with a 400)")
    s.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name tokens 'token_id:N' instead of their text (vLLM's flag; the request field "
                        "return_tokens_as_token_ids overrides it per request)")
    s.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1", "glm45", "seed_oss", "gpt_oss"],
                   help="split <think>...</think> out of chat replies as reasoning_content (default: none; gpt_oss, "
                        "gpt-oss's harmony analysis channel, is the default for a harmony chat template)")
    s.add_argument("--chat-template", default=None,
                   help="a Jinja chat template used instead of the checkpoint's: a file path, or the template inline")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests carry their own chat_template (refused otherwise)")
    s.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                   help="LoRA adapters to serve (with --enable-lora), each 'name=path' or vLLM's JSON "
                        "'{\"name\": ..., \"path\": ...}': a request's model field picks one by name")
    s.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true does the same)")
    s.add_argument("--max-pending", type=int, default=256, help="requests in flight before new ones get 503")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds requests in flight get to finish after SIGTERM / SIGINT (new ones get 503); then they end "
                        "with an error saying why (0: at once). A second signal exits at once")

    g = sub.add_parser("generate", help="stream one completion to the terminal", description="Complete PROMPT and stream the text")
    g.add_argument("prompt")
    _engine_args(g)
    _sampling_args(g)

    c = sub.add_parser("chat", help="interactive chat in the terminal", description="Chat through the model's chat template")
    _engine_args(c)
    _sampling_args(c)
    c.add_argument("--system", default=None, help="system prompt")

    if (sys.argv[1:] if argv is None else argv)[:1] == ["env-server"]:
        ap.exit(2, f"{ap.prog}: the environment server is its own command now: cuttle-env-server [--help]\n")

    args = ap.parse_args(argv)
    {"serve": cmd_serve, "generate": cmd_generate, "chat": cmd_chat}[args.cmd](args)


if __name__ == "__main__":
    main()
