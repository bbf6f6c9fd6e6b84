"""How supervise looks at the engine it watches: its exit through a pidfd, /health, a real completion, and
whether it is someone else's to judge (still starting, another command at work, put to sleep)."""
from __future__ import annotations

import select
import threading
import time

from restartkit.guard.lock import lock_holder
from restartkit.process.states import ProcState


class Probes:
    def __init__(self, service, cfg: dict, signals, lock_wait_s: float):
        self.service, self.cfg, self.signals, self.lock_wait_s = service, cfg, signals, lock_wait_s

    def wait(self, pidfd: int, timeout_s: float) -> bool:
        """True when the engine exited within `timeout_s`; returns early on a signal.  Each look
        blocks on the pidfd itself (up to 0.25 s), so an exit is seen the moment it happens."""
        exited = []

        def done() -> bool:
            if self.signals:
                return True
            if select.select([pidfd], [], [], 0.25)[0]:
                exited.append(True)
            return bool(exited)
        self.service.seam.wait_until(done, timeout_s, interval_s=0)
        return bool(exited)

    @staticmethod
    def unless_exited(pidfd: int, probe):
        """The probe's answer, or None when the engine exited first.  On the held socket a probe sent as
        the engine dies waits in the socket's queue, which nothing drains until supervise notices the
        death: the probe must not stand between the two (it would cost its whole timeout)."""
        answer = []
        worker = threading.Thread(target=lambda: answer.append(probe()), name="supervise-probe", daemon=True)
        worker.start()
        while worker.is_alive():
            if select.select([pidfd], [], [], 0.05)[0]:
                return None  # the probe thread ends at its own timeout; its answer is not waited for
        return answer[0] if answer else False

    def verdict(self, w, pidfd: int) -> str | None:
        """What is wrong with the running engine `w.proc` (None: nothing); `w` (commands.supervise.Watch) keeps
        the checks it missed in a row and its last completion.  Wrong: it exited while probed, missed health_misses
        health checks in a row, or completed nothing; not a hang when it was put to sleep through restartkit."""
        pid, what = w.proc.pid, None
        healthy = self.unless_exited(pidfd, self.healthy)
        if healthy is None:
            return f"the engine (PID {pid}) exited"
        w.misses = 0 if healthy else w.misses + 1
        if w.misses >= self.cfg["health_misses"]:
            what = f"the engine (PID {pid}) missed {w.misses} health checks in a row"
        elif time.monotonic() - w.last_completion >= self.cfg["completion_interval_s"]:
            self.service.engine.note_shm(w.proc)  # what it made in /dev/shm since: removed after a crash too
            if (completes := self.unless_exited(pidfd, self.completes)) is None:
                return f"the engine (PID {pid}) exited"
            if not completes:
                what = f"the engine (PID {pid}) completed nothing within {self.cfg['completion_timeout_s']:.0f} s"
            w.last_completion = time.monotonic()
        if what is not None and self.asleep(w.proc):  # `restartkit sleep`: no hang
            w.fresh()
            return None
        return what

    def busy(self, proc) -> bool:
        """Not ours to judge: the engine is still starting, or another command works on it (for as long
        as a restart may take: a command that holds the lock past that does not stop hang detection)."""
        if proc.state is not ProcState.READY:
            return True
        holder = lock_holder(self.service.state_dir)
        if holder is None:
            return False
        since = holder.get("since") if isinstance(holder.get("since"), (int, float)) else time.time()
        return time.time() - since < self.lock_wait_s

    def stale_intent(self) -> bool:
        """A command killed halfway left its intent, and no command holds the lock: reconcile it now."""
        return self.service.intent.read_stale() is not None and lock_holder(self.service.state_dir) is None

    def asleep(self, proc) -> bool:
        """Put to sleep through restartkit (`restartkit sleep`): not a hang; `restartkit wake` wakes it."""
        try:
            return bool(self.service.adapter.sleep_state(self.service.policy, proc.pid).get("asleep"))
        except Exception:
            return False

    def healthy(self) -> bool:
        try:
            self.service.adapter.health(self.service.policy, timeout=self.cfg["health_timeout_s"])
            return True
        except Exception:
            return False

    def completes(self) -> bool:
        return self.service.probe(timeout_s=self.cfg["completion_timeout_s"])[0]
