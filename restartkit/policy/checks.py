"""The checks of single policy values (restartkit.policy.SCHEMA's `check`): each returns the problem, or None."""
from __future__ import annotations

import ipaddress
import math
import os
import re

from restartkit.contracts import STRATEGY_NAMES

HEX40 = re.compile(r"[0-9a-f]{40}")
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
HOSTNAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252})")
# systemd OnCalendar=: the shorthands, or an expression of its own characters (no line breaks, no '=')
MAX_SECONDS = 7 * 24 * 3600.0
MIN_SECONDS = 0.01


def show(v, limit: int = 80) -> str:
    """A value for an error message: its repr, cut to `limit` characters."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + f"... ({len(r)} characters)"


def _positive(v):
    return None if 0 < v <= 2**31 else "must be greater than 0 (and at most 2**31)"


def _non_negative(v):
    return None if 0 <= v <= 2**31 else "must be 0 or more"


def _seconds(v):
    if not math.isfinite(v) or not MIN_SECONDS <= v <= MAX_SECONDS:
        return f"must be a number of seconds from {MIN_SECONDS} to {MAX_SECONDS:.0f} (7 days)"
    return None


def _hours(v):
    return None if math.isfinite(v) and 0 < v <= 24 * 366 else "must be a number of hours above 0, at most a year"


def _fraction(v):
    return None if math.isfinite(v) and 0 < v <= 1 else "must be a fraction above 0, at most 1"


def _port(v):
    return None if 0 < v < 65536 else "must be a TCP port (1..65535)"


def _port_or_zero(v):
    return None if 0 <= v < 65536 else "must be a TCP port (1..65535), or 0 for none"


def _revision(v):
    return None if v == "" or HEX40.fullmatch(v) else "must be a 40-character lowercase hex commit id (or empty)"


def _name(v):
    if not NAME.fullmatch(v):
        return ("must be 1-64 letters, digits, '.', '_' or '-', not starting with '.' or '-' "
                "(it names the state directory and the metrics' labels)")
    return None


def _host(v):
    try:
        ipaddress.ip_address(v)
        return None
    except ValueError:
        pass
    return None if HOSTNAME.fullmatch(v) else "must be an IP address or a host name"


PATH_MAX, NAME_MAX = 4096, 255  # Linux: a whole path, and one of its components


def _path(v):
    if any(ord(c) < 32 or c == "\x7f" for c in v):
        return "must not hold control characters (line breaks, tabs, NUL)"
    return path_length_problem(v)


def path_length_problem(v: str) -> str | None:
    """Why a path is too long for the filesystem (ENAMETOOLONG), or None."""
    if len(os.fsencode(v)) >= PATH_MAX:
        return f"is {len(os.fsencode(v))} bytes long: a path holds at most {PATH_MAX - 1}"
    if longest := max((p for p in v.split("/")), key=lambda p: len(os.fsencode(p)), default=""):
        if len(os.fsencode(longest)) > NAME_MAX:
            return f"has a component of {len(os.fsencode(longest))} bytes ({longest[:40]}...): at most {NAME_MAX}"
    return None


def _served_name(v):
    if any(ord(c) < 32 or c == "\x7f" for c in v) or len(v) > 256:
        return "must be at most 256 characters, without control characters"
    return None


def _parallel(limit: int, what: str):
    def check(v):
        return None if 0 < v <= limit else f"must be from 1 to {limit} ({what})"
    return check


def _argv(v):
    if not all(isinstance(a, str) for a in v):
        return "must be a list of strings"
    if any("\0" in a for a in v):
        return "must not hold NUL characters"
    return None


def _canary(v):
    if not v:
        return "must hold at least one prompt: an empty canary proves nothing"
    if len(v) > 32 or not all(isinstance(a, str) and a.strip() and "\0" not in a for a in v):
        return "must be 1-32 non-empty strings"
    return None


def _env(v):
    for k, val in v.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            return f"{show(k)} is not an environment variable name"
        if not isinstance(val, str) or "\0" in val:
            return f"{k} must be a string (write numbers in quotes: {k} = \"{val}\")" if not isinstance(val, str) \
                else f"{k} must not hold NUL characters"
    return None


def _calendar(v):
    from restartkit.policy.schedule import check
    return check(v)


def _strategy_list(v):
    if v == ["auto"]:
        return None
    bad = [s for s in v if s not in STRATEGY_NAMES]
    if bad:
        return f"unknown strategy {bad[0]!r}"
    if len(set(v)) != len(v):
        return "lists a strategy twice"
    return None
