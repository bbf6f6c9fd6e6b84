"""Errors grouped by cause.  Each carries the next step for the person
reading it (`hint`) and the exit code the CLI returns for it."""
from __future__ import annotations

EXIT_SERVING = 0
EXIT_NOT_SERVING = 1
EXIT_USAGE = 2
EXIT_DEGRADED = 3


class RestartkitError(Exception):
    exit_code = EXIT_NOT_SERVING

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  -> {self.hint}"


class UsageError(RestartkitError):
    """Bad flags or arguments: nothing was touched."""
    exit_code = EXIT_USAGE


class PolicyError(UsageError):
    """A policy file is wrong: names the file, the key, the value and what is allowed."""

    def __init__(self, path, key: str, problem: str, allowed: str | None = None):
        self.path, self.key, self.problem = str(path), key, problem
        msg = f"{path}: [{key}] {problem}" if key else f"{path}: {problem}"
        super().__init__(msg, hint=allowed)


class PolicyErrors(PolicyError):
    """Several problems of one policy file, each named as PolicyError names one."""

    def __init__(self, path, errors: list[PolicyError]):
        self.errors = errors
        lines = [f"  [{e.key}] {e.problem}" + (f" ({e.hint})" if e.hint else "") for e in errors]
        UsageError.__init__(self, f"{path}: {len(errors)} problems:\n" + "\n".join(lines),
                            hint="fix them all; `restartkit policy check` says when the file is right")
        self.path, self.key = str(path), errors[0].key


class EngineStartError(RestartkitError):
    """The engine did not become ready: it exited, hung, or never answered."""

    def __init__(self, message: str, hint: str | None = None, log_tail: str = ""):
        super().__init__(message, hint)
        self.log_tail = log_tail


class StrategyError(RestartkitError):
    """A strategy's execute step failed; the restart goes to its recovery path."""
