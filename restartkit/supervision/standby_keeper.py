"""[standby] enabled under supervise: one standby kept armed beside the engine.  One that is gone, failed or
stale is replaced (not more than every few seconds: one that keeps failing does not take the engine's CPUs),
and the time the service was without a prepared standby is measured (`rearm_s`)."""
from __future__ import annotations

import time
from typing import Callable

from restartkit.guard.lock import BusyError

RETRY_S = 5.0  # between two tries to arm one


class StandbyKeeper:
    def __init__(self, service, say: Callable[[str], None], changed: Callable[[], None], guarded):
        """`changed`: called when a standby got armed; `guarded`: every command's guard (restartkit.commands.reconcile)."""
        self.service, self.say, self.changed, self.guarded = service, say, changed, guarded
        self.since: float | None = None  # without a prepared standby since (monotonic)
        self.next_try = 0.0
        self.rearm_s: list[float] = []
        self.armed: int | None = None
        self.refused: str | None = None

    def summary(self) -> dict:
        return {"armed": self.armed, "rearm_s": self.rearm_s}

    def keep(self) -> None:
        from restartkit.standby.armed import cannot_stand_by, frozen, stale, state
        svc = self.service
        if not svc.policy.standby["enabled"] or svc.engine.degraded:
            return
        if why := cannot_stand_by(svc.policy):  # said once; no process spawned to be refused
            if not self.refused:
                self.refused = why
                self.say(f"{svc.policy.name}: [standby] enabled, but no standby is armed: {why}")
            return
        rec = state(svc)
        if rec is not None and rec["state"] in ("prepared", "starting", "preparing") and rec["alive"]:
            if rec["state"] == "prepared" and self.since is not None:
                self._armed(rec["pid"])
            if rec.get("engine_state") == "active" and rec.get("kv_ahead") and not rec.get("canary"):
                self._canary_ahead()
            # a stopped one (not probed here: a silent port would cost this loop a second a turn) or a stale one
            if rec["state"] != "prepared" or not (why := frozen(rec, probe=False) or stale(svc, rec)):
                return
            self.say(f"{svc.policy.name}: standby PID {rec['pid']} cannot be promoted ({why}); replacing it")
        if self.since is None:
            self.since, self.armed = time.monotonic(), None
            self._metric(False)
        if time.monotonic() >= self.next_try:
            self._replace(rec)

    def _armed(self, pid: int) -> None:
        self.rearm_s = [*self.rearm_s[-19:], round(time.monotonic() - self.since, 3)]
        self.since, self.armed = None, pid
        self.say(f"{self.service.policy.name}: standby PID {pid} armed ({self.rearm_s[-1]:.2f} s without one)")
        self.changed()
        self._metric(True, self.rearm_s[-1])

    def _replace(self, rec: dict | None) -> None:
        """The standby `rec` (gone, failed, stale or frozen) stopped or cleared, and a new one armed."""
        from restartkit.standby.armed import arm, consumed, disarm, frozen
        svc = self.service
        self.next_try = time.monotonic() + RETRY_S
        try:
            with self.guarded(svc, "supervise standby", 0.0, lambda _m: None, defer_signals=False):
                if rec is not None and rec["alive"]:
                    disarm(svc, timeout_s=0.5 if frozen(rec, probe=False) else 10.0)  # a stopped one ignores SIGTERM
                elif rec is not None:
                    consumed(svc)
                arm(svc)
        except BusyError:
            self.next_try = 0.0  # another command works on the service: the next turn tries again
        except Exception as e:
            self.say(f"{svc.policy.name}: could not arm a standby: {getattr(e, 'message', None) or e}")

    def _canary_ahead(self) -> None:
        """The armed standby answers the canary ahead (restartkit.standby.armed.canary_ahead), under the lock."""
        from restartkit.standby.armed import canary_ahead
        try:
            with self.guarded(self.service, "supervise standby", 0.0, lambda _m: None, defer_signals=False):
                canary_ahead(self.service)
        except BusyError:
            pass  # another command works on the service: the next turn asks again
        except Exception as e:  # the promotion then takes its canary on the public port, as without one ahead
            self.say(f"{self.service.policy.name}: the standby's canary ahead failed: {getattr(e, 'message', None) or e}")

    def _metric(self, armed: bool, rearm_s: float | None = None) -> None:
        from restartkit.record import note_standby, textfile
        try:
            note_standby(self.service.state_dir, self.service.policy.name, armed, rearm_s,
                         textfile(self.service.policy, "restarts"))
        except OSError:
            pass  # metrics never stop supervision
