"""supervisor.json in the state dir: what supervise is doing, for `restartkit status` and `restartkit stop`."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import time
from typing import Callable

from restartkit.files import write_json_atomic
from restartkit.guard.lock import BusyError
from restartkit.process.procfs import argv, holder_alive, proc_start_ticks


class SupervisorFile:
    def __init__(self, service, say: Callable[[str], None]):
        self.service, self.say = service, say
        self.path = service.state_dir / "supervisor.json"
        self.started_at = time.time()
        self.history: list[dict] = []  # its restarts after the first start
        self.serving_pid: int | None = None  # the engine supervise last saw serving (another one: adopted)
        self.serving_since = time.monotonic()  # when it began to serve

    def note_restart(self, reason: str, what: str, rec) -> None:
        self.history.append({"at": time.time(), "reason": reason, "what": what, "served_by": rec.served_by,
                             "final_state": rec.final_state, "time_to_ready_s": rec.time_to_ready_s,
                             "record": rec.id, "noticed_to_serving_s": (rec.trigger or {}).get("noticed_to_serving_s")})

    def status(self, failures: int, window_s: float) -> str:
        """systemd's STATUS= line."""
        proc = self.service.current()
        last = self.history[-1] if self.history else None
        text = f"serving PID {proc.pid}" if proc else "no engine"
        text += f"; {failures} failure(s) in the last {window_s:.0f} s"
        if last:
            text += f"; last restart ({last['reason']}): {last['served_by']} in {last['time_to_ready_s']} s"
        return f"STATUS={text}"

    def save(self, state: str, failures: int, window_s: float, listener: dict | None, standby: dict) -> None:
        proc = self.service.current()
        serving = proc.pid if proc is not None and state == "serving" else None
        if serving != self.serving_pid:
            self.serving_since = time.monotonic()
        self.serving_pid = serving
        try:
            write_json_atomic(self.path, {
                "pid": os.getpid(), "start_ticks": proc_start_ticks(os.getpid()), "started_at": self.started_at,
                "state": state, "failures_in_interval": failures, "interval_s": window_s,
                "restarts": self.history[-20:], "listener": listener, "standby": standby})
        except OSError as e:
            self.say(f"restartkit supervise: could not write {self.path} ({e.strerror or e})")


def read_state(state_dir) -> dict | None:
    """The supervisor's state, when one runs for this service."""
    try:
        data = json.loads((state_dir / "supervisor.json").read_text())
    except (OSError, ValueError):
        return None
    return data if holder_alive(data) else None


def stop_supervisor(state_dir, timeout_s: float, say: Callable[[str], None]) -> dict | None:
    """`restartkit stop` under a supervisor: ask the supervisor to stop (its own SIGTERM: it stops the
    engine and exits 0, so neither it nor its unit takes the stop for a crash); returns its state,
    None when no supervisor runs.  RuntimeError when it did not exit within `timeout_s`."""
    from restartkit.process.seam import Seam
    sup = read_state(state_dir)
    if sup is None:
        return None
    if "supervise" not in argv(sup["pid"]):  # signal only a process that is a supervisor, whatever a file says
        say(f"{state_dir / 'supervisor.json'} names PID {sup['pid']}, which is not `restartkit supervise`: ignored")
        return None
    say(f"the engine is supervised by PID {sup['pid']} (restartkit supervise): stopping it through its supervisor")
    try:
        os.kill(sup["pid"], signal.SIGTERM)
    except ProcessLookupError:
        return sup
    if not Seam().wait_until(lambda: not holder_alive(sup), timeout_s, 0.1):
        raise RuntimeError(f"the supervisor (PID {sup['pid']}) did not exit within {timeout_s:.0f} s")
    return sup


def one_supervisor(service) -> int:
    """One supervisor per service: a lock held for supervise's whole life (closing the descriptor releases it)."""
    fd = os.open(service.state_dir / "supervise.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        other = read_state(service.state_dir) or {}
        raise BusyError(f"{service.policy.name} is supervised already (PID {other.get('pid', '?')} runs "
                        "`restartkit supervise`)", hint="one supervisor per service: stop that one first") from None
    return fd
