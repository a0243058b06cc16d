"""Exceptions of the sandbox: what a caller can catch and what an agent gets to read.

Owns only the exception types; must never carry host paths or secrets an agent should not see
in a ToolError message (those messages go back to the model verbatim).
"""


class ToolError(Exception):
    """A tool call the agent made was refused or failed; the message is shown to the agent."""


class SandboxError(RuntimeError):
    """The sandbox itself failed (setup of the namespaces, a launcher crash): a host-side fault."""


class SandboxUnavailable(SandboxError):
    """Namespace isolation cannot be had here and rlimits-only mode was not allowed."""
