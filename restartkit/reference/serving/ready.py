"""restartkit's ready pipe (RESTARTKIT_READY_FD): one byte when the engine is ready, then closed.
Read once at start-up (`take_ready_fd`), written once (`signal_ready`)."""
from __future__ import annotations

import os

READY_FD_ENV = "RESTARTKIT_READY_FD"


class _Pipe:
    fd: str | None = None


_pipe = _Pipe()


def take_ready_fd() -> None:
    """Rank 0 at start-up: remember the pipe restartkit passed (its workers are started without it)."""
    _pipe.fd = os.environ.get(READY_FD_ENV)


def signal_ready() -> None:
    """Tell restartkit at once (one byte on the pipe it passed), then close the pipe: a
    snapshot of this process must not hold a pipe whose other end is outside it."""
    fd, _pipe.fd = _pipe.fd, None
    if not fd:
        return
    try:
        os.write(int(fd), b"R")
    except (OSError, ValueError):  # restartkit stopped listening (or the fd is not ours): it probes anyway
        pass
    finally:
        try:
            os.close(int(fd))
        except (OSError, ValueError):
            pass
