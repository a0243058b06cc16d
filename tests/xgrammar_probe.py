"""What the installed xgrammar compiles, for tests whose expectation follows its version (shared by
the engine and server structured-output tests)."""
from __future__ import annotations

import functools
import json

LONG_PATTERN = "(a|b)*" + "x" * 200 + "[a-z]{1,200}"


@functools.lru_cache(maxsize=None)
def xgrammar_compiles_long_pattern() -> bool:
    """Whether the installed xgrammar compiles LONG_PATTERN (0.2.8 fails a check of its own on it,
    0.2.9 compiles it), so the refusal of a schema that does not compile is checked where it fails
    and the schema is checked to be served where it compiles."""
    import xgrammar

    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo(["a", "b", "x", '"']))
    try:
        compiler.compile_json_schema(json.dumps({"type": "string", "pattern": LONG_PATTERN}))
    except RuntimeError:
        return False
    return True
