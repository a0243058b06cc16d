"""The dependency direction of DESIGN.md, checked on the source: `rl` and `sandbox` may import
`engine`; `engine` imports `attention` and `moe`, never `rl` or `sandbox`; `attention` and `moe`
are kernel libraries that import no other cuttle package, except that `moe` may use the CPU
kernel library `cuttle.attention.native` (which itself needs nothing of `attention` but RoPE);
and `cuttle.engine` imports and runs without ray, fastapi or flashinfer installed.

Imports are read with `ast` from every module (function-level imports too, and
`importlib.import_module("...")` with a literal name), so a lazy import cannot hide an edge."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("engine", "attention", "moe", "rl", "sandbox")


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[: -len(".py")].split(os.sep)
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join(["cuttle", *rel])


def _imports(path: str) -> set[str]:
    """Every cuttle module `path` imports at run time, as absolute dotted names (`from a import b` gives `a.b`
    as well as `a`, since b may be a submodule)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    me = _module_name(path)
    package = me if path.endswith("__init__.py") else me.rpartition(".")[0]
    found: set[str] = set()
    # imports under `if TYPE_CHECKING:` are annotations only, never run: not a dependency
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
                   for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            found.add(node.args[0].value)
    return {name for name in found if name == "cuttle" or name.startswith("cuttle.")}


def _modules(folder: str) -> dict[str, set[str]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in filenames:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                out[os.path.relpath(path, ROOT)] = _imports(path)
    return out


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _violations(folder: str, allowed) -> list[str]:
    return [f"{path} imports {name}" for path, names in sorted(_modules(folder).items()) for name in sorted(names) if not allowed(path, name)]


def test_the_scan_sees_imports() -> None:
    """Guard: the scan finds the edges it is meant to police (else the tests below pass vacuously)."""
    engine = set().union(*_modules("engine").values())
    assert "cuttle.attention.native.gemm" in engine and "cuttle.moe" in engine
    assert "cuttle.engine" in set().union(*_modules("rl").values())
    assert "cuttle.attention.native" in _imports(os.path.join(ROOT, "attention", "native", "gemm.py"))


def test_engine_imports_neither_rl_nor_sandbox() -> None:
    assert _violations("engine", lambda path, name: not (_within(name, "cuttle.rl") or _within(name, "cuttle.sandbox"))) == []


@pytest.mark.parametrize("folder", ["attention", "moe"])
def test_kernel_libraries_import_no_engine_rl_or_sandbox(folder: str) -> None:
    def allowed(path: str, name: str) -> bool:
        if name == "cuttle" or _within(name, f"cuttle.{folder}"):
            return True
        # moe may use the CPU kernel library of attention/, nothing else of it
        return folder == "moe" and _within(name, "cuttle.attention.native")

    assert _violations(folder, allowed) == []


def test_cpu_kernel_library_stands_alone() -> None:
    """`cuttle.attention.native` is open to moe/, so it must not pull in the attention backends."""
    native = os.path.join("attention", "native")

    def allowed(path: str, name: str) -> bool:
        if not path.startswith(native + os.sep):
            return True
        return name == "cuttle" or name == "cuttle.attention" or _within(name, "cuttle.attention.native") or _within(name, "cuttle.attention.rope")

    assert _violations("attention", allowed) == []
    rope = _imports(os.path.join(ROOT, "attention", "rope.py"))
    assert rope == set(), rope


def test_engine_imports_and_runs_without_optional_stacks() -> None:
    """ray, fastapi and flashinfer blocked by a meta-path finder (their submodules too): the engine
    imports, its CLI module imports, and the embedded model generates."""
    code = (
        "import sys\n"
        "BLOCKED = ('ray', 'fastapi', 'flashinfer')\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ImportError(f'{name} is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import cuttle.engine, cuttle.engine.cli, cuttle.engine.async_engine\n"
        "from cuttle.engine import LLM, SamplingParams\n"
        "out = LLM(dtype='float32', num_kv_blocks=16).generate(['def f(x):'], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)\n"
        "assert len(out[0].outputs[0].token_ids) == 3\n"
        "leaked = sorted(m for m in sys.modules if m.split('.')[0] in BLOCKED)\n"
        "assert not leaked, leaked\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
