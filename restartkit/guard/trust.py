"""Directories restartkit writes to, or acts on what it reads from (state dirs, snapshot roots),
must be its user's: owned by this user or root, writable by nobody else, and not a symbolic link.
Another user who made such a directory first could plant files there (an intent.json naming PIDs
to kill, a snapshot that root would restore) or links that root would write through.  The same
rules the weight cache's socket dir follows; refused with the path and the fix, never chmodded
behind the operator's back."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from restartkit.errors import UsageError


def trust_problem(path: Path, what: str) -> str | None:
    """Why `path` (an existing directory) is not to be trusted; None when it is.  Its parent is
    checked too: whoever may rename entries there could swap the directory for theirs."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    me = os.getuid()
    if stat.S_ISLNK(st.st_mode):
        return f"the {what} {path} is a symbolic link (to {os.readlink(path)}): restartkit does not write through links"
    if not stat.S_ISDIR(st.st_mode):
        return f"the {what} {path} is not a directory"
    if st.st_uid not in (me, 0):
        return f"the {what} {path} belongs to uid {st.st_uid}, not to you ({me}) or root"
    if st.st_mode & 0o022:
        return f"the {what} {path} is writable by others (mode {st.st_mode & 0o777:o})"
    try:
        pst = os.stat(path.parent)
    except OSError:
        return None
    sticky = bool(pst.st_mode & stat.S_ISVTX)
    if pst.st_uid not in (me, 0) or (pst.st_mode & 0o022 and not sticky):
        return (f"the {what} {path} sits in {path.parent}, which uid {pst.st_uid} owns or others may write to "
                f"(mode {pst.st_mode & 0o777:o}): the directory could be swapped for another")
    return None


def check_trusted(path: Path, what: str, knob: str) -> None:
    """UsageError naming the path, why and the fix, when `path` is not to be trusted."""
    if problem := trust_problem(path, what):
        raise UsageError(f"{problem}; nothing was touched",
                         hint=f"remove it and let restartkit make it (0700), `chown` it to yourself and "
                              f"`chmod 700` it, or point {knob} elsewhere")


def binary_problem(path: str) -> str | None:
    """Why a binary restartkit would run (as root, perhaps: CRIU) is not to be trusted: the file, or
    any directory on its way from /, owned by someone other than this user or root, or writable by
    others (a directory with the sticky bit, like /tmp, only lets owners rename their entries)."""
    real = Path(os.path.realpath(path))
    me = os.getuid()
    for p in [real, *real.parents]:
        try:
            st = os.stat(p)
        except OSError as e:
            return f"{p}: {e.strerror or e}"
        if st.st_uid not in (me, 0):
            return f"{p} belongs to uid {st.st_uid}, not to you ({me}) or root"
        if st.st_mode & 0o022 and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
            return f"{p} is writable by others (mode {st.st_mode & 0o777:o})"
    return None
