"""One command at a time per service: a lock in the state dir, held for the whole command; the
second waits (`--wait`) or exits 75 naming the holder.  The lock file says who holds it."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Callable, Iterator

from restartkit.errors import RestartkitError, UsageError
from restartkit.process.procfs import proc_start_ticks
from restartkit.process.seam import Seam

EXIT_BUSY = 75  # EX_TEMPFAIL: try again later
LOCK_POLL_S = 0.1  # how often a waiting command tries the lock again


class BusyError(RestartkitError):
    exit_code = EXIT_BUSY


def lock_holder(state_dir: Path) -> dict | None:
    """Who holds the service's lock now ({} when unknown), or None when it is free."""
    try:
        fd = os.open(state_dir / "lock", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return _read_holder(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def service_lock(state_dir: Path, service: str, command: str, wait_s: float = 0.0,
                 say: Callable[[str], None] = lambda _m: None, seam: Seam | None = None) -> Iterator[None]:
    """Hold the service's lock for the block, waiting up to `wait_s` for another command's."""
    path = state_dir / "lock"
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:  # a read-only state dir (only a stop gets this far): flock needs no write access
            if e.errno != errno.EROFS:
                raise
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise UsageError(f"the lock file {path} cannot be opened ({e.strerror or e}); nothing was touched",
                         hint="it must be a regular file restartkit can write (a directory, a link or an immutable "
                              "file is not): remove it (`chattr -i` first if it is immutable)") from None
    try:
        told = []

        def taken() -> bool:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if not told and wait_s > 0:
                    say(f"{service}: {_who(_read_holder(fd))}; waiting up to {wait_s:.0f} s for it")
                    told.append(True)
                return False
        if not (seam or Seam()).wait_until(taken, wait_s, LOCK_POLL_S):
            raise BusyError(f"busy: {_who(_read_holder(fd))} on {service}" + (f" (waited {wait_s:.0f} s)" if wait_s else ""),
                            hint="try again when it is done, or pass --wait SECONDS")
        try:  # who holds it, for the next command's message: advice, which a full disk may refuse
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "start_ticks": proc_start_ticks(os.getpid()),
                                      "command": command, "since": time.time()}).encode(), 0)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _who(holder: dict) -> str:
    return f"PID {holder.get('pid', '?')} runs `restartkit {holder.get('command', '?')}`"


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
