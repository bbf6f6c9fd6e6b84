"""What the systemd units restartkit writes (supervise --install-unit, snapshot refresh
--install-timer) run: the command line, quoted by systemd's rules, so that a policy path with a
space stays one argument and nothing in it adds a line or expands a specifier."""
from __future__ import annotations

import os
import shutil
import sys

from restartkit.errors import UsageError

PLAIN = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/._-+=:,@")


def quote(arg: str) -> str:
    """One argument of an Exec*= line: as it is when plain, else in double quotes with backslashes and
    quotes escaped, and % and $ doubled (systemd would expand specifiers and variables)."""
    if arg and set(arg) <= PLAIN:
        return arg
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{escaped}"'


def exec_line(args: list[str]) -> str:
    """An Exec*= value running restartkit with `args`; refuses what a unit cannot carry (a newline,
    any control character) naming it."""
    return " ".join(quote(a) for a in _checked(_restartkit() + list(args), "a systemd unit"))


def cron_command(args: list[str]) -> str:
    """The command of a crontab line running restartkit with `args`: quoted for /bin/sh, with % escaped
    (cron turns an unescaped % into a newline)."""
    import shlex
    return " ".join(shlex.quote(a).replace("%", "\\%") for a in _checked(_restartkit() + list(args), "a crontab line"))


def _checked(argv: list[str], where: str) -> list[str]:
    for a in argv:
        if any(ord(c) < 32 or ord(c) == 127 for c in a):
            raise UsageError(f"{a!r} holds a newline or another control character: {where} cannot carry it",
                             hint="move the policy file (or restartkit) to a path without one")
    return argv


def _restartkit() -> list[str]:
    """The restartkit the user ran (this interpreter's), not whichever is first on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "restartkit")
    if os.access(beside, os.X_OK):
        return [beside]
    found = shutil.which("restartkit")
    return [found] if found else [sys.executable, "-m", "restartkit.cli"]


def environment(service) -> str:
    """Environment= lines for what the command line chose and the unit must keep (the state root:
    another one would be another lock, history and metrics); empty when nothing was chosen."""
    root = service.policy.state_root
    if not root:
        return ""
    return "Environment=" + quote(f"RESTARTKIT_STATE_DIR={os.path.abspath(os.path.expanduser(root))}") + "\n"
