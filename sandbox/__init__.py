"""cuttle.sandbox: isolated coding workspaces, the agent's tools, coding tasks and their server.

Start with `Sandbox` (sandbox.py) and the tool schemas (tools.py); docs/sandbox.md has the map.
This package must never import the engine's heavy dependencies: it runs beside any trainer.
"""
from .errors import SandboxError, SandboxUnavailable, ToolError
from .isolation import NAMESPACES, RLIMITS_ONLY, namespace_error
from .limits import Limits
from .runner import RunResult
from .sandbox import Sandbox
from .testing import TestReport
from .tools import SUBMIT, TOOLS, agent_tool_schemas, tool_schemas

__all__ = [
    "NAMESPACES",
    "RLIMITS_ONLY",
    "TOOLS",
    "Limits",
    "RunResult",
    "SUBMIT",
    "Sandbox",
    "SandboxError",
    "SandboxUnavailable",
    "TestReport",
    "ToolError",
    "agent_tool_schemas",
    "namespace_error",
    "tool_schemas",
]
