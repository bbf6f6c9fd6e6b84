"""The wire: length-prefixed JSON over a Unix socket; file descriptors travel
with SCM_RIGHTS, CUDA IPC handles as base64 bytes.  No pickle anywhere.

Frame: 4-byte big-endian length, then that many bytes of UTF-8 JSON.  Every
read and write has a deadline.  The socket directory is private to the user
(0700), each socket 0600, and the daemon checks the peer's uid (SO_PEERCRED).
"""
from __future__ import annotations

import array
import json
import os
import socket
import struct
import tempfile
import time
from pathlib import Path

from restartkit.process.procfs import proc_state

MAX_FRAME = 256 * 1024 * 1024
MAX_FDS = 8
PROTOCOL_VERSION = 1


class ProtocolError(Exception):
    pass


def socket_dir(override: str = "", create: bool = False) -> Path:
    """The per-user private directory for the sockets.  `create` (the daemons): made 0700 when
    missing, and refused when it is not ours or others may write to it (never chmodded behind the
    operator's back).  Clients only name it: `request` checks what it finds there."""
    d = Path(override) if override else Path(tempfile.gettempdir()) / f"restartkit-wc-{os.getuid()}"
    if create:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        if problem := _untrusted(d, "socket directory"):
            raise ProtocolError(problem)
    return d


def _untrusted(path: Path, what: str) -> str | None:
    st = os.stat(path)
    if st.st_uid not in (os.getuid(), 0):
        return f"{what} {path} belongs to uid {st.st_uid}, not to you ({os.getuid()}) or root: refusing it"
    if what == "socket directory" and st.st_mode & 0o022:
        return (f"{what} {path} is writable by others (mode {st.st_mode & 0o777:o}): anyone could put a socket in "
                f"the daemon's place; `chmod 700 {path}` or pick another socket_dir")
    return None


def trust_problem(path: Path) -> str | None:
    """Why a daemon socket at `path` is not to be trusted (None: it may be): its directory or
    itself owned by another user, or a directory others can write to.  FileNotFoundError when
    there is no socket."""
    path = Path(path)
    return _untrusted(path.parent, "socket directory") or _untrusted(path, "socket")


def socket_path(device_uuid: str, draft: bool = False, override: str = "", create: bool = False) -> Path:
    """Where the daemon of one device (and one weight group: the model or its draft) listens;
    the one place the path is built, for daemons, launchers, clients and engines alike."""
    return socket_dir(override, create) / socket_name(device_uuid, draft)


def socket_name(device_uuid: str, draft: bool = False) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in device_uuid)
    return f"{safe}{'_draft' if draft else ''}.sock"


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def _deadline_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the peer did not finish its message in time")
    return left


def encode(message: dict, raw: dict[str, bytes] | None = None) -> bytes:
    """JSON bytes of `message`, plus members whose values are already JSON
    bytes (a large manifest is encoded once, not on every attach)."""
    data = json.dumps(message, separators=(",", ":")).encode()
    for key, value in (raw or {}).items():
        data = data[:-1] + (b"," if len(data) > 2 else b"") + json.dumps(key).encode() + b":" + value + b"}"
    return data


def send(sock: socket.socket, message: dict | bytes, fds: list[int] = (), timeout: float = 30.0) -> None:
    data = message if isinstance(message, bytes) else encode(message)
    if len(data) > MAX_FRAME:
        raise ProtocolError(f"message of {len(data)} bytes is over the {MAX_FRAME}-byte limit")
    frame = struct.pack("!I", len(data)) + data
    deadline = time.monotonic() + timeout
    sock.settimeout(_deadline_left(deadline))
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([frame], anc)  # the descriptors ride with the first bytes
    view = memoryview(frame)[sent:]
    while view:
        sock.settimeout(_deadline_left(deadline))
        n = sock.send(view)
        view = view[n:]


def recv(sock: socket.socket, timeout: float = 30.0) -> tuple[dict, list[int]]:
    """One message and any descriptors that came with it.  The caller owns the fds."""
    deadline = time.monotonic() + timeout
    fds: list[int] = []
    buf = bytearray()
    fd_space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    while len(buf) < 4:
        sock.settimeout(_deadline_left(deadline))
        data, anc, flags, _ = sock.recvmsg(65536, fd_space)
        if not data:
            raise ConnectionError("the peer closed the connection")
        _collect_fds(anc, fds)
        buf += data
    (length,) = struct.unpack("!I", buf[:4])
    if length > MAX_FRAME:
        _close(fds)
        raise ProtocolError(f"frame of {length} bytes is over the {MAX_FRAME}-byte limit")
    while len(buf) < 4 + length:
        sock.settimeout(_deadline_left(deadline))
        chunk = sock.recv(min(1 << 20, 4 + length - len(buf)))
        if not chunk:
            _close(fds)
            raise ConnectionError("the peer closed the connection mid-message")
        buf += chunk
    try:
        msg = json.loads(bytes(buf[4 : 4 + length]))
    except ValueError as e:
        _close(fds)
        raise ProtocolError(f"message is not JSON: {e}") from None
    if not isinstance(msg, dict):
        _close(fds)
        raise ProtocolError("message is not a JSON object")
    return msg, fds


def _collect_fds(anc, out: list[int]) -> None:
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[: len(data) - (len(data) % a.itemsize)])
            out.extend(a)


def _close(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def request(path: str | Path, message: dict, timeout: float = 30.0, connect_timeout: float = 5.0) -> tuple[dict, list[int]]:
    """Connect, send one request, read one answer.  Raises ConnectionError
    (nothing listens), TimeoutError, ProtocolError."""
    if problem := trust_problem(Path(path)):
        raise ProtocolError(problem)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(connect_timeout)
        sock.connect(str(path))
        peer_pid, peer_uid, _gid = peer_credentials(sock)
        if peer_uid not in (os.getuid(), 0):  # a socket swapped in between our check and the connect
            raise ProtocolError(f"the process serving {path} (PID {peer_pid}) runs as uid {peer_uid}, not as you "
                                f"({os.getuid()}) or root: refusing its answers")
        if proc_state(peer_pid) in ("T", "t"):  # it accepted in the kernel, and would answer nothing until continued
            raise ProtocolError(f"the weight-cache daemon serving {path} (PID {peer_pid}) is stopped (SIGSTOP): it "
                                f"answers nothing; `kill -CONT {peer_pid}`, or restart `restartkit preload`")
        try:
            send(sock, message, timeout=timeout)
        except (BrokenPipeError, ConnectionResetError):
            # a daemon that refuses a peer (another uid) answers and closes before reading:
            # its answer, already here, says why
            return recv(sock, timeout=timeout)
        return recv(sock, timeout=timeout)
    finally:
        sock.close()
