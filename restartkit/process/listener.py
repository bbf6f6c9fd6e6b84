"""The service's listening socket, held by the long-lived side (`restartkit supervise`) so that it
outlives every engine: a crash or a restart refuses no connection, the kernel queues them
(backlog BACKLOG) until the next engine accepts on the same socket.

Where it comes from: systemd's socket activation (LISTEN_FDS/LISTEN_PID, sd_listen_fds(3): the
first passed descriptor, fd 3), or supervise binds it itself.  How engines get it: inherited at
spawn (restartkit/process/lifecycle.py passes it and names its number to the engine), or, for a
restartkit command run beside the supervisor (`restart`, `standby arm`), from the supervisor's
broker: a Unix socket in the state dir (0600, the peer's uid checked with SO_PEERCRED) that sends
the descriptor with SCM_RIGHTS.

Only the standard library: the CLI imports this on its start-up path.
"""
from __future__ import annotations

import errno
import os
import socket
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

BACKLOG = 4096  # connections the kernel queues while no engine accepts (capped by net.core.somaxconn)
BROKER = "listen.sock"
SD_LISTEN_FDS_START = 3


class ListenerError(OSError):
    """The service's socket could not be had: the message names the address and what to do."""


@dataclass
class Held:
    """A listening socket this process holds for a service."""
    sock: socket.socket
    source: str  # "supervise" (bound here) or "systemd" (socket activation)

    @property
    def fd(self) -> int:
        return self.sock.fileno()

    @property
    def inode(self) -> int:
        return os.fstat(self.sock.fileno()).st_ino

    def describe(self) -> dict:
        host, port = self.sock.getsockname()[:2]
        return {"address": f"{host}:{port}", "source": self.source, "inode": self.inode, "backlog": backlog()}

    def close(self) -> None:
        self.sock.close()


def backlog() -> int:
    """The queue the kernel really keeps: listen()'s argument capped by net.core.somaxconn."""
    try:
        return min(BACKLOG, int(Path("/proc/sys/net/core/somaxconn").read_text()))
    except (OSError, ValueError):
        return BACKLOG


def bind(host: str, port: int) -> Held:
    """Bind and listen on the service's address (SO_REUSEADDR: a port in TIME_WAIT after the engine
    before is not "in use"; no SO_REUSEPORT: no one else may join the port and take its clients)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ListenerError(e.errno, f"cannot hold {host}:{port}: it is already in use") from None
        raise ListenerError(e.errno, f"cannot hold {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(False)
    return Held(sock, "supervise")


def from_systemd(env=os.environ) -> Held | None:
    """The socket systemd (or any LISTEN_FDS parent: systemd-socket-activate) passed to this process, or
    None when none was passed to it.  The variables are removed so that no child takes them for its own."""
    pid, count = env.get("LISTEN_PID"), env.get("LISTEN_FDS")
    if not count:
        return None
    if pid and pid != str(os.getpid()):
        return None  # meant for another process (a parent that exec'd us without clearing them)
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        env.pop(name, None)
    try:
        n = int(count)
    except ValueError:
        raise ListenerError(0, f"LISTEN_FDS={count!r} is not a number of descriptors") from None
    if n < 1:
        return None
    fd = SD_LISTEN_FDS_START
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise ListenerError(e.errno, f"LISTEN_FDS names descriptor {fd}, which is not a socket: {e.strerror}") from None
    if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.detach()
        raise ListenerError(0, f"descriptor {fd} passed by LISTEN_FDS is not a listening TCP socket: use "
                               "ListenStream= in the .socket unit")
    for extra in range(fd + 1, fd + n):  # only the first is the service's; the others are closed, not leaked
        try:
            os.close(extra)
        except OSError:
            pass
    sock.set_inheritable(False)
    return Held(sock, "systemd")


def matches(held: Held, host: str, port: int) -> str | None:
    """Why a passed socket is not the policy's address (None when it is).  A socket on all addresses
    serves a policy on one of them; another port never does."""
    got_host, got_port = held.sock.getsockname()[:2]
    if got_port != port:
        return f"the passed socket listens on port {got_port}, the policy's [service] port is {port}"
    if host not in ("0.0.0.0", "", "::") and got_host not in (host, "0.0.0.0", "::"):
        return f"the passed socket listens on {got_host}, the policy's [service] host is {host}"
    return None


# ---- the broker: the held socket for restartkit's other commands ------------------------------

def engine_broker(state_dir: Path) -> str:
    """The abstract Unix address (per network namespace, no file) where an engine that gave up the held
    socket for a CRIU dump takes it back (restartkit.reference.serving.detach): a copy restored in a network
    namespace of its own for a test restore can never reach it, and nobody without the service's admin token
    can name it (restartkit.guard.admin.broker_name)."""
    from restartkit.guard import admin
    return admin.broker_name(admin.token(state_dir))


class Broker:
    """Hands the held socket to a restartkit command, or an engine, of the same user that asks for it:
    commands at the state dir's listen.sock, engines at engine_broker()."""

    def __init__(self, state_dir: Path, held: Held):
        self.path = Path(state_dir) / BROKER
        self.held = held
        self.path.unlink(missing_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.sock.bind(str(self.path))
        finally:
            os.umask(old)
        self.sock.listen(16)
        self.engines = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.engines.bind(engine_broker(state_dir))
            self.engines.listen(16)
        except OSError as e:  # taken: an engine would take the socket back from whoever holds the name
            self.engines.close()
            self.sock.close()
            self.path.unlink(missing_ok=True)
            raise ListenerError(e.errno, f"the engines' broker address of {state_dir} is taken ({e.strerror}): "
                                "another supervise of this service runs, or a process of this user holds it") from None
        self.threads = [threading.Thread(target=self._serve, args=(s,), name="listener-broker", daemon=True)
                        for s in (self.sock, self.engines)]
        for t in self.threads:
            t.start()

    def _serve(self, listening: socket.socket) -> None:
        while True:
            try:
                conn, _ = listening.accept()
            except OSError:  # closed: supervise is stopping
                return
            with conn:
                try:
                    conn.settimeout(2.0)
                    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                    _pid, uid, _gid = struct.unpack("3i", creds)
                    if uid not in (os.getuid(), 0):
                        continue  # another user's process: it gets nothing
                    socket.send_fds(conn, [b"L"], [self.held.fd])
                except OSError:
                    pass

    def close(self) -> None:
        try:
            self.sock.close()
            self.engines.close()
        finally:
            self.path.unlink(missing_ok=True)


def fetch(state_dir: Path, timeout_s: float = 2.0) -> Held | None:
    """The socket a supervisor of this service holds, from its broker; None when no supervisor answers
    (none runs, or it was killed and left its broker's file behind)."""
    path = Path(state_dir) / BROKER
    if not path.exists():
        return None
    return fetch_from(str(path), timeout_s)


def fetch_from(address: str, timeout_s: float = 2.0) -> Held | None:
    """The held socket from the broker at `address` (a path, or an abstract name: engine_broker())."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(address)
            _pid, uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                struct.calcsize("3i")))
            if uid not in (os.getuid(), 0):  # another user's process squats the address: take nothing from it
                return None
            _msg, fds, _flags, _addr = socket.recv_fds(s, 16, 1)
        except OSError:
            return None
    if not fds:
        return None
    sock = socket.socket(fileno=fds[0])
    sock.set_inheritable(False)
    return Held(sock, "supervisor")
