"""A restart's hand-over, engine side: the engine this one replaces may
still be tearing down (restartkit started this one as soon as the old one
stopped listening); device memory waits for its exit."""
from __future__ import annotations

import os
import sys
import time


def log(msg: str) -> None:
    print(f"[engine {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def wait_for_previous_engine() -> float:
    """Wait for the process named by RESTARTKIT_AFTER_PID ("pid:create_time")
    to exit; returns seconds waited.  A reused PID (another start time) is not waited for."""
    spec = os.environ.get("RESTARTKIT_AFTER_PID")
    if not spec:
        return 0.0
    pid_s, _, ctime = spec.partition(":")
    pid, timeout = int(pid_s), float(os.environ.get("RESTARTKIT_AFTER_TIMEOUT_S", "60"))
    t0 = time.perf_counter()
    from restartkit.supervise import Seam
    if not Seam().alive(pid, float(ctime) if ctime else None):  # gone, a zombie, or the PID reused
        return 0.0
    try:
        fd = os.pidfd_open(pid)  # readable once the process has exited (zombie or reaped)
    except ProcessLookupError:
        return 0.0
    import select
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(timeout * 1000):
            raise TimeoutError(f"the engine this one replaces (PID {pid}) is still running after {timeout:.0f} s; "
                               "not allocating device memory beside it")
    finally:
        os.close(fd)
    log(f"the previous engine (PID {pid}) has exited; waited {time.perf_counter() - t0:.3f} s")
    return time.perf_counter() - t0
