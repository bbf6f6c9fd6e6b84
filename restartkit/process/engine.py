"""One engine process as an explicit state machine (restartkit.process.states).

Ready means a real completion was answered within the deadline, never "the
PID exists".  Stopping is one fixed escalation: SIGTERM, wait, SIGKILL, wait;
"no such process" means already gone.  Every side effect (spawning, signals,
the clock, sleeping) goes through `Seam`, which the logic tests replace.
"""
from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import tenacity

from restartkit.errors import EngineStartError
from restartkit.http import HTTPFailure
from restartkit.files import log_tail
from restartkit.process.procfs import reap, stopped_in
from restartkit.process.seam import Seam, safe_point
from restartkit.process.states import ALLOWED, ProcState


class NotReady(Exception):
    pass


class ProbeRefused(Exception):
    """The engine answered the readiness probe with a 4xx: it will not become ready by waiting."""

    def __init__(self, failure: HTTPFailure):
        super().__init__(str(failure))
        self.failure = failure


def refused(e: Exception) -> bool:
    """A 4xx to the readiness probe (not one that means "later": 408, 409, 425, 429)."""
    return isinstance(e, HTTPFailure) and e.status is not None and 400 <= e.status < 500 and e.status not in (
        408, 409, 425, 429)


class ExitedEarly(Exception):
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
    kept: bool = False  # popen is the engine's keeper (restartkit/process/keeper.py), which lives as long as it does
    # probe only once the ready byte came (or its pipe closed): on a held socket an engine accepts only
    # once ready, so a probe sent before would wait in the kernel's queue, blind to the engine's exit
    probe_after_signal: bool = False

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
                   signal_interval_s: float = 1.0, progress: Callable[[str], None] | None = None,
                   every_s: float = 15.0) -> float:
        """Probe until it passes; returns seconds waited.  Raises EngineStartError (state FATAL)
        when the process exits, the deadline passes or the probe is refused (a 4xx: at once).
        With a ready signal (ready_fd), probe when it comes (or every signal_interval_s, in case
        it never does) instead of every interval_s: no polling lag, and no stream of probes
        answered by an engine that is busy starting."""
        # long: one retry loop and the three ways it ends, each with its own error
        t0 = self.seam.clock()
        told = [t0]

        def attempt():
            if not self.alive():
                raise ExitedEarly()
            if progress is not None and self.seam.clock() - told[0] >= every_s:
                told[0] = self.seam.clock()
                progress(f"PID {self.pid}: still starting ({told[0] - t0:.0f} s of {timeout_s:.0f} s)")
            if self.probe_after_signal and self.ready_fd is not None and not self.ready_signalled:
                if self.state is ProcState.STARTING:
                    self.to(ProcState.BACKOFF)
                raise NotReady("it has not said it is ready yet")
            self.probes += 1
            try:
                probe()
            except Exception as e:
                if refused(e):
                    raise ProbeRefused(e) from None  # it answers, and says no: waiting will not change that
                if self.state is ProcState.STARTING:
                    self.to(ProcState.BACKOFF)
                raise NotReady(str(e)) from e
            if self.state is ProcState.BACKOFF:
                self.to(ProcState.STARTING)

        retrying = tenacity.Retrying(
            stop=lambda _state: self.seam.clock() - t0 >= timeout_s,  # the seam's clock, not tenacity's
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
        except ProbeRefused as e:
            self.to(ProcState.FATAL)
            raise self._refused_error(e.failure) from None
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

    def _refused_error(self, failure: HTTPFailure) -> EngineStartError:
        return EngineStartError(
            f"the engine (PID {self.pid}) refused restartkit's readiness probe: HTTP {failure.status}: {failure.message}",
            hint="the probe is a one-token greedy /v1/completions with model, prompt, max_tokens and temperature only: "
                 "check the model name the server expects ([service] served_model_name) and its flags; see the log: "
                 f"{self.log_path}", log_tail=log_tail(self.log_path))

    def _wait_signal(self, seconds: float) -> None:
        """Sleep until the engine's ready byte arrives, or `seconds`."""
        import select
        safe_point()
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
        frozen: list[int] = []

        def gone_or_frozen() -> bool:
            if not self.alive():
                return True
            if (p := stopped_in(self.pid)) is not None:
                frozen.append(p)
                return True
            return False
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
            if sig == signal.SIGTERM:
                # a frozen tree (SIGSTOP) drains nothing and answers nothing: killed at once, what it holds
                # failing fast, instead of hanging its clients for the whole stop timeout
                self.seam.wait_until(gone_or_frozen, wait_s)
                how = "stopped by SIGTERM"
                continue
            how = (f"frozen (PID {frozen[0]} stopped); killed without waiting for its stop timeout" if frozen
                   else f"did not stop within {timeout_s:.0f} s; killed")
            self.seam.wait_until(lambda: not self.alive(), wait_s)
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
