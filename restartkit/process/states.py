"""The states of one engine process and the edges between them.  Depends on nothing.

    STARTING -> READY -> STOPPING -> EXITED
    STARTING -> EXITED (it died while starting) -> FATAL (we give up, with a reason)
    STARTING -> BACKOFF (not ready yet; probing again) -> STARTING
"""
from __future__ import annotations

import enum


class ProcState(enum.Enum):
    STARTING = "starting"
    BACKOFF = "backoff"
    READY = "ready"
    STOPPING = "stopping"
    EXITED = "exited"
    FATAL = "fatal"


ALLOWED = {
    ProcState.STARTING: {ProcState.READY, ProcState.BACKOFF, ProcState.EXITED, ProcState.STOPPING, ProcState.FATAL},
    ProcState.BACKOFF: {ProcState.STARTING, ProcState.EXITED, ProcState.STOPPING, ProcState.FATAL},
    ProcState.READY: {ProcState.STOPPING, ProcState.EXITED},
    ProcState.STOPPING: {ProcState.EXITED},
    ProcState.EXITED: {ProcState.FATAL},
    ProcState.FATAL: set(),
}
