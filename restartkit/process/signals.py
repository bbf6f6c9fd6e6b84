"""Signals only enqueue: long-running processes block SIGTERM/SIGINT in every
thread and take them in their main loop with `next_stop_signal`."""
from __future__ import annotations

import signal

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """This process gets `sig` when its parent dies (Linux's PR_SET_PDEATHSIG): a child never outlives its keeper."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def block_stop_signals() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def next_stop_signal(timeout_s: float, also: frozenset = frozenset()) -> int | None:
    """The stop signal (or one of `also`, blocked by the caller) that arrived within `timeout_s`, else
    None.  A process restored by CRIU can see its interrupted wait return with a garbage siginfo:
    anything but the signals waited for counts as nothing."""
    wanted = STOP_SIGNALS | also
    info = signal.sigtimedwait(wanted, timeout_s)
    if info is None or info.si_signo not in wanted:
        return None
    return info.si_signo
