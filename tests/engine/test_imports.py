"""`cuttle.engine` must import without the optional stacks (ray, fastapi, flashinfer, triton)."""
from __future__ import annotations

import subprocess
import sys


def test_engine_imports_without_optional_packages():
    code = (
        "import sys\n"
        "for m in ('ray', 'fastapi', 'uvicorn', 'flashinfer', 'triton', 'prometheus_client', 'transformers'):\n"
        "    sys.modules[m] = None  # any import of it now fails\n"
        "import cuttle.engine, cuttle.attention, cuttle.moe\n"
        "from cuttle.engine import LLM, SamplingParams\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
