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
    to exit; returns seconds waited.  A reused PID (another start time) is not waited for.
    Only /proc and a pidfd: this runs on the restart's critical path, where importing
    psutil cost an engine 0.09 s."""
    spec = os.environ.get("RESTARTKIT_AFTER_PID")
    if not spec:
        return 0.0
    pid_s, _, ctime = spec.partition(":")
    pid, timeout = int(pid_s), float(os.environ.get("RESTARTKIT_AFTER_TIMEOUT_S", "60"))
    t0 = time.perf_counter()
    try:
        fd = os.pidfd_open(pid)  # readable once the process has exited (zombie or reaped)
    except ProcessLookupError:
        return time.perf_counter() - t0
    try:
        started = start_time(pid)
        if started is None or (ctime and abs(started - float(ctime)) >= 0.5):  # gone, a zombie, or the PID reused
            return time.perf_counter() - t0
        import select
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(timeout * 1000):
            raise TimeoutError(f"the engine this one replaces (PID {pid}) is still running after {timeout:.0f} s; "
                               "not allocating device memory beside it")
    finally:
        os.close(fd)
    log(f"the previous engine (PID {pid}) has exited; waited {time.perf_counter() - t0:.3f} s")
    return time.perf_counter() - t0


def start_time(pid: int) -> float | None:
    """When the process started, in seconds since the epoch, as psutil's create_time computes it
    (boot time + start ticks); None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    except (OSError, StopIteration):
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()  # from field 3 (state) on: the name may hold spaces
    if fields[0] == b"Z":
        return None
    return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
