"""Where the embedded default model lives: shipped inside the package (`cuttle/engine/default_model/`)."""
from __future__ import annotations

import os

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(__file__), "default_model")


def default_model_path() -> str:
    if not os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, "config.json")):
        raise FileNotFoundError(
            f"the embedded default model is not present at {DEFAULT_MODEL_DIR}; pass model=PATH "
            "(an HF checkpoint directory) or build it with `python -m cuttle.engine.train_default_model`"
        )
    return DEFAULT_MODEL_DIR
