"""Makes the shared helpers beside these tests (attention_cases.py) importable under any pytest
import mode. Sets no environment: the Triton interpreter is switched on only inside the
subprocesses of test_attention_triton.py."""
from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
