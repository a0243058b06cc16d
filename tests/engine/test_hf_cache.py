"""A Hugging Face repo id resolves from the local Hugging Face cache (a fake one built here, in
huggingface_hub's layout), never downloaded: HF_HUB_CACHE, HF_HOME/hub and XDG_CACHE_HOME, refs and
commit revisions, `LLM("org/name")` equal to loading the directory, `cuttle serve org/name` serving
the id; absent ids and incomplete snapshots are errors naming the id and the cache path."""
from __future__ import annotations

import os
import shutil

import pytest

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import EngineConfig
from cuttle.engine.hf_cache import hub_cache_dir, resolve_model
from helpers import make_checkpoint

REPO = "Qwen/Qwen2.5-Coder-Tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    p = str(tmp_path_factory.mktemp("hf_cache_src"))
    make_checkpoint(p, "qwen3", seed=4)
    return p


def fake_cache(root: str, checkpoint: str) -> str:
    """models--Qwen--Qwen2.5-Coder-Tiny with refs/main -> COMMIT and a second snapshot OLD (tag v0)."""
    repo = os.path.join(root, "models--Qwen--Qwen2.5-Coder-Tiny")
    for commit in (COMMIT, OLD):
        shutil.copytree(checkpoint, os.path.join(repo, "snapshots", commit))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(COMMIT)  # huggingface_hub writes the hash with no newline
    with open(os.path.join(repo, "refs", "v0"), "w") as f:
        f.write(OLD + "\n")
    return repo


@pytest.fixture()
def clean_env(monkeypatch):
    for var in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_cache_dir_follows_the_environment(clean_env, tmp_path):
    assert hub_cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "hub")
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == str(tmp_path / "xdg" / "huggingface" / "hub")
    clean_env.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == str(tmp_path / "home" / "hub")
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub_cache_dir() == str(tmp_path / "hub")


def test_repo_id_resolves_to_its_snapshot(clean_env, tmp_path, checkpoint):
    repo = fake_cache(str(tmp_path / "home" / "hub"), checkpoint)
    clean_env.setenv("HF_HOME", str(tmp_path / "home"))
    assert resolve_model(REPO) == os.path.join(repo, "snapshots", COMMIT)
    assert resolve_model(REPO, "v0") == os.path.join(repo, "snapshots", OLD)
    assert resolve_model(REPO, OLD) == os.path.join(repo, "snapshots", OLD)  # a commit without a ref
    assert EngineConfig(model=REPO).model == os.path.join(repo, "snapshots", COMMIT)
    assert resolve_model(checkpoint) == checkpoint  # a local directory is taken as it is
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    by_id = LLM(REPO, dtype="float32", num_kv_blocks=16).generate([[5, 6, 7]], params, use_tqdm=False)
    by_dir = LLM(checkpoint, dtype="float32", num_kv_blocks=16).generate([[5, 6, 7]], params, use_tqdm=False)
    assert by_id[0].outputs[0].token_ids == by_dir[0].outputs[0].token_ids


def test_absent_or_incomplete_is_a_clear_error(clean_env, tmp_path, checkpoint):
    cache = str(tmp_path / "hub")
    clean_env.setenv("HF_HUB_CACHE", cache)
    with pytest.raises(FileNotFoundError, match=rf"model 'Qwen/Absent' is not a local directory .* Hugging Face cache '{cache}'.*never downloads"):
        LLM("Qwen/Absent")
    repo = fake_cache(cache, checkpoint)
    with pytest.raises(FileNotFoundError, match="revision 'dev' of it is not in the Hugging Face cache"):
        resolve_model(REPO, "dev")
    os.remove(os.path.join(repo, "snapshots", COMMIT, "config.json"))
    with pytest.raises(FileNotFoundError, match=rf"resolves to commit {COMMIT} .* has no config.json"):
        resolve_model(REPO)
    with pytest.raises(ValueError, match="revision 'v0' is only meaningful for a Hugging Face repo id"):
        EngineConfig(model=checkpoint, revision="v0")


def test_cli_serve_serves_the_repo_id(clean_env, tmp_path, checkpoint):
    """`cuttle serve org/name`: the engine loads the snapshot and /v1/models names the id (as vLLM)."""
    from cuttle.engine import cli

    fake_cache(str(tmp_path / "hub"), checkpoint)
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    seen = {}

    class FakeServer:  # stands in for uvicorn's: ask the app what it serves, then return
        def __init__(self, config, on_first_signal):
            self.app = config.app

        def run(self):
            from fastapi.testclient import TestClient

            seen["models"] = TestClient(self.app).get("/v1/models").json()

    clean_env.setattr(cli, "_server", FakeServer)
    cli.main(["serve", REPO, "--dtype", "float32", "--num-kv-blocks", "16"])
    assert [m["id"] for m in seen["models"]["data"]] == [REPO]
