"""What /proc says about a process, read once here: its start ticks (with the PID they name one
process), its state, its tree, its descriptors and mappings, the listeners of a port.  Stdlib only
(psutil where /proc has no cheap answer); nothing here signals a process except `kill_tree`."""
from __future__ import annotations

import os
import signal
from pathlib import Path


def _stat_field(pid: int, n: int) -> str | None:
    """Field `n` of /proc/PID/stat (1-based, as proc(5) counts them, from 3 on), None when gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        return raw[raw.rindex(")") + 2:].split()[n - 3]
    except (OSError, ValueError, IndexError):
        return None


def proc_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22):
    with the PID, it names one process, and no clock step can change it."""
    v = _stat_field(pid, 22)
    return int(v) if v is not None and v.isdigit() else None


def parent(pid: int) -> int | None:
    """The parent's PID (/proc/PID/stat field 4), None when the process is gone."""
    v = _stat_field(pid, 4)
    return int(v) if v is not None and v.isdigit() else None


def owner(pid: int) -> int | None:
    """The process's real user id, None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def argv(pid: int) -> list[str]:
    """The process's argv ([] when it is gone or a kernel thread)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def ancestors(pid: int, limit: int = 64) -> list[int]:
    """The process's parent, its parent's parent, ... up to (not counting) init."""
    out, p = [], parent(pid)
    while p and p > 1 and len(out) < limit:
        out.append(p)
        p = parent(p)
    return out


def holder_alive(info: dict) -> bool:
    """Does the process a record names ({"pid", "start_ticks"}) still run (a zombie does not)?"""
    pid = info.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    ticks = proc_start_ticks(pid)
    return ticks is not None and ticks == info.get("start_ticks") and not exited(pid)


def now_ticks() -> int:
    """Now, in the clock ticks since boot that /proc/PID/stat's start times count."""
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))


def proc_state(pid: int) -> str | None:
    """The state letter in /proc/PID/stat (R, S, T, Z...), None when there is no such process."""
    return _stat_field(pid, 3)


def stopped_in(pid: int) -> int | None:
    """A process of the tree rooted at `pid` that is stopped (state T: SIGSTOP, SIGTSTP; t: a debugger), or None.
    A stopped process answers nothing until continued: nothing may depend on it."""
    for p in tree_pids(pid):
        if proc_state(p) in ("T", "t"):
            return p
    return None


def exited(pid: int) -> bool:
    """Gone, or a zombie whose threads have all exited too: a killed process's leader turns
    zombie first, and its files (its listening socket) close only when its last thread exits."""
    state = proc_state(pid)
    if state is None or state == "X":
        return True
    if state != "Z":
        return False
    try:
        return len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return True


def tracer(pid: int) -> int:
    """The PID of the process tracing `pid` (ptrace: a debugger, CRIU while it dumps), 0 when none or gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return int(status.split("TracerPid:", 1)[1].split(None, 1)[0]) if "TracerPid:" in status else 0


def comm(pid: int) -> str:
    """The process's command name, '?' when it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def create_time(pid: int) -> float | None:
    """The process's wall-clock creation time (records written before start ticks were kept)."""
    try:
        import psutil
        return psutil.Process(pid).create_time()
    except Exception:
        return None


def tree_pids(pid: int) -> list[int]:
    """The process and all its descendants ([] when it is gone)."""
    import psutil
    try:
        p = psutil.Process(pid)
        return [pid] + [c.pid for c in p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_tree(pid: int) -> None:
    """SIGKILL a process and its descendants (a stopped process dies too)."""
    for p in reversed(tree_pids(pid)):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def reap(pid: int) -> None:
    """Collect `pid` if it is our own exited child, so its PID is free again
    (a long-lived restartkit process, such as the demo or bench, is the
    parent of the engines it started)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def fd_targets(pid: int) -> list[str]:
    """Where each of the process's descriptors points (paths, socket:[N], anon_inode:[...])."""
    out = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
    except OSError:
        pass
    return out


def maps(pid: int) -> list[str]:
    """The lines of /proc/PID/maps ([] when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f.readlines()
    except OSError:
        return []


def environ_and_argv(pid: int) -> tuple[list[bytes], list[str]] | None:
    """The process's environment entries and its argv, None when they cannot be read."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    return environ, argv


def tcp_sockets(tables: tuple[str, ...] = ("/proc/net/tcp", "/proc/net/tcp6")) -> list[list[str]]:
    """The rows of the kernel's TCP socket tables, split into columns: 1 the local address, 3 the state
    ("0A": listening), 7 the owner's uid, 9 the inode.  A table that cannot be read gives none."""
    rows = []
    for table in tables:
        try:
            with open(table) as f:
                next(f, None)
                rows += [cols for cols in (line.split() for line in f) if len(cols) > 9]
        except OSError:
            continue
    return rows


def _listen_inodes(port: int) -> set[str]:
    return {cols[9] for cols in tcp_sockets() if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port}


def port_has_listener(port: int) -> bool:
    """Does a TCP socket listen on `port` (any address)?  Read from /proc, no connection
    made: a stopped process whose backlog is full still counts."""
    return bool(_listen_inodes(port))


def listeners(port: int) -> list[int]:
    """PIDs with a TCP socket listening on `port` (any address), read from /proc."""
    inodes = _listen_inodes(port)
    if not inodes:
        return []
    wanted = {f"socket:[{i}]" for i in inodes}
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        if wanted & set(fd_targets(int(entry.name))):
            found.append(int(entry.name))
    return found
