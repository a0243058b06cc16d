"""Seeded small-repository tasks: a Python package with tests and one injected mutation bug.

Owns the function templates, the mutation operators (comparison, arithmetic, boolean, integer
constant) and building a `Task` from a seed: same seed, same repository, same bug. A mutation is
kept only if it changes the function's result on at least one test case, checked here by running
our own template code (bounded loops only, so mutants always terminate). Visible tests include a
failing case so the agent can reproduce the bug; hidden tests hold every case of every function.
Must never evaluate code other than these templates in-process.
"""
import ast
import random
import textwrap
from dataclasses import dataclass
from typing import Any

from ..testing import pytest_command
from .base import Task


@dataclass(frozen=True, slots=True)
class Template:
    module: str
    source: str
    cases: tuple[tuple[tuple[Any, ...], Any], ...]  # (args, expected)

    @property
    def name(self) -> str:
        return self.source.split("(", 1)[0].removeprefix("def ").strip()


def _t(module: str, source: str, *cases: tuple[tuple[Any, ...], Any]) -> Template:
    return Template(module, textwrap.dedent(source).strip() + "\n", cases)


TEMPLATES: tuple[Template, ...] = (
    _t("mathx", """
        def clamp(x, lo, hi):
            if x < lo:
                return lo
            if x > hi:
                return hi
            return x
        """, ((5, 0, 10), 5), ((-3, 0, 10), 0), ((12, 0, 10), 10), ((0, 0, 10), 0), ((10, 0, 10), 10)),
    _t("mathx", """
        def triangle(n):
            total = 0
            for i in range(1, n + 1):
                total += i
            return total
        """, ((0,), 0), ((1,), 1), ((4,), 10), ((10,), 55)),
    _t("mathx", """
        def is_leap(year):
            return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
        """, ((2000,), True), ((1900,), False), ((2024,), True), ((2023,), False), ((2100,), False)),
    _t("mathx", """
        def sign(x):
            if x > 0:
                return 1
            if x < 0:
                return -1
            return 0
        """, ((5,), 1), ((-2,), -1), ((0,), 0)),
    _t("mathx", """
        def mean(xs):
            if len(xs) == 0:
                return 0.0
            return sum(xs) / len(xs)
        """, (([1, 2, 3],), 2.0), (([],), 0.0), (([4],), 4.0), (([1, 2],), 1.5)),
    _t("textx", """
        def count_vowels(s):
            return sum(1 for c in s.lower() if c in "aeiou")
        """, (("hello",), 2), (("AEIOU",), 5), (("xyz",), 0), (("",), 0)),
    _t("textx", """
        def is_palindrome(s):
            cleaned = [c.lower() for c in s if c.isalnum()]
            return cleaned == cleaned[::-1]
        """, (("Racecar",), True), (("A man, a plan, a canal: Panama",), True), (("abc",), False), (("",), True)),
    _t("textx", """
        def truncate(s, width):
            if len(s) <= width:
                return s
            return s[: width - 3] + "..."
        """, (("hello", 10), "hello"), (("hello world", 8), "hello..."), (("abcdef", 6), "abcdef"),
        (("abcdefg", 6), "abc...")),
    _t("textx", """
        def initials(name):
            return "".join(part[0].upper() for part in name.split() if part)
        """, (("ada lovelace",), "AL"), (("grace brewster hopper",), "GBH"), (("",), "")),
    _t("seqs", """
        def chunk(xs, size):
            return [xs[i : i + size] for i in range(0, len(xs), size)]
        """, (([1, 2, 3, 4, 5], 2), [[1, 2], [3, 4], [5]]), (([], 3), []), (([1, 2, 3], 3), [[1, 2, 3]])),
    _t("seqs", """
        def second_largest(xs):
            uniq = sorted(set(xs))
            if len(uniq) < 2:
                return None
            return uniq[-2]
        """, (([1, 5, 3],), 3), (([2, 2],), None), (([7, 7, 1],), 1), (([4, 9, 9, 6],), 6)),
    _t("seqs", """
        def count_greater(xs, t):
            return sum(1 for x in xs if x > t)
        """, (([1, 5, 3], 2), 2), (([], 0), 0), (([2, 2, 3], 2), 1)),
    _t("seqs", """
        def dedupe(xs):
            seen = set()
            out = []
            for x in xs:
                if x not in seen:
                    seen.add(x)
                    out.append(x)
            return out
        """, (([3, 1, 3, 2, 1],), [3, 1, 2]), (([],), []), (([1, 1, 1],), [1])),
    _t("seqs", """
        def rotate(xs, k):
            if not xs:
                return []
            k = k % len(xs)
            return xs[k:] + xs[:k]
        """, (([1, 2, 3, 4], 1), [2, 3, 4, 1]), (([1, 2, 3], 0), [1, 2, 3]), (([1, 2, 3], 4), [2, 3, 1]),
        (([], 2), [])),
)
PACKAGES = ("toolbox", "utilkit", "handy", "corelib", "minikit", "bitsy", "pyhelpers", "odds")
COMPARE_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
                ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In}
BINOP_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.Div: ast.Mult, ast.Mod: ast.FloorDiv}
BOOL_SWAP = {ast.And: ast.Or, ast.Or: ast.And}


def _sites(tree: ast.AST) -> list[tuple[ast.AST, str, int]]:
    """(node, kind, index) for every place one mutation operator applies."""
    out: list[tuple[ast.AST, str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            out += [(node, "compare", i) for i, op in enumerate(node.ops) if type(op) in COMPARE_SWAP]
        elif isinstance(node, ast.BinOp) and type(node.op) in BINOP_SWAP:
            out.append((node, "binop", 0))
        elif isinstance(node, ast.BoolOp):
            out.append((node, "boolop", 0))
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            out.append((node, "constant", 0))
    return out


def _mutate(source: str, site_index: int) -> tuple[str, str]:
    """Apply the `site_index`-th mutation to a fresh parse; returns (source, description)."""
    tree = ast.parse(source)
    node, kind, i = _sites(tree)[site_index]
    line = getattr(node, "lineno", 0)
    if kind == "compare":
        old = node.ops[i]
        node.ops[i] = COMPARE_SWAP[type(old)]()
        desc = f"{type(old).__name__} -> {type(node.ops[i]).__name__}"
    elif kind == "binop":
        old = node.op
        node.op = BINOP_SWAP[type(old)]()
        desc = f"{type(old).__name__} -> {type(node.op).__name__}"
    elif kind == "boolop":
        old = node.op
        node.op = BOOL_SWAP[type(old)]()
        desc = f"{type(old).__name__} -> {type(node.op).__name__}"
    else:
        desc = f"constant {node.value} -> {node.value + 1}"
        node.value += 1
    return ast.unparse(tree) + "\n", f"{desc} at line {line}"


def _call(source: str, name: str, args: tuple[Any, ...]) -> tuple[bool, Any]:
    scope: dict[str, Any] = {}
    exec(compile(source, f"<template {name}>", "exec"), scope)  # noqa: S102 - our own templates only
    try:
        return True, scope[name](*args)
    except Exception as err:  # noqa: BLE001 - a mutant that raises is a detected mutant
        return False, type(err).__name__


def _test_module(package: str, module: str, templates: list[Template]) -> str:
    lines = [f"from {package}.{module} import {', '.join(t.name for t in templates)}", ""]
    for t in templates:
        for n, (args, expected) in enumerate(t.cases):
            call = f"{t.name}({', '.join(repr(a) for a in args)})"
            lines += ["", f"def test_{t.name}_{n}():", f"    assert {call} == {expected!r}", ""]
    return "\n".join(lines).rstrip() + "\n"


def synthetic_task(seed: int, timeout: float = 30.0) -> Task:
    rng = random.Random(seed)
    package = rng.choice(PACKAGES)
    modules = sorted({t.module for t in TEMPLATES})
    chosen: dict[str, list[Template]] = {}
    for module in modules:
        pool = [t for t in TEMPLATES if t.module == module]
        chosen[module] = sorted(rng.sample(pool, rng.randint(2, min(3, len(pool)))), key=lambda t: t.name)
    candidates = [t for ts in chosen.values() for t in ts]
    rng.shuffle(candidates)
    for target in candidates:
        source = ast.unparse(ast.parse(target.source)) + "\n"
        sites = list(range(len(_sites(ast.parse(source)))))
        rng.shuffle(sites)
        for site in sites:
            mutant, desc = _mutate(source, site)
            for args, expected in target.cases:
                got = _call(mutant, target.name, args)
                if got != (True, expected):  # detected: this case is the bug report's witness
                    return _build(seed, package, chosen, target, mutant, desc, (args, expected, got), timeout)
    raise RuntimeError(f"seed {seed}: no detectable mutation found")  # unreachable with these templates


def _build(seed: int, package: str, chosen: dict[str, list[Template]], target: Template, mutant: str,
           desc: str, witness: tuple[tuple[Any, ...], Any, tuple[bool, Any]], timeout: float) -> Task:
    files: dict[str, str] = {f"{package}/__init__.py": f'"""{package}: small helpers."""\n'}
    hidden: dict[str, str] = {}
    for module, templates in chosen.items():
        sources = [mutant if t is target else ast.unparse(ast.parse(t.source)) + "\n" for t in templates]
        files[f"{package}/{module}.py"] = f'"""{package}.{module}."""\n\n\n' + "\n\n".join(sources)
        hidden[f"_hidden_tests/test_{module}.py"] = _test_module(package, module, templates)
        # Visible tests: the first half of each function's cases, plus the case that shows the bug.
        visible = [Template(t.module, t.source, t.cases[: max(1, len(t.cases) // 2)]) for t in templates]
        case = (witness[0], witness[1])
        if target in templates and case not in visible[templates.index(target)].cases:
            i = templates.index(target)
            visible[i] = Template(target.module, target.source, visible[i].cases + (case,))
        files[f"tests/test_{module}.py"] = _test_module(package, module, visible)
    args, expected, (ok, got) = witness
    call = f"{package}.{target.module}.{target.name}({', '.join(repr(a) for a in args)})"
    got_text = f"returns {got!r}" if ok else f"raises {got}"
    files["README.md"] = (f"# {package}\n\nSmall helper functions in `{package}/`; tests in `tests/` "
                          "(run them with pytest).\n")
    prompt = (f"Bug report: `{call}` {got_text}, but it should return {expected!r}. "
              f"Find and fix the bug in the `{package}` package. Do not change the tests; "
              "hidden tests check every function.")
    return Task(
        task_id=f"synthetic/{seed}",
        prompt=prompt,
        files=files,
        hidden_files=hidden,
        solution_globs=(f"{package}/*.py",),
        grade_command=pytest_command(["_hidden_tests"], with_nonce=True),
        timeout=timeout,
        metadata={"function": f"{target.module}.{target.name}", "mutation": desc,
                  "original": ast.unparse(ast.parse(target.source)) + "\n", "mutant": mutant},
    )
