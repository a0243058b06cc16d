"""The agent's tools: one schema per tool (OpenAI `tools` format) and the dispatch to its code.

Owns the tool names, descriptions and JSON-schema parameters, argument checking against those
schemas, and the three tools that execute inside the sandbox (lint, run, run_tests). The same
schemas serve training rollouts and the product. Must never call a tool function with arguments
the schema does not allow, and never let anything but a ToolError reach the agent as a message.
"""
import math
import os
import shlex
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import file_tools
from .errors import ToolError

if TYPE_CHECKING:
    from .sandbox import Sandbox


def _lint(sb: "Sandbox", path: str = ".") -> str:
    rel = sb.workspace.relative(sb.workspace.resolve(path))
    ruff = shutil.which("ruff", path=f"{sys.prefix}/bin:{os.environ.get('PATH', '')}")
    if ruff is None:
        raise ToolError("lint is unavailable: ruff is not installed")
    # Run inside the sandbox: ruff reads the workspace's config files, which the agent controls.
    result = sb.run(shlex.join([os.path.realpath(ruff), "check", "--no-cache", "--output-format=concise", "--", rel]))
    if result.exit_code == 0:
        return "no lint errors"
    if result.exit_code == 1:
        return result.stdout.strip()
    return result.format()


def _run(sb: "Sandbox", command: str, timeout: float | None = None) -> str:
    if timeout is not None and timeout <= 0:
        raise ToolError("timeout must be positive")
    return sb.run(command, timeout=timeout).format()


def _run_tests(sb: "Sandbox", selection: str | None = None) -> str:
    return sb.run_tests(selection).format()


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., str]
    on_workspace: bool  # True: fn takes the Workspace (host-side file tool); False: the Sandbox

    def schema(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def _params(required: list[str], **props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


_PATH = {"type": "string", "description": "Path relative to the workspace root (or under /workspace)."}
TOOLS: dict[str, Tool] = {t.name: t for t in [
    Tool("read_file", "Read a text file; lines are numbered. Optionally a 1-based inclusive line range.",
         _params(["path"], path=_PATH, start_line={"type": "integer", "minimum": 1},
                 end_line={"type": "integer", "minimum": 1}),
         file_tools.read_file, True),
    Tool("list_dir", "List a directory as a tree, directories ending in '/', symlinks shown as 'a -> b'.",
         _params([], path=_PATH, depth={"type": "integer", "minimum": 1, "description": "Levels to show (default 2)."}),
         file_tools.list_dir, True),
    Tool("search", "Search file contents with a regular expression; prints path:line:text.",
         _params(["pattern"], pattern={"type": "string", "description": "Regular expression."}, path=_PATH,
                 glob={"type": "string", "description": "Only files matching this glob, e.g. '*.py'."}),
         file_tools.search, True),
    Tool("edit_file", "Replace the single exact occurrence of old_str with new_str in a file.",
         _params(["path", "old_str", "new_str"], path=_PATH,
                 old_str={"type": "string", "description": "Exact text to replace; must occur exactly once."},
                 new_str={"type": "string", "description": "Replacement text."}),
         file_tools.edit_file, True),
    Tool("write_file", "Create or overwrite a file with the given content (parent directories are created).",
         _params(["path", "content"], path=_PATH, content={"type": "string"}),
         file_tools.write_file, True),
    Tool("lint", "Run the ruff linter on a file or directory and return its diagnostics.",
         _params([], path=_PATH), _lint, False),
    Tool("run", "Run a shell command in the workspace (no network). Returns exit code, stdout and stderr.",
         _params(["command"], command={"type": "string"},
                 timeout={"type": "number", "description": "Seconds; capped by the sandbox's limit."}),
         _run, False),
    Tool("run_tests", "Run pytest; reports passed / failed / errors per test.",
         _params([], selection={"type": "string",
                                "description": "Space-separated test files or node ids; empty runs all tests."}),
         _run_tests, False),
]}


def tool_schemas() -> list[dict[str, Any]]:
    """All tools in OpenAI `tools` format, ready for a chat-completions request."""
    return [t.schema() for t in TOOLS.values()]


# `submit` ends an agent's episode: the driver of the conversation (an RL rollout, a product
# agent) grades the workspace, so it has no code here and `call_tool` refuses it like any unknown name.
SUBMIT = "submit"
SUBMIT_SCHEMA: dict[str, Any] = {"type": "function", "function": {
    "name": SUBMIT, "description": "Finish the task: the workspace as it is now is graded by hidden tests.",
    "parameters": _params([])}}


def agent_tool_schemas() -> list[dict[str, Any]]:
    """The tools an agent is given: every sandbox tool, then `submit`."""
    return tool_schemas() + [SUBMIT_SCHEMA]


_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float)}


def check_arguments(tool: Tool, arguments: dict[str, Any]) -> dict[str, Any]:
    props = tool.parameters["properties"]
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        raise ToolError(f"{tool.name}: unknown argument(s) {', '.join(unknown)}; expected {', '.join(props) or 'none'}")
    missing = [name for name in tool.parameters["required"] if name not in arguments]
    if missing:
        raise ToolError(f"{tool.name}: missing required argument(s) {', '.join(missing)}")
    out = {}
    for name, value in arguments.items():
        if value is None and name not in tool.parameters["required"]:
            continue  # an explicit null means "use the default"
        spec = props[name]
        if isinstance(value, bool) or not isinstance(value, _TYPES[spec["type"]]):
            raise ToolError(f"{tool.name}: argument {name} must be of type {spec['type']}")
        # the model writes these: NaN (Python's JSON reads it), 1e400-sized integers and lone UTF-16
        # surrogates raised inside the host call (a 500 on the env server) instead of a tool error
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError(f"{tool.name}: argument {name} must be a finite number")
        if isinstance(value, int) and abs(value) > 2**53:
            raise ToolError(f"{tool.name}: argument {name} is out of range")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ToolError(f"{tool.name}: argument {name} holds a lone UTF-16 surrogate (not valid text)") from None
        if "minimum" in spec and value < spec["minimum"]:
            raise ToolError(f"{tool.name}: argument {name} must be >= {spec['minimum']}")
        out[name] = value
    return out


def call_tool(sb: "Sandbox", name: str, arguments: dict[str, Any]) -> str:
    tool = TOOLS.get(name)
    if tool is None:
        raise ToolError(f"unknown tool {name!r}; available: {', '.join(TOOLS)}")
    args = check_arguments(tool, arguments)
    return tool.fn(sb.workspace if tool.on_workspace else sb, **args)
