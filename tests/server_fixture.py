"""A live cuttle server on loopback, in a background thread, for tests that use real clients."""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

import cuttle.engine.llm_engine as llm_engine

from cuttle.engine import LLM
from cuttle.engine.async_engine import AsyncEngine
from cuttle.engine.sampler import Logprob, SampleResult
from cuttle.engine.server import create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, model: str, name: str = "test-model", api_key: str | None = None, max_pending: int = 256,
                 app_kw: dict | None = None, **llm_kw):
        self.llm = LLM(model, **llm_kw)
        self.engine = AsyncEngine(self.llm.engine, max_pending=max_pending)
        self.app = create_app(self.engine, name, api_key, **(app_kw or {}))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("server did not come up")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def stats(self) -> dict:
        return self.llm.engine.stats()


def scripted_sampler(real, scripts: dict[int, list[int]]):
    """Wraps the engine's `sample`: a request whose seed is in `scripts` gets those ids, one a step
    (the last repeated), with logprob -0.25; every other row is sampled as usual."""

    def scripted(logits, rows, *rest):
        out = real(logits, rows, *rest)
        for k, r in enumerate(rows):
            ids = scripts.get(r.params.seed)
            if ids is not None:
                t = ids[min(r.step, len(ids) - 1)]
                out[k] = SampleResult(t, -0.25, {t: Logprob(-0.25, 1)} if r.params.logprobs is not None else None)
        return out

    return scripted


@contextmanager
def scripted_server(model: str, scripts: dict[int, str], **kw) -> Iterator[LiveServer]:
    """A LiveServer (`kw` its arguments) whose requests with a seed in `scripts` write that text,
    then EOS (`scripted_sampler`); the others sample as usual."""
    with pytest.MonkeyPatch.context() as mp, LiveServer(model, **kw) as srv:
        tok = srv.llm.engine.tokenizer
        ids = {seed: tok.encode(text, add_special_tokens=False) + [tok.eos_token_id] for seed, text in scripts.items()}
        mp.setattr(llm_engine, "sample", scripted_sampler(llm_engine.sample, ids))
        yield srv


def thinking_fixtures(name: str, scripts: dict[int, str], block_size: int = 4):
    """Module fixtures (checkpoint, live, thinking) of the routes tested against chat: a tiny Qwen3
    with a thinking template (`thinking_checkpoint`), served scripted (`scripted_server`), plain and
    under the qwen3 reasoning parser. A test module takes them as
    `checkpoint, live, thinking = thinking_fixtures("name", SCRIPTS)`."""
    from thinking_checkpoint import make_thinking_checkpoint

    kw = dict(dtype="float32", num_kv_blocks=512, block_size=block_size, max_model_len=2048)

    @pytest.fixture(scope="module")
    def checkpoint(tmp_path_factory):
        return make_thinking_checkpoint(str(tmp_path_factory.mktemp(name)))

    @pytest.fixture(scope="module")
    def live(checkpoint):
        with scripted_server(checkpoint, scripts, **kw) as srv:
            yield srv

    @pytest.fixture(scope="module")
    def thinking(checkpoint):
        with scripted_server(checkpoint, scripts, app_kw={"reasoning_parser": "qwen3"}, **kw) as srv:
            yield srv

    return checkpoint, live, thinking


def named_events(srv: LiveServer, path: str, body: dict) -> Iterator[dict]:
    """A streamed request's SSE events (`event: NAME` then `data: {...}`), each object checked to
    carry its event's name as `type` (the Responses and Messages APIs name every event)."""
    with httpx.stream("POST", srv.url + path, json={"model": "test-model", "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                obj = json.loads(line[6:])
                assert obj["type"] == name
                yield obj
