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
WATCHING -> RELOADING (SIGHUP) or RECOVERING (an exit, a hang) -> FINDING, or ENDED (given up); a
SIGTERM cuts whichever runs (Cut) and the engine is stopped.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import fcntl
import os
import select
import signal
import threading
import time
from typing import Callable

from restartkit.errors import EXIT_SERVING, UsageError
from restartkit.files import write_json_atomic
from restartkit.commands.reconcile import guarded
from restartkit.systemd.notify import Heartbeat, Notifier
from restartkit.guard.lock import BusyError, lock_holder
from restartkit.guard.preflight import preflight_writable
from restartkit.process.logfollow import LogFollower, wanted as log_wanted
from restartkit.process.procfs import argv, holder_alive, kill_tree, proc_start_ticks
from restartkit.process.seam import Cut, cuttable
from restartkit.process.states import ProcState

EXIT_GAVE_UP = 1
FIRST_START = "the first start under supervise"  # the trigger of its record (the reason planned for: crash)  # what systemd's Restart=on-failure and Kubernetes act on



class Phase(enum.Enum):
    """supervise's states (supervisor's states.py, uvicorn's run loop): each step runs the state it is in
    and names the next; Supervisor.STEPS maps a state to its step."""
    STARTING = "starting"  # the first start: adopt the engine that serves, or start one through the restart flow
    FINDING = "finding"  # which process is the engine now (another command may have replaced it)
    WATCHING = "watching"  # one turn on it: its exit, a signal, health checks, a completion, the standby
    RELOADING = "reloading"  # SIGHUP: a planned restart
    RECOVERING = "recovering"  # a crash or a hang: recovered at once, after a backoff, or given up on
    ENDED = "ended"  # supervise exits with Watch.exit_code


@dataclasses.dataclass
class Watch:
    """What one state hands the next: the engine watched, the health checks it missed in a row, when it
    last completed a request, the failure to recover from, and the exit code once supervise ends."""
    proc: object = None
    last_pid: int | None = None  # the engine last watched (its keeper collects it when it dies)
    misses: int = 0
    last_completion: float = dataclasses.field(default_factory=time.monotonic)
    failure: tuple[str, int | None, int | None] | None = None  # what, a PID still to kill, a PID gone already
    failed_ticks: int | None = None  # the start time of the engine that failed (with its PID, names it)
    exit_code: int | None = None

    def fresh(self) -> None:
        """A new engine, or one that is not ours to judge yet: its checks start over."""
        self.misses, self.last_completion = 0, time.monotonic()


class Supervisor:
    def __init__(self, service, say: Callable[[str], None] = print, notifier: Notifier | None = None):
        from restartkit.restart import plan_for, restart  # the restart flow (strategies through its registry)
        self.service, self.say = service, say
        self.plan_for = plan_for
        self.notify = notifier or Notifier()
        self.cfg = service.policy.supervise
        self.restart = restart
        self.signals: collections.deque[int] = collections.deque()
        self.failures: collections.deque[float] = collections.deque()  # when each failure was noticed
        self.history: list[dict] = []
        self.started_at = time.time()
        self.path = service.state_dir / "supervisor.json"
        self.interval = self.cfg["health_interval_s"]
        if self.notify.watchdog_s:
            self.interval = min(self.interval, self.notify.watchdog_s / 2)
        self.beat = Heartbeat(self.notify)
        self._serving_pid: int | None = None  # the engine supervise last saw serving (another one: adopted)
        self._serving_since = time.monotonic()  # when it began to serve
        self.standby = {"since": None, "next_try": 0.0, "rearm_s": [], "armed": None}  # unprotected since, ...

    # ---- the loop ------------------------------------------------------------------
    def run(self) -> int:
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, self._on_signal)
        preflight_writable(self.service.state_dir)
        self._only = self._one_supervisor()
        self.broker = None
        from restartkit.standby.armed import stop_orphaned
        stop_orphaned(self.service, self.say)  # before the port is bound: an orphaned standby holds it
        self._hold_listener()
        self.beat.step(self._lock_wait(), Heartbeat.STARTING)
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
            if self.broker is not None:
                self.broker.close()
            os.close(self._only)

    def _hold_listener(self) -> None:
        """The service's listening socket, held here for as long as supervise runs, so that it outlives
        every engine: systemd's (socket activation) or bound here (restartkit.process.listener).  An
        engine found serving on a socket of its own keeps it; the port is held once that one is gone."""
        from restartkit.process import listener
        svc, s = self.service, self.service.policy.service
        passed = listener.from_systemd()
        if not getattr(svc.adapter, "serves_on_socket", False):
            if passed is not None:
                raise UsageError(f"{svc.adapter.label} cannot serve on the socket systemd passed (LISTEN_FDS)",
                                 hint="start this service without its .socket unit; it binds the port itself")
            return
        if passed is not None:
            if why := listener.matches(passed, s["host"], s["port"]):
                raise UsageError(f"{why}", hint=f"make the .socket unit's ListenStream= the policy's address "
                                                f"({s['host']}:{s['port']}) or change {svc.policy.path}")
            svc.engine.held = passed
        else:
            svc.engine.hold = True
            svc.engine.listener()
        self._broker_up()

    def _broker_up(self) -> None:
        """Once a socket is held: announce it (supervisor.json) and hand it to restartkit's other commands."""
        from restartkit.process import listener
        held = self.service.engine.held
        if held is None or self.broker is not None:
            return
        try:
            self.broker = listener.Broker(self.service.state_dir, held)
        except listener.ListenerError as e:  # an engine would take its socket back from a squatter: refused
            raise UsageError(f"cannot start: {e.strerror}",
                             hint="stop the other supervise of this service (restartkit status names it), or the "
                                  "process that holds the name") from None
        except OSError as e:
            self.say(f"restartkit supervise: cannot offer the held socket to other commands ({e.strerror or e}); "
                     "a `restartkit restart` run beside supervise binds the port itself")
        d = held.describe()
        self.say(f"{self.service.policy.name}: holding {d['address']} ({d['source']}; up to {d['backlog']} "
                 "connections wait in its queue while no engine accepts)")

    def _on_signal(self, signum: int, _frame) -> None:
        """The handler: queue it; a termination also cuts the work under way (restartkit.process.seam)
        and tells systemd at once (a datagram on a new socket: nothing shared with the main thread)."""
        self.signals.append(signum)
        if signum != signal.SIGHUP:
            self.service.interrupts.append(signum)
            self.notify.send("STOPPING=1")

    def _one_supervisor(self) -> int:
        """One supervisor per service: a lock held for supervise's whole life (closing it releases it)."""
        path = self.service.state_dir / "supervise.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            other = read_state(self.service.state_dir) or {}
            raise BusyError(f"{self.service.policy.name} is supervised already (PID {other.get('pid', '?')} runs "
                            "`restartkit supervise`)", hint="one supervisor per service: stop that one first") from None
        return fd

    def _warm_up(self) -> None:
        """Plan a crash restart once, for nothing, while the engine serves: the first real one then
        finds the strategies' modules imported and the host's libraries (NVML, CRIU's checks) loaded
        instead of paying for them between the crash and the restart."""
        try:
            self.plan_for(self.service, "auto", "crash")
        except Exception:
            pass

    def _run_states(self) -> int:
        w, phase = Watch(), Phase.STARTING
        while phase is not Phase.ENDED:
            phase = self.STEPS[phase](self, w)
        return w.exit_code

    def _starting(self, w: Watch) -> Phase:
        if not self._first_start():
            w.exit_code = self._give_up("the engine did not start")
            return Phase.ENDED
        self.beat.step(self._probe_budget(), Heartbeat.RUNNING)
        self.notify.send("READY=1", self._status())
        self._warm_up()
        w.fresh()  # its checks count from now, not from before the start
        return Phase.FINDING

    def _finding(self, w: Watch) -> Phase:
        self.beat.step(self._probe_budget())
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
            exited = self._wait(pidfd, self.interval)
            if self.signals:
                sig = self.signals.popleft()
                if sig == signal.SIGHUP:
                    return Phase.RELOADING
                raise Cut(sig)
            if not exited and self._busy(w.proc):  # another command is restarting it, or it is still starting
                w.fresh()
                return Phase.FINDING
            if not exited and self._reconcile_stale():
                w.fresh()
                return Phase.FINDING
            if not exited:
                self._keep_standby()
                self._adopt(w.proc)
            what = f"the engine (PID {w.proc.pid}) exited" if exited else self._verdict(w, pidfd)
        finally:
            os.close(pidfd)
        if what is None:
            return Phase.FINDING
        w.failure = (what, w.proc.pid, None)
        w.failed_ticks = w.proc.start_ticks
        return Phase.RECOVERING

    def _verdict(self, w: Watch, pidfd: int) -> str | None:
        """What is wrong with the running engine (None: nothing): it exited while probed, missed health_misses
        health checks in a row, or completed nothing; not a hang when it was put to sleep through restartkit."""
        proc = w.proc
        healthy = self._unless_exited(pidfd, self._healthy)
        if healthy is None:
            return f"the engine (PID {proc.pid}) exited"
        w.misses = 0 if healthy else w.misses + 1
        what = None
        if w.misses >= self.cfg["health_misses"]:
            what = f"the engine (PID {proc.pid}) missed {w.misses} health checks in a row"
        elif time.monotonic() - w.last_completion >= self.cfg["completion_interval_s"]:
            self.service.engine.note_shm(proc)  # what it made in /dev/shm since: removed after a crash too
            completes = self._unless_exited(pidfd, self._completes)
            if completes is None:
                return f"the engine (PID {proc.pid}) exited"
            if not completes:
                what = f"the engine (PID {proc.pid}) completed nothing within {self.cfg['completion_timeout_s']:.0f} s"
            w.last_completion = time.monotonic()
        if what is not None and self._asleep(proc):  # `restartkit sleep`: no hang
            w.fresh()
            return None
        return what

    def _adopt(self, proc) -> None:
        """Another command restarted the engine, and it serves: ours from now on."""
        if proc.pid != self._serving_pid:
            self.say(f"{self.service.policy.name}: PID {proc.pid} serves now (started by another command); adopted")
            self._save("serving")
            self.notify.send(self._status())

    def _reloading(self, w: Watch) -> Phase:
        self._planned_restart()
        return Phase.FINDING

    def _recovering(self, w: Watch) -> Phase:
        what, pid, died = w.failure
        w.failure = None
        w.exit_code = self._failure(what, pid, died, w.failed_ticks)
        w.failed_ticks = None
        w.fresh()  # not serving after it: the next turn finds nothing running, another failure, with backoff
        return Phase.FINDING if w.exit_code is None else Phase.ENDED

    STEPS = {Phase.STARTING: _starting, Phase.FINDING: _finding, Phase.WATCHING: _watching,
             Phase.RELOADING: _reloading, Phase.RECOVERING: _recovering}

    def _unless_exited(self, pidfd: int, probe):
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

    def _wait(self, pidfd: int, timeout_s: float) -> bool:
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

    # ---- probes --------------------------------------------------------------------
    def _busy(self, proc) -> bool:
        """Not ours to judge: the engine is still starting, or another command works on it (for as long
        as a restart may take: a command that holds the lock past that does not stop hang detection)."""
        if proc.state is not ProcState.READY:
            return True
        holder = lock_holder(self.service.state_dir)
        if holder is None:
            return False
        since = holder.get("since") if isinstance(holder.get("since"), (int, float)) else time.time()
        return time.time() - since < self._lock_wait()

    def _reconcile_stale(self) -> bool:
        """A command killed halfway left its intent (its lock is free): reconciled now, as the next command would,
        not after the engine it left misses its checks (one that gave up the held socket for a dump, or was left
        frozen by CRIU, is taken back and adopted, not replaced)."""
        if self.service.intent.read_stale() is None or lock_holder(self.service.state_dir) is not None:
            return False
        with self._guarded("supervise"):
            pass
        return True

    def _asleep(self, proc) -> bool:
        """Put to sleep through restartkit (`restartkit sleep`): not a hang; `restartkit wake` wakes it."""
        try:
            return bool(self.service.adapter.sleep_state(self.service.policy, proc.pid).get("asleep"))
        except Exception:
            return False

    def _healthy(self) -> bool:
        try:
            self.service.adapter.health(self.service.policy, timeout=self.cfg["health_timeout_s"])
            return True
        except Exception:
            return False

    def _completes(self) -> bool:
        return self.service.probe(timeout_s=self.cfg["completion_timeout_s"])[0]

    # ---- actions -------------------------------------------------------------------
    def _first_start(self) -> bool:
        """Adopt the engine that serves; else start it through the restart flow, as after a crash: the best
        eligible strategy's start path (a warm weight cache attaches instead of a second copy loading from
        disk, a tested snapshot restores), its proof, and its record in history.jsonl (FIRST_START)."""
        svc = self.service
        with guarded(svc, "supervise", self._lock_wait(), self.say, defer_signals=False):
            proc = svc.current()
            if proc is not None and svc.is_ready():
                svc.canary()
                self.say(f"{svc.policy.name}: adopted the serving engine (PID {proc.pid})" + (
                    "; it listens on a socket of its own: until it is replaced, a crash refuses connections"
                    if svc.engine.hold and svc.engine.held is None else ""))
                self._save("serving")
                return True
            if proc is not None:
                svc.engine.stop()  # running, not answering: what replaces it starts on a free port
        rec = self._restart("crash", {"by": "supervise", "what": FIRST_START, "noticed_at": time.time()},
                            command="supervise start")
        if rec is not None and rec.final_state != "serving":
            errors = [a["error"] for a in rec.attempts if a.get("error") and not a.get("skipped")]
            self.say(f"{svc.policy.name}: the engine did not start: {errors[-1] if errors else rec.recovery_reason}")
        return rec is not None and rec.final_state == "serving"

    def _failure(self, what: str, pid: int | None, died: int | None = None, ticks: int | None = None) -> int | None:
        """A crash or a hang of the engine `pid` (still to be killed) or `died` (gone already), `ticks` its start
        time: restart through auto unless the limit is reached (then the exit code)."""
        noticed = time.time()
        from restartkit.process.inflight import at_death
        engine = pid if pid is not None else died
        lost = at_death(self.service.state_dir, engine) if engine is not None else None
        if lost:
            self.say(f"{self.service.policy.name}: {lost} request(s) in flight on it are lost")
        if swept := self.service.engine.sweep_gone():  # before the next engine makes its own
            self.say(f"{self.service.policy.name}: removed {len(swept)} file(s) it left in /dev/shm")
        self.beat.step(self._lock_wait() + self.cfg["backoff_max_s"] + self.service.policy.restart["stop_timeout_s"])
        self.say(f"{self.service.policy.name}: {what}")
        # another restartkit command may be restarting the engine: wait for its lock, then look again
        with self._guarded("supervise"):
            proc = self.service.current()
            # another engine: another PID, or the same PID started anew (a CRIU restore brings the old PID back)
            other = proc is not None and (proc.pid != pid or ticks is not None and proc.start_ticks != ticks)
            # or the same engine, taken back by the reconcile of a command killed halfway (a dump): it serves
            fixed = proc is not None and (self.service.reconciled or {}).get("adopted") == proc.pid
            if (other or fixed) and self.service.is_ready():
                self.say(f"{self.service.policy.name}: PID {proc.pid} serves now (restarted by another command); "
                         "adopted")
                self._save("serving")
                self.notify.send(self._status())
                return None
        window = self.cfg["start_limit_interval_s"]
        served_s = time.monotonic() - self._serving_since
        if engine is not None and engine == self._serving_pid and served_s >= self.cfg["min_uptime_s"]:
            # it served: a crash while serving, not a failed start; recovered at once, no backoff, no count, and
            # the crash loop before it (if any) is over: the backoff and the start limit start over
            self.failures.clear()
            self.say(f"{self.service.policy.name}: it had served {served_s:.0f} s ([supervise] min_uptime_s = "
                     f"{self.cfg['min_uptime_s']:g}): recovering at once")
            if pid is not None:
                kill_tree(pid)
                self.service.seam.reap_until_gone([pid], self.service.policy.restart["stop_timeout_s"])
            self._restart("crash", {"by": "supervise", "what": what, "noticed_at": noticed, "lost_in_flight": lost})
            return None
        self.failures.append(noticed)
        while self.failures and self.failures[0] < noticed - window:
            self.failures.popleft()
        if len(self.failures) > self.cfg["start_limit_burst"]:
            return self._give_up(f"{len(self.failures)} failures within {window:.0f} s "
                                 f"([supervise] start_limit_burst = {self.cfg['start_limit_burst']}); last: {what}")
        recent = len(self.failures)
        if recent > 1:
            pause = min(self.cfg["backoff_max_s"], self.cfg["backoff_s"] * 2 ** (recent - 2))
            self.say(f"{self.service.policy.name}: backing off {pause:.1f} s ({recent} failures within {window:.0f} s)")
            if self._sleep(pause):
                raise Cut(self.signals.popleft())
        if pid is not None:
            kill_tree(pid)  # a hung engine is declared dead: nothing it does now can be trusted
            self.service.seam.reap_until_gone([pid], self.service.policy.restart["stop_timeout_s"])
        self._restart("crash", {"by": "supervise", "what": what, "noticed_at": noticed, "lost_in_flight": lost})
        return None  # not serving after it: the next turn finds nothing running, another failure, with backoff

    def _planned_restart(self) -> None:
        """SIGHUP (systemd's ExecReload): RELOADING=1 until the planned restart is done, then READY=1."""
        self.say(f"{self.service.policy.name}: SIGHUP: a planned restart")
        self.beat.step(self._lock_wait())
        self.notify.reloading()
        self._restart("restart", {"by": "supervise", "what": "SIGHUP", "noticed_at": time.time()})
        self.notify.send("READY=1", self._status())

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
            rec = self._cold_anyway(reason, trigger, why)
            if rec is None:
                return None
        self._broker_up()
        if trigger["what"] != FIRST_START:  # supervisor.json's restarts: those after the first start
            self.history.append({"at": time.time(), "reason": reason, "what": trigger["what"],
                                 "served_by": rec.served_by, "final_state": rec.final_state,
                                 "time_to_ready_s": rec.time_to_ready_s, "record": rec.id,
                                 "noticed_to_serving_s": (rec.trigger or {}).get("noticed_to_serving_s")})
        self.say(f"{svc.policy.name}: {rec.final_state}" + (f" by {rec.served_by}" if rec.served_by else "")
                 + (f" {rec.trigger['noticed_to_serving_s']:.2f} s after the failure was noticed"
                    if (rec.trigger or {}).get("noticed_to_serving_s") is not None else ""))
        self._save(rec.final_state)
        self.notify.send(self._status())
        return rec

    def _cold_anyway(self, reason: str, trigger: dict, why: str):
        """The restart flow itself failed before it ran a strategy (a file it could not read, a
        bug): a crash must still end serving.  A plain cold start, as `restartkit start` does,
        recorded as a recovery with the reason; None when even that cannot run."""
        from restartkit.record import Record, write_record
        svc = self.service
        rec = Record(service=svc.policy.name, policy=svc.policy.path, requested="auto", reason=reason, plan={},
                     trigger=dict(trigger))
        rec.via_recovery, rec.recovery_reason = True, f"the restart flow failed ({why}); a plain cold start"
        try:
            with self._guarded(f"supervise restart ({reason})"):
                if svc.current() is None:
                    started = svc.engine.start("cold")
                    svc.canary()
                    rec.time_to_ready_s = round(started.ready_s, 3)
                rec.attempts.append({"strategy": "cold", "role": "recovery", "ok": True})
                rec.final_state, rec.served_by = "serving", "cold"
        except Exception as e:
            self.say(f"{svc.policy.name}: a plain cold start failed too: {getattr(e, 'message', None) or e}")
            rec.attempts.append({"strategy": "cold", "role": "recovery", "ok": False, "error": str(e)})
        if trigger.get("noticed_at") and rec.final_state == "serving":
            rec.trigger["noticed_to_serving_s"] = round(time.time() - trigger["noticed_at"], 3)
        write_record(svc, rec.finish(strict=False))
        return rec

    def _keep_standby(self) -> None:
        """[standby] enabled: keep one armed.  One that is gone, failed or stale is replaced (not more
        than every few seconds: one that keeps failing does not take the engine's CPUs); the time the
        service was without a prepared standby is measured (`rearm_s`)."""
        from restartkit.standby.armed import arm, consumed, disarm, frozen, stale, state
        from restartkit.standby.armed import cannot_stand_by
        svc, sb = self.service, self.standby
        if not svc.policy.standby["enabled"] or svc.engine.degraded:
            return
        if why := cannot_stand_by(svc.policy):  # said once; no process spawned to be refused
            if not sb.get("refused"):
                sb["refused"] = why
                self.say(f"{svc.policy.name}: [standby] enabled, but no standby is armed: {why}")
            return
        rec = state(svc)
        if rec is not None and rec["state"] in ("prepared", "starting", "preparing") and rec["alive"]:
            if rec["state"] == "prepared" and sb["since"] is not None:
                sb["rearm_s"] = [*sb["rearm_s"][-19:], round(time.monotonic() - sb["since"], 3)]
                sb["since"], sb["armed"] = None, rec["pid"]
                self.say(f"{svc.policy.name}: standby PID {rec['pid']} armed ({sb['rearm_s'][-1]:.2f} s without one)")
                self._save("serving")
                self._standby_metric(True, sb["rearm_s"][-1])
            if rec.get("engine_state") == "active" and rec.get("kv_ahead") and not rec.get("canary"):
                self._canary_ahead()
            # a stopped one (not probed here: a silent port would cost this loop a second a turn) or a stale one
            if rec["state"] != "prepared" or not (why := frozen(rec, probe=False) or stale(svc, rec)):
                return
            self.say(f"{svc.policy.name}: standby PID {rec['pid']} cannot be promoted ({why}); replacing it")
        if sb["since"] is None:
            sb["since"], sb["armed"] = time.monotonic(), None
            self._standby_metric(False)
        if time.monotonic() < sb["next_try"]:
            return
        sb["next_try"] = time.monotonic() + 5.0
        try:
            with guarded(svc, "supervise standby", 0.0, lambda _m: None, defer_signals=False):
                if rec is not None and rec["alive"]:
                    disarm(svc, timeout_s=0.5 if frozen(rec, probe=False) else 10.0)  # a stopped one ignores SIGTERM
                elif rec is not None:
                    consumed(svc)
                arm(svc)
        except BusyError:
            sb["next_try"] = 0.0  # another command works on the service: the next turn tries again
        except Exception as e:
            self.say(f"{svc.policy.name}: could not arm a standby: {getattr(e, 'message', None) or e}")

    def _canary_ahead(self) -> None:
        """The armed standby answers the canary ahead (commands.standby.canary_ahead), under the lock."""
        from restartkit.standby.armed import canary_ahead
        try:
            with guarded(self.service, "supervise standby", 0.0, lambda _m: None, defer_signals=False):
                canary_ahead(self.service)
        except BusyError:
            pass  # another command works on the service: the next turn asks again
        except Exception as e:  # the promotion then takes its canary on the public port, as without one ahead
            self.say(f"{self.service.policy.name}: the standby's canary ahead failed: {getattr(e, 'message', None) or e}")

    def _standby_metric(self, armed: bool, rearm_s: float | None = None) -> None:
        from restartkit.record import note_standby, textfile
        try:
            note_standby(self.service.state_dir, self.service.policy.name, armed, rearm_s,
                         textfile(self.service.policy, "restarts"))
        except OSError:
            pass  # metrics never stop supervision

    def _stop(self, why: str) -> int:
        from restartkit.standby.armed import disarm
        svc = self.service
        self.beat.step(svc.policy.restart["stop_timeout_s"] + 30, Heartbeat.STOPPING)
        self.notify.send("STOPPING=1", f"STATUS=stopping ({why})")
        self.say(f"{svc.policy.name}: {why}: stopping the engine")
        with self._guarded("supervise stop"):
            how = svc.engine.stop()
            if (pid := disarm(svc)) is not None:
                how += f"; its standby (PID {pid}) stopped"
        self.say(f"{svc.policy.name}: {how}")
        return EXIT_SERVING

    def _give_up(self, why: str) -> int:
        from restartkit.standby.armed import disarm
        svc = self.service
        try:
            with self._guarded("supervise stop"):
                svc.engine.stop()
                disarm(svc)
        except Exception as e:
            self.say(f"{svc.policy.name}: could not stop the engine: {getattr(e, 'message', None) or e}")
        try:
            from restartkit.record import count_give_up, textfile
            count_give_up(svc.state_dir, svc.policy.name, textfile(svc.policy, "restarts"))
        except OSError:
            pass  # the state dir turned read-only: the line below still says it
        line = f"restartkit supervise: giving up on {svc.policy.name}: {why}; the engine is left stopped"
        self.notify.send(f"STATUS={line}")
        self.say(line)
        return EXIT_GAVE_UP

    def _sleep(self, seconds: float) -> bool:
        """Sleep, or stop early on SIGTERM/SIGINT (True); a SIGHUP during a backoff waits its turn."""
        if not self.service.seam.wait_until(lambda: any(s != signal.SIGHUP for s in self.signals), seconds, 0.1):
            return False
        while self.signals and self.signals[0] == signal.SIGHUP:
            self.signals.popleft()
        return True

    @contextlib.contextmanager
    def _guarded(self, command: str):
        """guarded() as every command runs it.  When the state dir cannot be written any more (it
        turned read-only under a serving engine), the work still runs, degraded: no lock or intent
        (no other command can take them either), the engine's log on our stderr, records on stderr,
        until it can be written again."""
        svc = self.service
        try:
            preflight_writable(svc.state_dir)
        except UsageError as e:
            if not svc.engine.degraded:
                self.say(f"restartkit supervise: {e.message}; supervising without a lock or records on disk "
                         "until it can be written (the engine's log and the records go to stderr)")
            svc.engine.degraded = True
            yield []
            return
        if svc.engine.degraded:
            svc.engine.degraded = False
            self.say(f"restartkit supervise: the state dir {svc.state_dir} can be written again")
            last = svc.engine.last
            if last is not None and last.alive():
                svc.engine.mark_ready(last, "cold")  # the engine started meanwhile gets its engine.json
        with guarded(svc, command, self._lock_wait(), self.say, defer_signals=False) as got:
            yield got

    def _probe_budget(self) -> float:
        """The longest one turn of the watch loop may take: a wait, a health check and a completion."""
        return self.interval + self.cfg["health_timeout_s"] + self.cfg["completion_timeout_s"] + 10

    def _lock_wait(self) -> float:
        r = self.service.policy.restart
        return r["stop_timeout_s"] + r["start_timeout_s"] + 60

    # ---- state -----------------------------------------------------------------------
    def _status(self) -> str:
        proc = self.service.current()
        last = self.history[-1] if self.history else None
        text = f"serving PID {proc.pid}" if proc else "no engine"
        text += f"; {len(self.failures)} failure(s) in the last {self.cfg['start_limit_interval_s']:.0f} s"
        if last:
            text += f"; last restart ({last['reason']}): {last['served_by']} in {last['time_to_ready_s']} s"
        return f"STATUS={text}"

    def _save(self, state: str) -> None:
        proc = self.service.current()
        serving = proc.pid if proc is not None and state == "serving" else None
        if serving != self._serving_pid:
            self._serving_since = time.monotonic()
        self._serving_pid = serving
        window = self.cfg["start_limit_interval_s"]
        try:
            write_json_atomic(self.path, {
                "pid": os.getpid(), "start_ticks": proc_start_ticks(os.getpid()), "started_at": self.started_at,
                "state": state, "failures_in_interval": len([t for t in self.failures if t >= time.time() - window]),
                "interval_s": window, "restarts": self.history[-20:],
                "listener": self.service.engine.held.describe() if self.service.engine.held is not None else None,
                "standby": {"armed": self.standby["armed"], "rearm_s": self.standby["rearm_s"]}})
        except OSError as e:
            self.say(f"restartkit supervise: could not write {self.path} ({e.strerror or e})")


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


def read_state(state_dir) -> dict | None:
    """The supervisor's state, when one runs for this service."""
    import json

    try:
        data = json.loads((state_dir / "supervisor.json").read_text())
    except (OSError, ValueError):
        return None
    return data if holder_alive(data) else None


__all__ = ["Supervisor", "Notifier", "Phase", "read_state", "EXIT_GAVE_UP"]
