"""Resolves a Hugging Face repo id ("Qwen/Qwen2.5-Coder-0.5B") to its snapshot directory in the
local Hugging Face cache, the layout `huggingface_hub` writes:
`<cache>/models--<org>--<name>/refs/<revision>` holds a commit hash, and
`<cache>/models--<org>--<name>/snapshots/<hash>/` the files. The cache is `HF_HUB_CACHE`, else
`HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub` (default `~/.cache/huggingface/hub`).

Owns only that lookup. It never downloads and never imports huggingface_hub: a model that is not
in the cache is an error naming the id and the cache path looked in.
"""
from __future__ import annotations

import os
import re

# org/name as the Hub spells them (an existing local directory always wins over this reading)
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hub_cache_dir() -> str:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(home, "hub")


def is_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and ".." not in model and not os.path.exists(model)


def resolve_model(model: str, revision: str | None = None) -> str:
    """`model` itself if it is a local path (or not shaped like a repo id: the caller's own error
    names it then); else the cached snapshot directory of `revision` (a branch or tag under
    refs/, or a commit hash; default "main")."""
    if not is_repo_id(model):
        if revision is not None:
            raise ValueError(f"revision {revision!r} is only meaningful for a Hugging Face repo id, not the local path {model!r}")
        return model
    cache = hub_cache_dir()
    repo = os.path.join(cache, "models--" + model.replace("/", "--"))
    rev = revision or "main"
    ref = os.path.join(repo, "refs", rev)
    if os.path.isfile(ref):
        with open(ref) as f:
            commit = f.read().strip()
    elif _COMMIT.match(rev):
        commit = rev
    else:
        raise FileNotFoundError(
            f"model {model!r} is not a local directory and revision {rev!r} of it is not in the Hugging Face cache "
            f"{cache!r} (no {ref}); cuttle never downloads: fetch it first (e.g. `huggingface-cli download {model}`), "
            "set HF_HUB_CACHE / HF_HOME to the cache that holds it, or pass a local path"
        )
    snapshot = os.path.join(repo, "snapshots", commit)
    if not os.path.isfile(os.path.join(snapshot, "config.json")):
        raise FileNotFoundError(
            f"model {model!r} revision {rev!r} resolves to commit {commit} in the Hugging Face cache {cache!r}, "
            f"but {snapshot} has no config.json (an incomplete download?)"
        )
    return snapshot
