"""The `cuttle` CLI: help texts, `generate` streaming to the terminal, `serve` shutting down
gracefully on SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from server_fixture import free_port

CUTTLE = [sys.executable, "-m", "cuttle.engine.cli"]


def run(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(CUTTLE + args, capture_output=True, text=True, timeout=180, **kw)


def test_help_texts():
    for sub in ([], ["serve"], ["generate"], ["chat"]):
        r = run(sub + ["--help"])
        assert r.returncode == 0 and "usage: cuttle" in r.stdout
    assert "--api-key" in run(["serve", "--help"]).stdout


def test_generate_streams(qwen3_path):
    r = run(["generate", "a b c", "--model", qwen3_path, "--max-tokens", "6", "--temperature", "0", "--dtype", "float32"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("a b c") and len(r.stdout.split()) > 3


def test_serve_sigterm_is_graceful(qwen3_path):
    proc, url = _serve(qwen3_path, "--num-kv-blocks", "64")
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "a b", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["model"] == os.path.basename(qwen3_path)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_env_server_is_its_own_command():
    """`cuttle env-server` names the sandbox's own console script, which the package declares and
    which serves `--help` without the engine's CLI."""
    r = run(["env-server", "--port", "1"])
    assert r.returncode == 2 and "cuttle-env-server" in r.stderr and r.stdout == ""
    code = (
        "from importlib.metadata import entry_points\n"
        "(ep,) = [e for e in entry_points(group='console_scripts') if e.name == 'cuttle-env-server']\n"
        "assert ep.value == 'cuttle.sandbox.server:main', ep.value\n"
        "ep.load()(['--help'])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: cuttle-env-server") and "--allow-unisolated" in r.stdout


@pytest.mark.parametrize("flags,says", [
    (["--block-size", "0"], "--block-size must be"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--max-pending", "0"], "--max-pending must be >= 1"),
    (["--kv-cache-memory-gb", "-1"], "--kv-cache-memory-gb must be a finite number"),
    (["--kv-cache-memory-gb", "nan"], "--kv-cache-memory-gb must be a finite number"),
    (["--num-kv-blocks", "10000000000"], "--num-kv-blocks asks for"),
    (["--max-model-len", "64", "--num-kv-blocks", "1"], "--max-model-len (64) needs"),
    (["--attention-backend", "triton"], "needs the Triton interpreter"),
    (["--model", "/nonexistent-model-dir"], "has no config.json"),
])
def test_serve_refuses_a_bad_flag_in_one_line(qwen3_path, flags, says):
    """A bad engine flag ended in a traceback through the engine's constructors (or, for
    --kv-cache-memory-gb 0 / --max-pending 0 / --attention-backend triton on CPU, in a server that
    started and could serve nothing); --num-kv-blocks 1e10 ran for minutes towards out of memory."""
    args = ["serve", *flags] if "--model" in flags else ["serve", "--model", qwen3_path, *flags]
    t = time.time()
    r = run(args + ["--port", "0"] if "--port" not in flags else args)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("cuttle serve: ") and says in last, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and time.time() - t < 60


def test_generate_checks_sampling_flags_before_loading():
    r = run(["generate", "x", "--model", "/nonexistent-model-dir", "--temperature", "-1"])
    assert r.returncode == 2 and r.stderr.strip() == "cuttle generate: --temperature must be in [0.0, 100.0], got -1.0", r.stderr


def _serve(path: str, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(CUTTLE + ["serve", "--model", path, "--port", str(port), "--dtype", "float32", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("the server did not start")


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    from helpers import make_checkpoint

    path = str(tmp_path_factory.mktemp("qwen3_64k"))
    make_checkpoint(path, "qwen3", max_position_embeddings=1 << 16)
    return path


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_shutdown_ends_requests_in_flight_with_an_error_after_the_grace(long_model, sig):
    """A signal with requests in flight: they get --shutdown-timeout seconds, then a streamed one
    ends with an SSE error event saying why and a non-streamed one with a 503 in the OpenAI shape
    (the engine went on decoding for uvicorn's 30 s drain, then the streams were cut mid-body and
    the others got a text/plain 500); the process exits promptly."""
    import json
    import threading

    proc, url = _serve(long_model, "--num-kv-blocks", "4096", "--shutdown-timeout", "1")
    body = {"prompt": "a b", "max_tokens": 60000, "ignore_eos": True}
    plain: dict = {}
    t = threading.Thread(target=lambda: plain.update(r=httpx.post(url + "/v1/completions", json=body, timeout=60)))
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert "choices" in first
            t.start()
            time.sleep(0.3)
            t0 = time.time()
            proc.send_signal(sig)
            rest = [line for line in lines if line.startswith("data: ")]
        waited = time.time() - t0
        err = json.loads(rest[-1][6:])["error"]
        assert "shutting down" in err["message"] and err["type"] == "server_unavailable", rest[-1]
        assert "[DONE]" not in "".join(rest) and 0.9 < waited < 10, waited
        t.join(30)
        r = plain["r"]
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
        assert proc.wait(timeout=30) in (0, 130)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.stdout.read() if proc.stdout else ""
    assert "Traceback" not in out, out[-3000:]


def test_a_second_signal_exits_at_once(long_model):
    """During a 60 s grace a second SIGTERM ends the server at once (only a second SIGINT did)."""
    proc, url = _serve(long_model, "--num-kv-blocks", "4096", "--shutdown-timeout", "60")
    t0 = None
    try:
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "a b", "max_tokens": 60000, "ignore_eos": True, "stream": True},
                          timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            assert proc.poll() is None  # still in its grace, the stream still running
            t0 = time.time()
            proc.send_signal(signal.SIGTERM)
            for _ in lines:
                pass
    except httpx.HTTPError:
        pass  # the connection is cut: that is what a forced exit does
    finally:
        code = proc.wait(timeout=30) if t0 is not None else None
        if proc.poll() is None:
            proc.kill()
    assert code is not None and time.time() - t0 < 15
