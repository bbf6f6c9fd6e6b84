"""Who is at the other end of a loopback TCP connection: the engines behind supervise's front answer their owner
only (RESTARTKIT_OWNER_ONLY=1 at spawn: the front, supervise's probes and restartkit's commands run as the
engine's user or as root), so that another local user cannot reach an engine past the front.

A loopback port cannot be made owner-only by the kernel, and a client's address says nothing (every local
process comes from 127.0.0.1).  The kernel does know which user owns the client's socket: this asks it for the
socket whose address is the connection's far end, by the socket diagnostics netlink interface (one exact lookup)
or, where that is not open to this process, from /proc/net/tcp.  A socket its owner has closed (an orphan, or
TIME_WAIT) has no owner left (inode 0) and is refused: a client must hold its connection to be answered."""
from __future__ import annotations

import errno
import json
import os
import socket
import struct

OWNER_ONLY_ENV = "RESTARTKIT_OWNER_ONLY"
_SOCK_DIAG_BY_FAMILY = 20
_NLMSG_ERROR = 2
_NLM_F_REQUEST = 1
_NETLINK_SOCK_DIAG = 4


def owners() -> frozenset[int] | None:
    """The users this engine answers, where its spawn asked for that (None: everyone, as a plain server)."""
    if os.environ.get(OWNER_ONLY_ENV) != "1":
        return None
    return frozenset({os.geteuid(), 0})


def peer_uid(conn: socket.socket) -> int | None:
    """The uid owning the client's socket of the accepted connection `conn`; None where no live local socket is
    found (not from this host, or closed by its owner)."""
    try:
        here, there = conn.getsockname()[:2], conn.getpeername()[:2]
    except OSError:
        return None
    family = conn.family
    try:
        return _by_netlink(family, there, here)
    except OSError:
        return _by_proc(family, there, here)


def client_uid(client: tuple, server: tuple) -> int | None:
    """The same for a connection known by its two addresses (an ASGI request's scope "client" and "server")."""
    family = socket.AF_INET6 if ":" in client[0] else socket.AF_INET
    try:
        return _by_netlink(family, tuple(client[:2]), tuple(server[:2]))
    except (OSError, ValueError):
        return _by_proc(family, tuple(client[:2]), tuple(server[:2]))


def _by_netlink(family: int, src: tuple, dst: tuple) -> int | None:
    """One exact lookup (inet_diag_req_v2, no dump) of the TCP socket whose local address is `src` and whose
    peer is `dst`."""
    def addr(host: str) -> bytes:
        return socket.inet_pton(family, host).ljust(16, b"\0")
    sockid = (struct.pack("!HH", src[1], dst[1]) + addr(src[0]) + addr(dst[0])
              + struct.pack("=III", 0, 0xFFFFFFFF, 0xFFFFFFFF))  # any interface, no cookie
    req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    msg = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0) + req
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.send(msg)
        reply = nl.recv(8192)
    if len(reply) < 20:
        raise OSError(errno.EPROTO, "short sock_diag reply")
    kind = struct.unpack_from("=H", reply, 4)[0]
    if kind == _NLMSG_ERROR:
        code = -struct.unpack_from("=i", reply, 16)[0]
        if code == errno.ENOENT:
            return None  # no such socket: not a local client
        raise OSError(code, os.strerror(code))
    if kind != _SOCK_DIAG_BY_FAMILY or len(reply) < 16 + 72:
        raise OSError(errno.EPROTO, "unexpected sock_diag reply")
    uid, inode = struct.unpack_from("=II", reply, 16 + 64)
    return uid if inode else None


def _hex(family: int, host: str, port: int) -> str:
    """An address as /proc/net/tcp{,6} writes it: the address's 32-bit words in host order, then the port."""
    raw = socket.inet_pton(family, host)
    words = "".join(struct.pack("=I", w).hex() for w in struct.unpack(f"!{len(raw) // 4}I", raw))
    return f"{words.upper()}:{port:04X}"


def _by_proc(family: int, src: tuple, dst: tuple) -> int | None:
    table = "/proc/net/tcp6" if family == socket.AF_INET6 else "/proc/net/tcp"
    local, remote = _hex(family, *src), _hex(family, *dst)
    try:
        with open(table) as f:
            for line in f:
                cols = line.split()
                if len(cols) > 9 and cols[1] == local and cols[2] == remote:
                    return int(cols[7]) if cols[9] != "0" else None
    except OSError:
        pass
    return None


def refusal_body(uid: int | None, port: int) -> bytes:
    """What a client this engine does not serve is told (an OpenAI-style error)."""
    who = "a closed socket" if uid is None else f"uid {uid}"
    return json.dumps({"error": {
        "message": f"this engine serves restartkit's front only (its owner, uid {os.geteuid()}, and root); {who} "
                   f"asked on port {port}: send requests to the service's own port", "type": "forbidden",
        "code": 403}}).encode()


def refusal(uid: int | None, port: int) -> bytes:
    """The same as a whole HTTP response (the connection closes after it)."""
    body = refusal_body(uid, port)
    return (b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\nConnection: close\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
