"""`restartkit supervise`: run in the foreground (a unit's or a container's main process),
start the engine (or adopt the one that serves), watch it, and bring it back through
`auto` when it crashes or hangs.

Watching: the engine's exit through a pidfd (no polling of /proc), `/health` every
[supervise] health_interval_s (health_misses misses in a row: hung), and a real completion
every completion_interval_s (an engine whose /health still says 200 but that completes
nothing is hung too).  A failure restarts with reason `crash` (sleep cannot serve it),
proven by the canary and recorded like every restart, with the time from noticing the
failure to serving again.  Too many failures within start_limit_interval_s
(start_limit_burst, as systemd's StartLimitIntervalSec/StartLimitBurst) -> the engine is
left stopped and supervise exits 1 with one line saying why, so that systemd or
Kubernetes takes over.  Failed attempts back off (backoff_s, doubling, at most
backoff_max_s).

Signals: SIGTERM/SIGINT end the work under way at its next safe point (a start, a restart, a wait
for another command's lock: what it started is killed, the record says so), then stop the engine
(the usual escalation) and exit 0, within stop_timeout_s and a few seconds; SIGHUP runs a planned
restart (reason `restart`; systemd's ExecReload).  systemd: with NOTIFY_SOCKET set, READY=1 once the
first canary passed, STOPPING=1 the moment a SIGTERM lands, RELOADING=1 for a SIGHUP's restart and
READY=1 after it, STATUS= after each change; with WATCHDOG_USEC, WATCHDOG=1 from a thread of its
own every WatchdogSec/4 as long as the main loop keeps within its step's budget, and
EXTEND_TIMEOUT_USEC while starting or stopping (restartkit.systemd.notify).  Another restartkit
command may restart the engine meanwhile: its new engine is adopted (STATUS= names it), not
treated as a crash.  State: supervisor.json in the state dir (`restartkit status` shows it).

The loop is named states (Phase) and their steps (Supervisor.STEPS): STARTING -> FINDING <-> WATCHING,
WATCHING -> RELOADING (SIGHUP) or RECOVERING (an exit, a hang); RECOVERING -> FINDING (a crash after
serving, restarted at once), BACKOFF (a failed start: wait, then restart) -> FINDING, or GAVE_UP (the start
limit) -> ENDED; a SIGTERM cuts whichever runs (Cut) and the engine is stopped.  What it is made of (the held
socket, the standby keeper, the start limit, the probes, supervisor.json) is in restartkit/supervision/.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import os
import signal
import time
from typing import Callable

from restartkit.commands.reconcile import guarded
from restartkit.errors import EXIT_SERVING
from restartkit.guard.preflight import preflight_writable
from restartkit.process.logfollow import LogFollower, wanted as log_wanted
from restartkit.process.procfs import kill_tree
from restartkit.process.seam import Cut, cuttable
from restartkit.supervision.starts import adopt_serving, cold_anyway
from restartkit.supervision.ending import give_up, stop_all
from restartkit.supervision.failure import noticed, replaced
from restartkit.supervision.guard import degradable
from restartkit.supervision.held import HeldSocket
from restartkit.supervision.probes import Probes
from restartkit.supervision.standby_keeper import StandbyKeeper
from restartkit.supervision.start_limit import StartLimit
from restartkit.supervision.state import SupervisorFile, one_supervisor
from restartkit.systemd.notify import Heartbeat, Notifier

EXIT_GAVE_UP = 1  # what systemd's Restart=on-failure and Kubernetes act on
FIRST_START = "the first start under supervise"  # the trigger of its record (the reason planned for: crash)


class Phase(enum.Enum):
    """supervise's states (supervisor's states.py, uvicorn's run loop): each step runs the state it is in
    and names the next; Supervisor.STEPS maps a state to its step."""
    STARTING = "starting"  # the first start: adopt the engine that serves, or start one through the restart flow
    FINDING = "finding"  # which process is the engine now (another command may have replaced it)
    WATCHING = "watching"  # one turn on it: its exit, a signal, health checks, a completion, the standby
    RELOADING = "reloading"  # SIGHUP: a planned restart
    RECOVERING = "recovering"  # a crash or a hang: recovered at once, after a backoff, or given up on
    BACKOFF = "backoff"  # failed starts in a row: wait (doubling), then restart
    GAVE_UP = "gave_up"  # the start limit reached: the engine stopped, supervise exits 1
    ENDED = "ended"  # supervise exits with Watch.exit_code


@dataclasses.dataclass
class Watch:
    """What one state hands the next: the engine watched, the health checks it missed in a row, when it
    last completed a request, the failure to recover from, the restart a backoff waits for, why supervise
    gave up, and the exit code once supervise ends."""
    proc: object = None
    last_pid: int | None = None  # the engine last watched (its keeper collects it when it dies)
    misses: int = 0
    last_completion: float = dataclasses.field(default_factory=time.monotonic)
    failure: tuple[str, int | None, int | None] | None = None  # what, a PID still to kill, a PID gone already
    failed_ticks: int | None = None  # the start time of the engine that failed (with its PID, names it)
    pending: tuple[int | None, dict] | None = None  # after the backoff: the PID to kill, the restart's trigger
    gave_up: str | None = None
    exit_code: int | None = None

    def fresh(self) -> None:
        """A new engine, or one that is not ours to judge yet: its checks start over."""
        self.misses, self.last_completion = 0, time.monotonic()


class Supervisor:
    def __init__(self, service, say: Callable[[str], None] = print, notifier: Notifier | None = None):
        from restartkit.restart import plan_for, restart  # the restart flow (strategies through its registry)
        self.service, self.say, self.plan_for, self.restart = service, say, plan_for, restart
        self.notify = notifier or Notifier()
        self.cfg = service.policy.supervise
        self.signals: collections.deque[int] = collections.deque()
        self.interval = min(self.cfg["health_interval_s"], (self.notify.watchdog_s or float("inf")) / 2)
        self.beat = Heartbeat(self.notify)
        r = service.policy.restart
        self.lock_wait_s = r["stop_timeout_s"] + r["start_timeout_s"] + 60  # another command's restart, at most
        # the longest one turn of the watch loop may take: a wait, a health check and a completion
        self.probe_budget_s = self.interval + self.cfg["health_timeout_s"] + self.cfg["completion_timeout_s"] + 10
        self.file = SupervisorFile(service, say)
        self.path = self.file.path
        self.limit = StartLimit(self.cfg)
        self.held = HeldSocket(service, say)
        self.standby = StandbyKeeper(service, say, changed=lambda: self._save("serving"), guarded=guarded)
        self.probes = Probes(service, self.cfg, self.signals, self.lock_wait_s)

    def run(self) -> int:
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, self._on_signal)
        preflight_writable(self.service.state_dir)
        only = one_supervisor(self.service)
        from restartkit.standby.armed import stop_orphaned
        stop_orphaned(self.service, self.say)  # before the port is bound: an orphaned standby holds it
        self.held.hold()
        self.beat.step(self.lock_wait_s, Heartbeat.STARTING)
        self.beat.start()
        follower = LogFollower(self.service.engine.log_path).start() if log_wanted() else None
        try:
            # SIGTERM/SIGINT end whatever runs at its next wait (a start, a restart, a lock wait), then the stop
            with cuttable(lambda: next(iter(self.service.interrupts), None)):
                return self._run_states()
        except Cut as cut:
            return self._stop(cut.name)
        finally:
            self.beat.stop()
            if follower is not None:
                follower.stop()
            self.path.unlink(missing_ok=True)
            self.held.close()
            os.close(only)

    def _on_signal(self, signum: int, _frame) -> None:
        """The handler: queue it; a termination also cuts the work under way (restartkit.process.seam)
        and tells systemd at once (a datagram on a new socket: nothing shared with the main thread)."""
        self.signals.append(signum)
        if signum != signal.SIGHUP:
            self.service.interrupts.append(signum)
            self.notify.send("STOPPING=1")

    def _run_states(self) -> int:
        w, phase = Watch(), Phase.STARTING
        while phase is not Phase.ENDED:
            phase = self.STEPS[phase](self, w)
        return w.exit_code

    def _starting(self, w: Watch) -> Phase:
        if not self._first_start():
            w.gave_up = "the engine did not start"
            return Phase.GAVE_UP
        self.beat.step(self.probe_budget_s, Heartbeat.RUNNING)
        self.notify.send("READY=1", self._status())
        try:  # a crash restart planned once, for nothing: the first real one finds the modules and libraries loaded
            self.plan_for(self.service, "auto", "crash")
        except Exception:
            pass
        w.fresh()  # its checks count from now, not from before the start
        return Phase.FINDING

    def _finding(self, w: Watch) -> Phase:
        self.beat.step(self.probe_budget_s)
        self.service.engine.reap()
        w.proc = self.service.current()
        if w.proc is None:  # gone between two looks (before its pidfd was open), or never came back
            what = f"the engine (PID {w.last_pid}) exited" if w.last_pid else "the engine is not running"
            w.failure, w.last_pid = (what, None, w.last_pid), None  # its keeper collected it
            return Phase.RECOVERING
        w.last_pid = w.proc.pid
        return Phase.WATCHING

    def _watching(self, w: Watch) -> Phase:
        """One turn on the engine `w.proc` through its pidfd: its exit, a signal, its health and, every
        completion_interval_s, a real completion."""
        try:
            pidfd = os.pidfd_open(w.proc.pid)
        except ProcessLookupError:
            return Phase.FINDING
        try:
            exited = self.probes.wait(pidfd, self.interval)
            if self.signals:
                if (sig := self.signals.popleft()) == signal.SIGHUP:
                    return Phase.RELOADING
                raise Cut(sig)
            if not exited and self._not_ours(w):
                return Phase.FINDING
            what = f"the engine (PID {w.proc.pid}) exited" if exited else self.probes.verdict(w, pidfd)
        finally:
            os.close(pidfd)
        if what is None:
            return Phase.FINDING
        w.failure, w.failed_ticks = (what, w.proc.pid, None), w.proc.start_ticks
        return Phase.RECOVERING

    def _not_ours(self, w: Watch) -> bool:
        """Not ours to judge this turn: another command works on it, or left work a reconcile finishes now (a
        command killed halfway: an engine that gave up the held socket for a dump is taken back, not replaced).
        Otherwise the standby is kept armed and an engine another command started is adopted."""
        busy = self.probes.busy(w.proc)
        if not busy and self.probes.stale_intent():
            with self._guarded("supervise"):  # the reconcile, as the next command would run it
                busy = True
        if busy:
            w.fresh()
            return True
        self.standby.keep()
        if w.proc.pid != self.file.serving_pid:
            self.say(f"{self.service.policy.name}: PID {w.proc.pid} serves now (started by another command); adopted")
            self._save("serving")
        return False

    def _reloading(self, w: Watch) -> Phase:
        """SIGHUP (systemd's ExecReload): RELOADING=1 until the planned restart is done, then READY=1."""
        self.say(f"{self.service.policy.name}: SIGHUP: a planned restart")
        self.beat.step(self.lock_wait_s)
        self.notify.reloading()
        self._restart("restart", {"by": "supervise", "what": "SIGHUP", "noticed_at": time.time()})
        self.notify.send("READY=1", self._status())
        return Phase.FINDING

    def _recovering(self, w: Watch) -> Phase:
        """A crash or a hang: a crash after serving is restarted at once (the start limit starts over); a
        failed start counts towards the limit and waits its backoff."""
        (what, pid, died), ticks = w.failure, w.failed_ticks
        w.failure, w.failed_ticks = None, None
        w.fresh()  # not serving after it: the next turn finds nothing running, another failure, with backoff
        engine = pid if pid is not None else died
        trigger = noticed(self.service, self.say, what, engine)
        self.beat.step(self.lock_wait_s + self.cfg["backoff_max_s"] + self.service.policy.restart["stop_timeout_s"])
        if replaced(self.service, self._guarded, self.say, pid, ticks):
            self._save("serving")
            return Phase.FINDING
        served_s = time.monotonic() - self.file.serving_since
        if engine is not None and engine == self.file.serving_pid and served_s >= self.cfg["min_uptime_s"]:
            self.limit.clear()  # a crash while serving, not a failed start: the crash loop before it is over
            self.say(f"{self.service.policy.name}: it had served {served_s:.0f} s ([supervise] min_uptime_s = "
                     f"{self.cfg['min_uptime_s']:g}): recovering at once")
            self._kill_and_restart(pid, trigger)
            return Phase.FINDING
        self.limit.note(trigger["noticed_at"])
        if self.limit.exceeded():
            w.gave_up = (f"{len(self.limit)} failures within {self.limit.window:.0f} s ([supervise] start_limit_burst "
                         f"= {self.limit.burst}); last: {what}")
            return Phase.GAVE_UP
        w.pending = (pid, trigger)
        return Phase.BACKOFF

    def _backoff(self, w: Watch) -> Phase:
        (pid, trigger), w.pending = w.pending, None
        if pause := self.limit.backoff_s():
            self.say(f"{self.service.policy.name}: backing off {pause:.1f} s ({len(self.limit)} failures within "
                     f"{self.limit.window:.0f} s)")
            if self._sleep(pause):
                raise Cut(self.signals.popleft())
        self._kill_and_restart(pid, trigger)
        return Phase.FINDING

    def _gave_up(self, w: Watch) -> Phase:
        w.exit_code = self._give_up(w.gave_up)
        return Phase.ENDED

    STEPS = {Phase.STARTING: _starting, Phase.FINDING: _finding, Phase.WATCHING: _watching,
             Phase.RELOADING: _reloading, Phase.RECOVERING: _recovering, Phase.BACKOFF: _backoff,
             Phase.GAVE_UP: _gave_up}

    def _first_start(self) -> bool:
        """Adopt the engine that serves; else start it through the restart flow, as after a crash: the best
        eligible strategy's start path (a warm weight cache attaches instead of a second copy loading from
        disk, a tested snapshot restores), its proof, and its record in history.jsonl (FIRST_START)."""
        if adopt_serving(self.service, self._guarded, self.say):
            self._save("serving")
            return True
        rec = self._restart("crash", {"by": "supervise", "what": FIRST_START, "noticed_at": time.time()},
                            command="supervise start")
        if rec.final_state != "serving":
            errors = [a["error"] for a in rec.attempts if a.get("error") and not a.get("skipped")]
            self.say(f"{self.service.policy.name}: the engine did not start: {errors[-1] if errors else rec.recovery_reason}")
        return rec.final_state == "serving"

    def _kill_and_restart(self, pid: int | None, trigger: dict) -> None:
        if pid is not None:
            kill_tree(pid)  # a hung engine is declared dead: nothing it does now can be trusted
            self.service.seam.reap_until_gone([pid], self.service.policy.restart["stop_timeout_s"])
        self._restart("crash", trigger)

    def _restart(self, reason: str, trigger: dict, command: str | None = None):
        svc = self.service
        self.notify.send(f"STATUS={'starting' if trigger['what'] == FIRST_START else f'restarting ({reason})'}: "
                         f"{trigger['what']}")
        try:
            with self._guarded(command or f"supervise restart ({reason})"):
                if svc.engine.degraded:  # the restart flow writes its intent and records: a plain start instead
                    raise RuntimeError("the state dir cannot be written")
                rec = self.restart(svc, "auto", reason=reason, say=self.say, trigger=trigger)
        except Exception as e:
            why = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
            self.say(f"{svc.policy.name}: the restart could not run: {why}")
            rec = cold_anyway(svc, self._guarded, reason, trigger, why, self.say)
        self.held.offer()
        if trigger["what"] != FIRST_START:  # supervisor.json's restarts: those after the first start
            self.file.note_restart(reason, trigger["what"], rec)
        noticed_s = (rec.trigger or {}).get("noticed_to_serving_s")
        self.say(f"{svc.policy.name}: {rec.final_state}" + (f" by {rec.served_by}" if rec.served_by else "")
                 + (f" {noticed_s:.2f} s after the failure was noticed" if noticed_s is not None else ""))
        self._save(rec.final_state)
        return rec

    def _stop(self, why: str) -> int:
        self.beat.step(self.service.policy.restart["stop_timeout_s"] + 30, Heartbeat.STOPPING)
        self.notify.send("STOPPING=1", f"STATUS=stopping ({why})")
        stop_all(self.service, self._guarded, self.say, why)
        return EXIT_SERVING

    def _give_up(self, why: str) -> int:
        self.notify.send(f"STATUS={give_up(self.service, self._guarded, self.say, why)}")
        return EXIT_GAVE_UP

    def _sleep(self, seconds: float) -> bool:
        """Sleep, or stop early on SIGTERM/SIGINT (True); a SIGHUP during a backoff waits its turn."""
        if not self.service.seam.wait_until(lambda: any(s != signal.SIGHUP for s in self.signals), seconds, 0.1):
            return False
        while self.signals and self.signals[0] == signal.SIGHUP:
            self.signals.popleft()
        return True

    def _guarded(self, command: str):
        """supervise's guard: the usual one, or none while the state dir cannot be written (degradable)."""
        return degradable(self.service, guarded, command, self.lock_wait_s, self.say)

    def _status(self) -> str:
        return self.file.status(len(self.limit), self.limit.window)

    def _save(self, state: str) -> None:
        """supervisor.json, and systemd's STATUS= line."""
        self.file.save(state, self.limit.within(time.time()), self.limit.window, self.held.describe(),
                       self.standby.summary())
        self.notify.send(self._status())
