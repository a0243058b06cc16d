#!/usr/bin/env bash
# One command for the peer engines: .peers/vllm, .peers/llamacpp, bf16 GGUFs of the benchmark
# checkpoints. Idempotent; see setup.py for the steps and options (--only STEP, --convert CKPT_DIR).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
py="${CUTTLE_PYTHON:-$root/.venv/bin/python}"
if [ ! -x "$py" ]; then
    echo "[peers] no $py: create the repo's venv first (python3.11 -m venv .venv && .venv/bin/pip install -e .), or set CUTTLE_PYTHON" >&2
    exit 1
fi
exec "$py" "$root/benchmarks/peers/setup.py" "$@"
