"""The credential of restartkit's calls into an engine it started (its admin routes: sleep, wake, KV-cache drop,
weights release and re-attach, the held socket's hand-back, stats; the vLLM launcher's and vLLM's dev-mode routes).

A client's address is not a credential: any local process, and every client behind a proxy on this host, comes
from 127.0.0.1.  The credential is a random token in the service's state dir (0700, the file 0600): restartkit's
commands read it there, the engine gets it in its environment at spawn (/proc/PID/environ is its user's only),
and the engine answers an admin call only when the call carries it (contracts.ADMIN_HEADER).  The same secret
names the supervisor's broker (an abstract Unix address nobody else can guess: broker_name)."""
from __future__ import annotations

import errno
import hashlib
import os
import secrets
from pathlib import Path

# restartkit's calls into an engine it started carry the token in this header; the engine has it in its
# environment (ADMIN_TOKEN_ENV) and answers its admin routes to no one else
ADMIN_HEADER = "X-Restartkit-Admin"
ADMIN_TOKEN_ENV = "RESTARTKIT_ADMIN_TOKEN"
TOKEN_FILE = "admin.token"
_fallback: dict[str, str] = {}  # per state dir, when it cannot hold the file (full, read-only): this process's own


def token(state_dir: Path) -> str:
    """The service's admin token, made on first use.  A state dir that cannot hold it (full, read-only) gets one
    for this process only: the engine it starts is still closed to everyone else, and a later command that cannot
    read the token is refused by it, as any stranger is."""
    path = Path(state_dir) / TOKEN_FILE
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    except OSError:
        return _fallback.setdefault(str(state_dir), secrets.token_hex(32))
    made = secrets.token_hex(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:  # another command made it first: theirs
        return _read(path)
    except OSError:
        return _fallback.setdefault(str(state_dir), made)
    try:
        os.write(fd, made.encode())
        os.fsync(fd)
    except OSError as e:  # ENOSPC halfway: no half-written token is left for the next command to read
        os.close(fd)
        path.unlink(missing_ok=True)
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO):
            raise
        return _fallback.setdefault(str(state_dir), made)
    os.close(fd)
    return made


def _read(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        text = os.read(fd, 256).decode(errors="replace").strip()
    finally:
        os.close(fd)
    if len(text) < 32 or not all(c in "0123456789abcdef" for c in text):
        raise OSError(errno.EINVAL, f"{path} does not hold a token")
    return text


def headers(state_dir: Path) -> dict:
    return {ADMIN_HEADER: token(state_dir)}


def broker_name(secret: str) -> str:
    """The abstract Unix address of the supervisor's broker for engines, from the service's admin token: nobody
    without the token can name it first (a squatter's bind would hand engines its own socket)."""
    digest = hashlib.sha256(b"restartkit-broker\0" + secret.encode()).hexdigest()[:32]
    return f"\0restartkit-broker-{digest}"
