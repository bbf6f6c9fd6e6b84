"""The engine's parent: a small process that reaps the engine the moment it exits.

A CRIU restore needs the snapshot's PIDs free, and an exited engine's PID stays taken
until its parent collects it.  An engine started by a restartkit command outlives that
command, so its parent would be init, and some inits (container init processes, this
project's CI machine) collect orphans only every second or two: a restore waited for
that.  Under a keeper the PID is free as soon as the engine has exited.

Two modes, one control socket (a socketpair end passed as a descriptor):

  spawn    start the engine (argv sent as JSON on the socket), answer its PID, and exit
           with the engine's own status when it exits (killed by a signal: the same
           signal), so the caller's Popen of the keeper reads like one of the engine.
  restore  run `criu restore --restore-detached`: answer criu's PID, then "exit N" when
           criu is done; the restored tree is handed to the keeper when criu leaves it.

In both the keeper is a child subreaper: processes the engine leaves behind when it dies
(a multi-process engine's helpers, orphaned by a crash) come to the keeper, which kills
them once the engine has exited, so that no orphan keeps device memory, a port or a PID
that the next engine needs, and collects them at once.

The keeper ignores SIGTERM, SIGINT, SIGHUP and SIGQUIT (a stop is for the engine, which
gets those signals at their defaults), holds none of the caller's descriptors once the
child runs, and imports nothing beyond the standard library: it is run by path
(python -I -S keeper.py MODE FD), never imported by the engine.
"""
from __future__ import annotations

import json
import os
import signal
import sys

KEEPER = os.path.abspath(__file__)
IGNORED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    mode, ctl = argv[1], int(argv[2])
    for s in IGNORED:
        signal.signal(s, signal.SIG_IGN)
    os.set_inheritable(ctl, False)
    spec = json.loads(_read_all(ctl))
    import ctypes
    # a child subreaper: whatever the engine leaves behind when it dies comes to the keeper, not to init
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        pid = os.posix_spawnp(spec["argv"][0], spec["argv"], os.environ, setsid=True, setsigdef=IGNORED)
    except OSError as e:
        _say(ctl, {"error": e.strerror or str(e), "errno": e.errno})
        return 127
    _say(ctl, {"pid": pid})
    _let_go_of_descriptors(ctl)
    if mode == "spawn":
        os.close(ctl)
    engine = pid if mode == "spawn" else None  # restore: the tree CRIU leaves behind, once it is done
    status, ending = None, False
    early: dict[int, int] = {}
    while True:
        if ending:  # the engine is gone: so are its helpers (their PIDs free, their memory back)
            for child in _children():
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            got, st = os.wait()
        except ChildProcessError:
            break
        if mode == "restore" and got == pid:
            _say(ctl, {"exit": os.waitstatus_to_exitcode(st)})
            os.close(ctl)
            left = _children()
            engine = left[0] if len(left) == 1 else None
            if not left and len(early) == 1 and spec.get("status_file"):  # it died before CRIU was done
                _write_status(spec["status_file"], next(iter(early.values())))
        elif mode == "restore" and engine is None:
            early[got] = os.waitstatus_to_exitcode(st)  # handed to the keeper and dead before CRIU exited
        elif got == engine:
            status, ending = os.waitstatus_to_exitcode(st), True
            if mode == "restore" and spec.get("status_file"):
                _write_status(spec["status_file"], status)
    if mode == "spawn" and status is not None and status < 0:
        _die_like(-status)
    return status if mode == "spawn" and status is not None else 0


def _write_status(path: str, status: int) -> None:
    """How the restored engine ended (its exit code, or minus the signal), for the restore that
    is watching it: a crash of its own says something about the snapshot, a kill by others does not."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        os.write(fd, str(status).encode())
        os.close(fd)
    except OSError:
        pass


def _children() -> list[int]:
    """The keeper's children (its own and those it adopted)."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:  # a kernel without /proc/PID/task/TID/children
        out = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                            out.append(int(d))
                except (OSError, ValueError, IndexError):
                    pass
        return out


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _say(fd: int, what: dict) -> None:
    try:
        os.write(fd, json.dumps(what).encode() + b"\n")
    except OSError:  # the caller is gone: the engine is not less alive for that
        pass


def _let_go_of_descriptors(keep: int) -> None:
    """The child has its copies; ours would keep pipes open (a ready pipe's EOF, a caller
    reading criu's output) for as long as the keeper lives."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    os.closerange(3, keep)
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))


def _die_like(sig: int) -> None:
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the engine's crash, not a core of the keeper
    if sig not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    sys.exit(128 + sig)  # a signal that does not end a process by default


# ---- the caller's side ----------------------------------------------------------------

class Control:
    """The caller's end of the control socket: one JSON object per line."""

    def __init__(self, sock):
        self.sock, self.buf = sock, b""
        self.closed = False  # the keeper closed its end (it is gone): nothing more will come

    def read(self, timeout_s: float) -> dict | None:
        """The next message, or None when none came within the timeout or the keeper is gone."""
        import time
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(4096)
            except OSError:  # a timeout, or the keeper went away
                return None
            if not chunk:
                self.closed = True
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return None

    def close(self) -> None:
        self.sock.close()


def start(popen, mode: str, argv: list[str], timeout_s: float = 10.0, status_file: str | None = None, **popen_kw):
    """Start `argv` under a keeper through `popen` (subprocess.Popen or a seam's); returns
    (the keeper's Popen, the child's PID, the Control: in restore mode the caller reads
    {"exit": N} from it; in spawn mode it is closed).  A child that cannot be started raises
    OSError, as Popen would.  `status_file` (restore mode): where the keeper writes how the restored
    engine ended."""
    import socket
    mine, theirs = socket.socketpair()
    try:
        kw = dict(popen_kw)
        kw["pass_fds"] = (*kw.get("pass_fds", ()), theirs.fileno())
        kw.setdefault("start_new_session", True)
        keeper = popen([sys.executable, "-I", "-S", KEEPER, mode, str(theirs.fileno())], **kw)
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()
    ctl = Control(mine)
    try:
        mine.sendall(json.dumps({"argv": [str(a) for a in argv], "status_file": status_file}).encode())
        mine.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    reply = ctl.read(timeout_s) or {}
    if "pid" not in reply:
        ctl.close()
        if reply:
            keeper.wait()
            raise OSError(reply.get("errno") or 0, f"{reply.get('error', 'could not start it')}: {argv[0]}")
        keeper.kill()
        keeper.wait()
        raise OSError(f"the keeper process (restartkit/process/keeper.py) did not start {argv[0]} within {timeout_s:.0f} s")
    if mode == "spawn":
        ctl.close()
    return keeper, int(reply["pid"]), ctl


if __name__ == "__main__":
    sys.exit(main(sys.argv))
