"""One engine process (restartkit.process.engine) against a fake seam: no processes, no real sleeping."""
import signal

import pytest

from restartkit.errors import EngineStartError
from restartkit.process.engine import EngineProcess, describe_exit
from restartkit.process.seam import Seam
from restartkit.process.states import ProcState


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


class FakePopen:
    def __init__(self, rc_after=None, rc=None):
        self.clock, self.rc_after, self.rc = None, rc_after, rc

    def poll(self):
        if self.rc_after is not None and self.clock() >= self.rc_after:
            return self.rc
        return None


def make(popen=None, kill=None):
    clock = FakeClock()
    seam = Seam(clock=clock, sleep=clock.sleep, kill=kill or (lambda pid, sig: None))
    if popen:
        popen.clock = clock
    return EngineProcess(pid=4242, popen=popen, seam=seam), clock


def test_ready_after_backoff():
    proc, clock = make(FakePopen())
    calls = []

    def probe():
        calls.append(clock.now)
        if len(calls) < 3:
            raise ConnectionRefusedError("not yet")

    waited = proc.wait_ready(probe, timeout_s=10, interval_s=0.5)
    assert proc.state is ProcState.READY
    assert waited == pytest.approx(1.0)
    assert [s for s, _ in proc.history] == ["backoff", "starting", "ready"]


def test_a_ready_signal_ends_the_wait_without_polling():
    """With the engine's ready pipe, restartkit probes when the byte comes, not every interval:
    here the fallback interval is a minute, and the wait still ends as soon as the engine writes."""
    import os
    import threading
    import time
    proc, clock = make(FakePopen())
    proc.ready_fd, w = os.pipe()
    ready = threading.Event()

    def probe():
        if not ready.is_set():
            raise ConnectionRefusedError("not yet")

    def engine():
        time.sleep(0.2)
        ready.set()
        os.write(w, b"R")
        os.close(w)
    threading.Thread(target=engine).start()
    t0 = time.monotonic()
    proc.wait_ready(probe, timeout_s=30, interval_s=0.01, signal_interval_s=60)
    assert time.monotonic() - t0 < 10
    assert proc.state is ProcState.READY and proc.ready_signalled
    assert proc.probes == 2  # one before the signal, one after it
    assert proc.ready_fd is None  # closed once the wait is over


def test_a_ready_pipe_closed_without_a_word_falls_back_to_polling():
    import os
    proc, clock = make(FakePopen())
    proc.ready_fd, w = os.pipe()
    os.close(w)  # e.g. an engine that closed it without writing

    def probe():
        if proc.probes < 4:
            raise ConnectionRefusedError("not yet")
    proc.wait_ready(probe, timeout_s=30, interval_s=0.01, signal_interval_s=60)
    assert proc.state is ProcState.READY and not proc.ready_signalled
    assert proc.probes == 4 and proc.ready_fd is None


def test_exit_during_start_is_fatal_with_a_reason():
    proc, clock = make(FakePopen(rc_after=1.0, rc=-signal.SIGKILL))
    with pytest.raises(EngineStartError) as e:
        proc.wait_ready(lambda: (_ for _ in ()).throw(OSError("refused")), timeout_s=10, interval_s=0.5)
    assert proc.state is ProcState.FATAL
    assert "killed by SIGKILL — out of memory?" in e.value.message


def test_deadline_is_fatal_and_names_the_knob():
    proc, clock = make(FakePopen())
    with pytest.raises(EngineStartError) as e:
        proc.wait_ready(lambda: (_ for _ in ()).throw(OSError("refused")), timeout_s=3, interval_s=0.5)
    assert proc.state is ProcState.FATAL
    assert "start_timeout_s" in e.value.hint


def test_stop_escalates_to_sigkill_after_the_deadline():
    sent = []
    popen = FakePopen()

    def kill(pid, sig):
        sent.append(sig)
        if sig == signal.SIGKILL:
            popen.rc_after, popen.rc = popen.clock(), -9

    proc, clock = make(popen, kill)
    proc.state = ProcState.READY
    how = proc.stop(timeout_s=2)
    assert sent == [signal.SIGTERM, signal.SIGKILL]
    assert "killed" in how and clock.now >= 2
    assert proc.state is ProcState.EXITED


def test_stop_of_a_gone_process_is_quiet():
    def kill(pid, sig):
        raise ProcessLookupError

    proc, _ = make(FakePopen(), kill)
    proc.state = ProcState.READY
    assert proc.stop() == "already gone"


def test_invalid_transition_is_refused():
    proc, _ = make(FakePopen())
    proc.state = ProcState.EXITED
    with pytest.raises(RuntimeError, match="not a valid transition"):
        proc.to(ProcState.READY)


def test_describe_exit():
    assert describe_exit(98).endswith("port is already in use")
    assert describe_exit(1) == "exited with code 1"
