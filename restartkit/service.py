"""One service: its policy, its state directory, its engine process.

State directory (0700): engine.json (PID, start time, port, how it started),
engine.log (the engine's output, appended per start), canary.json (the last
canary taken from a serving engine), history.jsonl (one record per restart),
metrics.prom (Prometheus textfile).
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from restartkit.process import keeper
from restartkit.contracts import FACT_TIMEOUT_S, ServiceFacts
from restartkit.engines import get_adapter
from restartkit.errors import EngineStartError, UsageError
from restartkit.files import write_json_atomic
from restartkit.guard.intent import Intent
from restartkit.reference.ready import READY_FD_ENV
from restartkit.process.engine import EngineProcess
from restartkit.process.procfs import comm, create_time, kill_tree, listeners, port_has_listener, proc_start_ticks
from restartkit.process.seam import Seam
from restartkit.process.states import ProcState


@dataclass
class Handover:
    """An old engine told to stop; see Service.hand_over."""
    proc: EngineProcess | None
    port_free_s: float = 0.0
    exit_s: float | None = None
    how: str = "not running"
    env: dict = field(default_factory=dict)
    thread: object = None

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()


@dataclass
class Started:
    process: EngineProcess
    ready_s: float
    engine_phases: dict = field(default_factory=dict)
    weight_source: str | None = None
    stats: dict = field(default_factory=dict)
    log_offset: int = 0  # where this start's output begins in the engine log
    ready_at: float = 0.0  # time.monotonic() when the readiness probe passed


class Service:
    def __init__(self, policy, seam: Seam | None = None):
        self.policy = policy
        self.seam = seam or Seam()
        self.adapter, self.adapter_problem = get_adapter(policy.service["engine"])
        self.state_dir = policy.state_dir()
        self.intent = Intent(self.state_dir)  # written only once a guarded command has begun it

    @classmethod
    def from_policy_file(cls, path, state_root: str = "", seam: Seam | None = None) -> "Service":
        from restartkit.policy import load_policy
        return cls(load_policy(path, state_root), seam)

    # ---- files ----------------------------------------------------------------
    def ensure_state_dir(self) -> Path:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.state_dir, 0o700)
        return self.state_dir

    @property
    def pidfile(self) -> Path:
        return self.state_dir / "engine.json"

    @property
    def log_path(self) -> Path:
        return self.state_dir / "engine.log"

    @property
    def canary_path(self) -> Path:
        return self.state_dir / "canary.json"

    # ---- what is running --------------------------------------------------------
    def current(self) -> EngineProcess | None:
        """The engine this service started, if it still runs (PID and start time match)."""
        try:
            info = json.loads(self.pidfile.read_text())
        except (OSError, ValueError):
            return None
        proc = EngineProcess(pid=info["pid"], create_time=info.get("create_time"), start_ticks=info.get("start_ticks"),
                             log_path=self.log_path, seam=self.seam)
        if not proc.alive():
            return None
        proc.state = ProcState.READY if info.get("ready") else ProcState.STARTING
        return proc

    def is_ready(self, timeout_s: float | None = None) -> bool:
        return self.probe(timeout_s)[0]

    def probe(self, timeout_s: float | None = None) -> tuple[bool, bool]:
        """(ready, answered): did a real completion pass, and did the engine answer at all
        (a 503 while asleep or loading is an answer; a hung engine gives none)."""
        from restartkit.http import HTTPFailure
        try:
            if timeout_s is None:
                self.adapter.probe(self.policy)
            else:
                self.adapter.probe(self.policy, timeout=timeout_s)
            return True, True
        except HTTPFailure as e:
            return False, e.status is not None
        except Exception:
            return False, True

    def service_facts(self) -> ServiceFacts:
        """The facts every strategy shares; each strategy gathers its own beside them."""
        s = self.policy.service
        sf = ServiceFacts(engine=s["engine"], adapter_problem=self.adapter_problem)
        if self.adapter is None:
            return sf
        sf.model_problem = self.adapter.model_problem(self.policy)
        sf.engine_version = self.adapter.version()
        sf.overlap_problem = self.adapter.overlap_problem(self.policy)
        sf.engine_notes = self.adapter.plan_notes(self.policy)
        if not sf.model_problem:
            from restartkit.weightcache.fingerprint import local_checkpoint_identity
            sf.model_digest = local_checkpoint_identity(s["model"]) or (f"{s['model']}@{s['revision']}" if s["revision"] else None)
        proc = self.current()
        if proc is not None:
            sf.engine_running, sf.pid = True, proc.pid
            # a hung engine must cost seconds here, not the minutes a loaded one may take to answer
            sf.engine_ready, sf.engine_answered = self.probe(timeout_s=FACT_TIMEOUT_S)
            try:  # a busy engine may queue a completion past the probe's timeout; its stats answer at once
                sf.stats = self.adapter.stats(self.policy, timeout=FACT_TIMEOUT_S)
                sf.engine_answered = True
            except Exception:
                pass
        return sf

    def port_listening(self) -> bool:
        """Does anything listen on the service's port?  Read from /proc, not by connecting:
        a stopped engine whose backlog is full still holds its port."""
        return port_has_listener(self.policy.service["port"])

    def _connects(self) -> bool:  # a listener /proc does not show us (another user's hidepid, say)
        s = self.policy.service
        host = "127.0.0.1" if s["host"] in ("0.0.0.0", "") else s["host"]
        with socket.socket() as sock:
            sock.settimeout(0.2)
            return sock.connect_ex((host, s["port"])) == 0

    def port_holder(self) -> str | None:
        """Who listens on the service's port, if anyone."""
        pids = listeners(self.policy.service["port"])
        if pids:
            return ", ".join(f"PID {p} ({comm(p)})" for p in pids)
        return "another process" if self.port_listening() or self._connects() else None

    def _port_holder_after_grace(self, grace_s: float = 3.0) -> str | None:
        """The port's holder; a listener no process holds any more (a socket still closing
        as its killed owner exits) is given a moment to go."""
        holder = None

        def settled() -> bool:
            nonlocal holder
            holder = self.port_holder()
            return holder != "another process"
        self.seam.wait_until(settled, grace_s)
        return holder

    def clear_for_recovery(self, pids: list[int], since_ticks: int | None) -> list[int]:
        """Before a recovery start: kill and reap every process of the failed attempt, so that
        its port and PIDs are free.  `pids`: engines this restart knew of (the old one, what the
        attempt started or restored); besides these, any listener on the service's port that
        was created during this restart (`since_ticks`).  A listener older than the restart
        that we do not know is someone else's: left alone, and the start names it."""
        port = self.policy.service["port"]
        doomed = [p for p in dict.fromkeys(pids) if p and proc_start_ticks(p) is not None]
        for p in listeners(port):
            ticks = proc_start_ticks(p)
            if p not in doomed and since_ticks is not None and ticks is not None and ticks >= since_ticks:
                doomed.append(p)
        for p in doomed:
            kill_tree(p)
        self.seam.reap_until_gone(doomed, self.policy.restart["stop_timeout_s"],
                                  also=lambda: not set(listeners(port)) & set(doomed))
        self.pidfile.unlink(missing_ok=True)
        return doomed

    # ---- start / stop -------------------------------------------------------------
    def start_engine(self, strategy: str = "cold", extra_args: list[str] = (), extra_env: dict | None = None) -> Started:
        if self.adapter is None:
            raise UsageError(self.adapter_problem)
        if problem := self.adapter.model_problem(self.policy):
            key = "draft_model" if problem.startswith(("draft_model", "the draft model")) else "model"
            raise EngineStartError(f"cannot start {self.policy.name}: {problem}",
                                   hint=f"fix [service] {key} in {self.policy.path}")
        if holder := self._port_holder_after_grace():
            s = self.policy.service
            raise EngineStartError(f"port {s['port']} is already in use by {holder}",
                                   hint=f"stop that process, or set another [service] port in {self.policy.path}")
        proc, log_offset = self.spawn(strategy, extra_args, extra_env)
        self._write_pidfile(proc, strategy, ready=False)
        try:
            ready_s = proc.wait_ready(lambda: self.adapter.probe(self.policy), self.policy.restart["start_timeout_s"])
        except EngineStartError:
            if proc.alive():
                proc.stop(timeout_s=5)
            self.pidfile.unlink(missing_ok=True)
            raise
        ready_at = time.monotonic()
        self._write_pidfile(proc, strategy, ready=True)
        started = Started(process=proc, ready_s=ready_s, log_offset=log_offset, ready_at=ready_at)
        try:
            stats = self.adapter.stats(self.policy)
            started.stats = stats
            started.engine_phases = stats.get("phases", {})
            started.weight_source = (stats.get("load") or {}).get("source")
        except Exception:
            pass
        return started

    def spawn(self, strategy: str, extra_args=(), extra_env: dict | None = None) -> tuple[EngineProcess, int]:
        """Start the engine process (output appended to the engine log); no waiting."""
        self.ensure_state_dir()
        spec = self.adapter.launch(self.policy, list(extra_args))
        env = {**os.environ, **spec.env, **(extra_env or {}), "RESTARTKIT_SPAWN_TIME": repr(time.time())}
        ready_r = ready_w = None
        if self.adapter.signals_ready:  # a pipe the engine writes one byte to when it is ready
            ready_r, ready_w = os.pipe()
            env[READY_FD_ENV] = str(ready_w)
        try:
            fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.fchmod(fd, 0o600)  # the engine's argv and output: not for other users
            with open(fd, "ab") as log:
                log_offset = log.tell()
                log.write(f"\n==== {time.strftime('%Y-%m-%dT%H:%M:%S')} restartkit start ({strategy}): {' '.join(spec.argv)}\n".encode())
                log.flush()
                # under a keeper, which reaps it the moment it exits: its PID is free at once (a CRIU
                # restore needs it), whoever collects orphans on this host and however slowly
                popen, pid, _ = keeper.start(self.seam.popen, "spawn", spec.argv, stdin=subprocess_devnull(),
                                             stdout=log, stderr=log, env=env, close_fds=True,
                                             pass_fds=(ready_w,) if ready_w is not None else ())
        except BaseException:
            if ready_r is not None:
                os.close(ready_r)
            raise
        finally:
            if ready_w is not None:
                os.close(ready_w)
        self.intent.update(pids=[pid])
        return EngineProcess(pid=pid, create_time=create_time(pid), start_ticks=proc_start_ticks(pid),
                             log_path=self.log_path, popen=popen, kept=True, seam=self.seam, ready_fd=ready_r), log_offset

    def adopt(self, pid: int, strategy: str) -> EngineProcess:
        """Record a process restartkit did not spawn itself (a CRIU restore) as the engine."""
        self.ensure_state_dir()
        proc = EngineProcess(pid=pid, create_time=create_time(pid), start_ticks=proc_start_ticks(pid),
                             log_path=self.log_path, seam=self.seam)
        self._write_pidfile(proc, strategy, ready=False)
        return proc

    def mark_ready(self, proc: EngineProcess, strategy: str) -> None:
        self._write_pidfile(proc, strategy, ready=True)

    def _write_pidfile(self, proc: EngineProcess, strategy: str, ready: bool) -> None:
        write_json_atomic(self.pidfile, {
            "pid": proc.pid, "create_time": proc.create_time, "start_ticks": proc.start_ticks,
            "port": self.policy.service["port"],
            "strategy": strategy, "ready": ready, "written_at": time.time(),
        })

    def hand_over(self) -> "Handover":
        """Stop the old engine the fast way for a restart: SIGTERM, and return
        as soon as it no longer listens (it closes its listener first, then
        drains).  Its exit is awaited in the background, with the usual
        SIGKILL at the stop timeout; the new engine, started at once, waits
        for that exit before it allocates device memory (RESTARTKIT_AFTER_PID),
        so the old one's teardown overlaps the new one's start-up."""
        import signal
        import threading
        proc = self.current()
        h = Handover(proc)
        if proc is None:
            self.pidfile.unlink(missing_ok=True)
            return h
        r = self.policy.restart
        t0 = time.monotonic()
        proc.to(ProcState.STOPPING)
        try:
            self.seam.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = t0 + r["stop_timeout_s"]
        self.seam.wait_until(lambda: not (proc.alive() and self.port_listening()), deadline - time.monotonic(), 0.005)
        if proc.alive() and self.port_listening():  # ignored SIGTERM and still holds the port: kill it now
            h.how = proc.stop(timeout_s=0, signalled=True)
            h.exit_s = h.port_free_s = round(time.monotonic() - t0, 4)
            self.pidfile.unlink(missing_ok=True)
            return h
        h.port_free_s = round(time.monotonic() - t0, 4)
        self.pidfile.unlink(missing_ok=True)

        def finish():
            try:
                h.how = proc.stop(timeout_s=max(0.0, deadline - time.monotonic()), signalled=True)
            except Exception as e:  # survived SIGKILL: the new engine's gate says so
                h.how = f"{type(e).__name__}: {e}"
            h.exit_s = round(time.monotonic() - t0, 4)
        h.thread = threading.Thread(target=finish, daemon=True)
        h.thread.start()
        h.env = {"RESTARTKIT_AFTER_PID": f"{proc.pid}:{proc.create_time or ''}",
                 "RESTARTKIT_AFTER_TIMEOUT_S": str(r["stop_timeout_s"] + 15)}
        return h

    def restart_engine(self, strategy: str, extra_args=(), phases: dict | None = None) -> Started:
        """Stop the running engine and start the new one: through a hand-over
        when the engine can wait for its predecessor (the reference engine),
        else stop first, then start.  Fills `phases` (stop, start_to_ready, old_exit)."""
        phases = {} if phases is None else phases
        t0 = time.monotonic()
        if getattr(self.adapter, "waits_for_previous", False):
            h = self.hand_over()
            phases["stop"] = h.port_free_s
        else:
            h = None
            self.stop()
            phases["stop"] = round(time.monotonic() - t0, 4)
        t1 = time.monotonic()
        try:
            started = self.start_engine(strategy=strategy, extra_args=extra_args, extra_env=h.env if h else None)
        finally:
            if h is not None:
                h.join()
                if h.proc is not None:
                    phases["old_exit"] = h.exit_s
        phases["start_to_ready"] = round(started.ready_at - t1, 4)  # not the stats read after it
        return started

    def stop(self) -> str:
        proc = self.current()
        if proc is None:
            self.pidfile.unlink(missing_ok=True)
            return "not running"
        r = self.policy.restart
        how = proc.stop(timeout_s=r["stop_timeout_s"])
        self.pidfile.unlink(missing_ok=True)
        return how

    # ---- canary -------------------------------------------------------------------
    def canary(self) -> list[list[int]]:
        tokens = self.adapter.canary(self.policy)
        self.ensure_state_dir()
        write_json_atomic(self.canary_path, {"taken_at": time.time(), "model": self.policy.service["model"],
                                             "prompts": self.policy.restart["canary_prompts"], "tokens": tokens})
        return tokens

    def stored_canary(self) -> tuple[list[list[int]] | None, str]:
        try:
            data = json.loads(self.canary_path.read_text())
        except (OSError, ValueError):
            return None, "no canary stored"
        if data.get("prompts") != self.policy.restart["canary_prompts"] or data.get("model") != self.policy.service["model"]:
            return None, "the stored canary is for other prompts or another model"
        return data["tokens"], time.strftime("stored canary from %Y-%m-%d %H:%M:%S", time.localtime(data["taken_at"]))


def subprocess_devnull():
    import subprocess
    return subprocess.DEVNULL
