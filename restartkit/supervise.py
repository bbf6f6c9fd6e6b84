"""Supervision of one engine process as an explicit state machine.

    STARTING -> READY -> STOPPING -> EXITED
    STARTING -> EXITED (it died while starting) -> FATAL (we give up, with a reason)
    STARTING -> BACKOFF (not ready yet; probing again) -> STARTING

Ready means a real completion was answered within the deadline, never "the
PID exists".  Stopping is one fixed escalation: SIGTERM, wait, SIGKILL, wait;
"no such process" means already gone.  Every side effect (spawning, signals,
the clock, sleeping) goes through `Seam`, which the logic tests replace.
"""
from __future__ import annotations

import enum
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import tenacity

from restartkit.errors import EngineStartError
from restartkit.files import log_tail


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


class NotReady(Exception):
    pass


class ExitedEarly(Exception):
    pass


@dataclass
class Seam:
    """The one door for side effects."""
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    kill: Callable[[int, int], None] = os.kill
    popen: Callable[..., subprocess.Popen] = subprocess.Popen

    def wait_until(self, done: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
        """Ask `done` until it says yes (True) or `timeout_s` passed (False; it is asked once
        more at the deadline).  The one poll loop: every wait of restartkit's own goes through it."""
        deadline = self.clock() + max(0.0, timeout_s)
        while True:
            if done():
                return True
            if self.clock() >= deadline:
                return False
            self.sleep(interval_s)

    def reap_until_gone(self, pids: list[int], timeout_s: float, also: Callable[[], bool] = lambda: True) -> bool:
        """Reap `pids` (our children, or orphans we adopted) until none of their trees is left
        and `also` holds, or the timeout passed."""
        def gone() -> bool:
            for p in pids:
                reap(p)
            return not any(tree_pids(p) for p in pids) and also()
        return self.wait_until(gone, timeout_s)

    def alive(self, pid: int, create_time: float | None = None, start_ticks: int | None = None) -> bool:
        """Is this process (not another one under a reused PID) alive?  Named by its start
        time in clock ticks since boot when known (no clock step changes it), else by its
        wall-clock create time (records written before start ticks were kept)."""
        if start_ticks is not None:
            return proc_start_ticks(pid) == start_ticks and not _exited(pid)
        try:
            import psutil
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                return False
            return create_time is None or abs(p.create_time() - create_time) < 0.5
        except Exception:  # NoSuchProcess, AccessDenied on a foreign PID
            return False


def proc_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22):
    with the PID, it names one process, and no clock step can change it."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        return int(raw[raw.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def holder_alive(info: dict) -> bool:
    pid = info.get("pid")
    return bool(pid) and proc_start_ticks(pid) is not None and proc_start_ticks(pid) == info.get("start_ticks")


def now_ticks() -> int:
    """Now, in the clock ticks since boot that /proc/PID/stat's start times count."""
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))


def _exited(pid: int) -> bool:
    """Gone, or a zombie whose threads have all exited too: a killed process's leader turns
    zombie first, and its files (its listening socket) close only when its last thread exits."""
    state = proc_state(pid)
    if state is None or state == "X":
        return True
    if state != "Z":
        return False
    try:
        return len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return True


def proc_state(pid: int) -> str | None:
    """The state letter in /proc/PID/stat (R, S, T, Z...), None when there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        return raw[raw.rindex(")") + 2]
    except (OSError, ValueError, IndexError):
        return None


def kill_tree(pid: int) -> None:
    """SIGKILL a process and its descendants (a stopped process dies too)."""
    for p in reversed(tree_pids(pid)):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _listen_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(cols[9])
        except OSError:
            continue
    return inodes


def port_has_listener(port: int) -> bool:
    """Does a TCP socket listen on `port` (any address)?  Read from /proc, no connection
    made: a stopped process whose backlog is full still counts."""
    return bool(_listen_inodes(port))


def listeners(port: int) -> list[int]:
    """PIDs with a TCP socket listening on `port` (any address), read from /proc."""
    inodes = _listen_inodes(port)
    if not inodes:
        return []
    wanted = {f"socket:[{i}]" for i in inodes}
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fds = os.scandir(f"/proc/{entry.name}/fd")
            if any(_readlink(fd.path) in wanted for fd in fds):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def tree_pids(pid: int) -> list[int]:
    """The process and all its descendants ([] when it is gone)."""
    import psutil
    try:
        p = psutil.Process(pid)
        return [pid] + [c.pid for c in p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def reap(pid: int) -> None:
    """Collect `pid` if it is our own exited child, so its PID is free again
    (a long-lived restartkit process, such as the demo or bench, is the
    parent of the engines it started)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "exited (status unknown: not our child)"
    if returncode < 0:
        sig = signal.Signals(-returncode).name
        why = " — out of memory?" if sig == "SIGKILL" else ""
        return f"killed by {sig}{why}"
    if returncode == 98:
        return "exited with code 98: its port is already in use"
    return f"exited with code {returncode}"


@dataclass
class EngineProcess:
    pid: int
    create_time: float | None = None
    log_path: Path | None = None
    popen: subprocess.Popen | None = None
    seam: Seam = field(default_factory=Seam)
    state: ProcState = ProcState.STARTING
    history: list[tuple[str, float]] = field(default_factory=list)
    start_ticks: int | None = None  # /proc/PID/stat start time: with the PID, names this process
    ready_fd: int | None = None  # read end of the engine's ready signal (see EngineAdapter.signals_ready)
    ready_signalled: bool = False  # the engine said it was ready through ready_fd
    probes: int = 0  # readiness probes sent by wait_ready
    kept: bool = False  # popen is the engine's keeper (restartkit/keeper.py), which lives as long as it does

    def to(self, new: ProcState) -> None:
        if new not in ALLOWED[self.state]:
            raise RuntimeError(f"engine {self.pid}: {self.state.value} -> {new.value} is not a valid transition")
        self.state = new
        self.history.append((new.value, self.seam.clock()))

    def returncode(self) -> int | None:
        return self.popen.poll() if self.popen is not None else None

    def alive(self) -> bool:
        if self.popen is not None:
            if self.popen.poll() is None:
                return True
            if not self.kept:
                return False
            # the keeper is gone: killed with SIGKILL, it may have left the engine running
        return self.seam.alive(self.pid, self.create_time, self.start_ticks)

    def wait_ready(self, probe: Callable[[], None], timeout_s: float, interval_s: float = 0.05,
                   signal_interval_s: float = 1.0) -> float:
        """Probe until it passes; returns seconds waited.  Raises
        EngineStartError (state FATAL) when the process exits or the deadline passes.
        With a ready signal (ready_fd), probe when it comes (or every signal_interval_s,
        in case it never does) instead of every interval_s: no polling lag, and no
        stream of probes answered by an engine that is busy starting."""
        t0 = self.seam.clock()

        def attempt():
            if not self.alive():
                raise ExitedEarly()
            self.probes += 1
            try:
                probe()
            except Exception as e:
                if self.state is ProcState.STARTING:
                    self.to(ProcState.BACKOFF)
                raise NotReady(str(e)) from e
            if self.state is ProcState.BACKOFF:
                self.to(ProcState.STARTING)

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_delay(timeout_s),
            wait=lambda _: signal_interval_s if self.ready_fd is not None else interval_s,
            retry=tenacity.retry_if_exception_type(NotReady),
            sleep=self._wait_signal,
            reraise=True,
        )
        try:
            retrying(attempt)
        except ExitedEarly:
            self.to(ProcState.EXITED)
            self.to(ProcState.FATAL)
            # give the log a moment to be flushed by the dying process
            rc = self.returncode()
            raise EngineStartError(
                f"the engine (PID {self.pid}) {describe_exit(rc)} while starting",
                hint=_start_hint(rc, log_tail(self.log_path)) + (f"; log: {self.log_path}" if self.log_path else ""),
                log_tail=log_tail(self.log_path)) from None
        except NotReady as e:
            self.to(ProcState.FATAL)
            raise EngineStartError(
                f"the engine (PID {self.pid}) was not ready within {timeout_s:.0f} s (last probe: {e})",
                hint=f"raise [restart] start_timeout_s if the model is large; see the log: {self.log_path}",
                log_tail=log_tail(self.log_path)) from None
        finally:
            self.close_ready_fd()
        if self.state is ProcState.BACKOFF:
            self.to(ProcState.STARTING)
        self.to(ProcState.READY)
        return self.seam.clock() - t0

    def _wait_signal(self, seconds: float) -> None:
        """Sleep until the engine's ready byte arrives, or `seconds`."""
        import select
        if self.ready_fd is None:
            return self.seam.sleep(seconds)
        if select.select([self.ready_fd], [], [], seconds)[0]:
            if os.read(self.ready_fd, 64):
                self.ready_signalled = True
            else:  # closed without a word (the engine exited or gave up on it): plain polling from here
                self.close_ready_fd()

    def close_ready_fd(self) -> None:
        if self.ready_fd is not None:
            os.close(self.ready_fd)
            self.ready_fd = None

    def stop(self, timeout_s: float = 30.0, kill_timeout_s: float = 10.0, signalled: bool = False) -> str:
        """SIGTERM, wait, SIGKILL, wait.  Returns how it ended.  `signalled`:
        SIGTERM was already sent (a hand-over); only wait, then kill."""
        if self.state not in (ProcState.STOPPING, ProcState.EXITED, ProcState.FATAL):
            self.to(ProcState.STOPPING)
        how = "stopped by SIGTERM" if signalled else "already gone"
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, kill_timeout_s)):
            if not self.alive():
                break
            try:
                if not (signalled and sig == signal.SIGTERM):
                    self.seam.kill(self.pid, sig)
            except ProcessLookupError:  # no such process: already gone
                if self.state is ProcState.STOPPING:
                    self.to(ProcState.EXITED)
                return how
            how = "stopped by SIGTERM" if sig == signal.SIGTERM else f"did not stop within {timeout_s:.0f} s; killed"
            deadline = self.seam.clock() + wait_s
            while self.alive() and self.seam.clock() < deadline:
                self.seam.sleep(0.05)
        if self.alive():
            raise RuntimeError(f"engine {self.pid} survived SIGKILL (uninterruptible sleep?)")
        reap(self.pid)
        if self.state is ProcState.STOPPING:
            self.to(ProcState.EXITED)
        return how


def _start_hint(rc: int | None, tail: str) -> str:
    if rc == 98 or "Address already in use" in tail or "cannot listen" in tail:
        return "another process holds the port: stop it or change [service] port"
    if rc is not None and rc < 0 and -rc == signal.SIGKILL:
        return "look for the OOM killer in `dmesg`, or lower max_model_len"
    last = tail.strip().splitlines()[-1] if tail.strip() else "no output"
    return f"the engine's last words: {last}"
