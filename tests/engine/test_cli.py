"""The `cuttle` CLI: help texts, `generate` streaming to the terminal, `serve` shutting down
gracefully on SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

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
    port = free_port()
    proc = subprocess.Popen(CUTTLE + ["serve", "--model", qwen3_path, "--port", str(port), "--dtype", "float32", "--num-kv-blocks", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "a b", "max_tokens": 3}, timeout=30)
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
