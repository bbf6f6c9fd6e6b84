"""The life cycle of a service's engine: engine.json (PID, start ticks, port, how it started),
engine.log (its output, appended per start), starting it under its keeper and waiting until it
answers, adopting a restored one, handing the port over to its successor, stopping it, and
clearing what a failed attempt left before a recovery start.  The service's other state (its
canary, its facts) is restartkit.service's."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from restartkit.errors import EngineStartError, UsageError
from restartkit.guard import admin, peer
from restartkit.files import ensure_private_dir, write_json_atomic
from restartkit.process import inflight, keeper, shm
from restartkit.process.engine import EngineProcess
from restartkit.process.procfs import (ancestors, argv, comm, create_time, kill_tree, listeners, owner,
                                       port_has_listener, proc_start_ticks, stopped_in, tree_pids)
from restartkit.process.seam import Seam
from restartkit.process.states import ProcState
from restartkit.reference.serving.ready import READY_FD_ENV

# how long a stop waits for a stopped engine's last helper processes to unmap its /dev/shm files
SHM_RELEASE_S = 5.0


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


def _disk_digest(model: str) -> str | None:
    from restartkit.weightcache.fingerprint import local_checkpoint_identity
    try:
        return local_checkpoint_identity(model)
    except Exception:  # no safetensors, unreadable: nothing to compare later
        return None


def ours(pid: int, since_ticks: int | None) -> bool:
    """Is `pid` a process restartkit started (or restored) since `since_ticks`?  It runs as this
    user, was created since then, and is a keeper of ours (restartkit/process/keeper.py, which every
    engine and every restore runs under) or has one among its ancestors.  A PID a snapshot's manifest names,
    reused by anyone else since (another user's process, an unrelated one), is never ours."""
    if since_ticks is None or owner(pid) != os.getuid():
        return False
    ticks = proc_start_ticks(pid)
    if ticks is None or ticks < since_ticks:
        return False
    return any(keeper.KEEPER in argv(a) for a in [pid, *ancestors(pid)])  # a keeper of ours, or under one


def unfit(policy, adapter) -> list[tuple[str, str]]:
    """Why this host cannot start this policy's engine, each with its fix: the model (and draft, and API
    key file) the engine would read, and the device.  `start` refuses on the first; `policy check` shows
    them all (the same checks, made once here).  And where its metrics would go: never into a directory
    root must not write (restartkit.record.textfile_dir_problem)."""
    from restartkit.record import textfile_dir_problem
    out = []
    if problem := adapter.model_problem(policy) or adapter.key_problem(policy):
        key = "draft_model" if problem.startswith(("draft_model", "the draft model")) else \
            "api_key_file" if "api_key_file" in problem else "model"
        out.append((problem, f"fix [service] {key} in {policy.path}"))
    if (textfiles := policy.sections["metrics"]["textfile_dir"]) and \
            (problem := textfile_dir_problem(Path(os.path.expandvars(os.path.expanduser(textfiles))))):
        out.append((problem, f"set [metrics] textfile_dir in {policy.path} to a directory only its owner (or root) "
                             "can write, or one with the sticky bit"))
    if policy.service["device"] == "cuda" and not gpu_visible():
        out.append(("device = \"cuda\", and this host shows no NVIDIA GPU (no /proc/driver/nvidia/gpus entry, no "
                    "/dev/nvidiactl)", f"run it on a GPU host, or set [service] device = \"cpu\" in {policy.path}"))
    return out


def gpu_visible() -> bool:
    """An NVIDIA GPU this process can see (its driver's /proc entries or device nodes; no CUDA import)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return (gpus.is_dir() and any(gpus.iterdir())) or os.path.exists("/dev/nvidiactl")


class EngineLifecycle:
    """One service's engine, started, adopted, handed over and stopped.  `note_pids` is told of
    every process it starts before anything waits on it (the command's intent)."""

    def __init__(self, policy, adapter, adapter_problem: str | None, state_dir: Path, seam: Seam,
                 note_pids: Callable[[list[int]], None] = lambda _pids: None):
        self.policy, self.adapter, self.adapter_problem = policy, adapter, adapter_problem
        self.state_dir, self.seam, self.note_pids = state_dir, seam, note_pids
        # Degraded: the state dir cannot be written (it turned read-only under a supervisor).  The engine
        # is still started and watched: its log goes to our stderr, engine.json is not written, and the
        # engine last started or adopted is kept here instead.
        self.degraded = False
        self.last: EngineProcess | None = None
        self.keepers: list = []  # the keepers started here (Popen): collected by reap() once they exit
        self.progress: Callable[[str], None] = lambda _m: None  # what a start is doing, as it happens (stderr)
        # The service's listening socket (restartkit.process.listener), when a long-lived process holds it:
        # every engine started here serves on it.  `hold`: this process is that holder (supervise), and
        # binds it as soon as the port is free; otherwise the supervisor's broker is asked, once.
        self.held = None
        self.hold = False
        self._asked = False

    @property
    def pidfile(self) -> Path:
        return self.state_dir / "engine.json"

    @property
    def log_path(self) -> Path:
        return self.state_dir / "engine.log"

    def current(self) -> EngineProcess | None:
        """The engine this service started, if it still runs (PID and start time match)."""
        if self.degraded and self.last is not None and self.last.alive():
            return self.last
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

    def listener(self):
        """The held socket the next engine serves on (restartkit.process.listener.Held), or None: it
        binds the port itself, as an unsupervised engine does."""
        from restartkit.process import listener
        if self.held is not None or not getattr(self.adapter, "serves_on_socket", False):
            return self.held
        s = self.policy.service
        if self.hold:
            try:
                self.held = listener.bind(s["host"], s["port"])
            except listener.ListenerError:  # an engine adopted with its own socket holds it still
                return None
        elif not self._asked:
            self._asked = True
            self.held = listener.fetch(self.state_dir)
        return self.held

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
        """Who listens on the service's port, if anyone (not the service's own held socket)."""
        if self.listener() is not None:
            return None
        pids = listeners(self.policy.service["port"])
        if pids:
            return ", ".join(f"PID {p} ({comm(p)})" for p in pids)
        return "another process" if self.port_listening() or self._connects() else None

    def port_holder_after_grace(self, grace_s: float = 3.0) -> str | None:
        """The port's holder; a listener no process holds any more (a socket still closing
        as its killed owner exits) is given a moment to go."""
        holder = None

        def settled() -> bool:
            nonlocal holder
            holder = self.port_holder()
            return holder != "another process"
        self.seam.wait_until(settled, grace_s)
        return holder

    def clear_for_recovery(self, known: list[tuple[int, int]], pids: list[int], since_ticks: int | None) -> list[int]:
        """Before a recovery start: kill and reap every process of the failed attempt, so that
        its port and PIDs are free.  Only processes restartkit can prove are its own are touched
        (see `ours`): `known`, (PID, start ticks) pairs it recorded (the old engine); `pids`, what
        the attempt started or restored, and any listener on the service's port, when created
        during this restart (`since_ticks`) under a keeper of ours.  Anything else holding a PID
        or the port is someone else's: left alone, and the start names it."""
        doomed = [p for p, ticks in known if p and ticks is not None and proc_start_ticks(p) == ticks
                  and owner(p) == os.getuid()]
        self._kill(doomed, pids, since_ticks)
        self.pidfile.unlink(missing_ok=True)
        return doomed

    def kill_started(self, pids: list[int], since_ticks: int | None) -> list[int]:
        """A command cut short (a signal at a safe point): kill and reap what it started or restored
        since `since_ticks` (`pids`, and a listener on the port), as `clear_for_recovery` proves its
        own; an engine that ran before is left as it is, and engine.json with it unless it names a
        process killed here."""
        recorded = self.recorded().get("pid")
        doomed = self._kill([], pids, since_ticks)
        if recorded in doomed:
            self.pidfile.unlink(missing_ok=True)
        return doomed

    def _kill(self, doomed: list[int], pids: list[int], since_ticks: int | None) -> list[int]:
        port = self.policy.service["port"]
        for p in dict.fromkeys([*pids, *listeners(port)]):
            if p and p not in doomed and ours(p, since_ticks):
                doomed.append(p)
        for p in doomed:
            kill_tree(p)
        self.seam.reap_until_gone(doomed, self.policy.restart["stop_timeout_s"],
                                  also=lambda: not set(listeners(port)) & set(doomed))
        return doomed

    def start(self, strategy: str = "cold", extra_args: list[str] = (), extra_env: dict | None = None) -> Started:
        if self.adapter is None:
            raise UsageError(self.adapter_problem)
        if problems := unfit(self.policy, self.adapter):
            problem, hint = problems[0]
            raise EngineStartError(f"cannot start {self.policy.name}: {problem}", hint=hint)
        if holder := self.port_holder_after_grace():
            s = self.policy.service
            raise EngineStartError(f"port {s['port']} is already in use by {holder}",
                                   hint=f"stop that process, or set another [service] port in {self.policy.path}")
        self.progress(f"{self.policy.name}: starting the engine ({strategy}); its log: {self.log_path}")
        proc, log_offset = self.spawn(strategy, extra_args, extra_env)
        self._write_pidfile(proc, strategy, ready=False)
        timeout = self.policy.restart["start_timeout_s"]
        self.progress(f"{self.policy.name}: PID {proc.pid}: waiting for it to answer (up to {timeout:.0f} s)")
        try:
            ready_s = proc.wait_ready(lambda: self.adapter.probe(self.policy), timeout, progress=self.progress)
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
        if not self.degraded:
            ensure_private_dir(self.state_dir)
        held = self.listener()
        if held is not None:  # it inherits the service's socket, and serves on it
            extra_args = [*extra_args, "--listen-fd", str(held.fd)]
        spec = self.adapter.launch(self.policy, list(extra_args))
        env = {**os.environ, **spec.env, **(extra_env or {}), "RESTARTKIT_SPAWN_TIME": repr(time.time())}
        for name in spec.unset:  # inherited from whoever ran restartkit, and not to be: named by the adapter
            env.pop(name, None)
        env[admin.ADMIN_TOKEN_ENV] = admin.token(self.state_dir)  # its admin routes answer restartkit's calls only
        if self.policy.public is not None:  # behind supervise's front: its port answers its own user only
            env[peer.OWNER_ONLY_ENV] = "1"
        else:
            env.pop(peer.OWNER_ONLY_ENV, None)
        if not self.degraded:  # it keeps its requests in flight where a crash's record can count them
            inflight.sweep(self.state_dir)
            env[inflight.ENV] = str(self.state_dir)
        pass_fds = () if held is None else (held.fd,)
        ready_r = ready_w = None
        if self.adapter.signals_ready:  # a pipe the engine writes one byte to when it is ready
            ready_r, ready_w = os.pipe()
            env[READY_FD_ENV] = str(ready_w)
        try:
            fd = self._open_log()
            with open(fd, "ab") as log:
                try:
                    log_offset = log.tell()
                except OSError:  # degraded: our stderr, a pipe
                    log_offset = 0
                log.write(f"\n==== {time.strftime('%Y-%m-%dT%H:%M:%S')} restartkit start ({strategy}): {' '.join(spec.argv)}\n".encode())
                log.flush()
                # under a keeper, which reaps it the moment it exits: its PID is free at once (a CRIU
                # restore needs it), whoever collects orphans on this host and however slowly
                popen, pid, _ = keeper.start(self.seam.popen, "spawn", spec.argv, stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=log, env=env, close_fds=True,
                                             pass_fds=pass_fds + ((ready_w,) if ready_w is not None else ()))
        except BaseException:
            if ready_r is not None:
                os.close(ready_r)
            raise
        finally:
            if ready_w is not None:
                os.close(ready_w)
        self.note_pids([pid])
        self.keepers.append(popen)
        return EngineProcess(pid=pid, create_time=create_time(pid), start_ticks=proc_start_ticks(pid),
                             log_path=self.log_path, popen=popen, kept=True, seam=self.seam, ready_fd=ready_r,
                             probe_after_signal=held is not None), log_offset

    def reap(self) -> None:
        """Collect the keepers started here whose engine has ended (a long-lived caller, supervise, would keep
        each as a zombie until it next started a process).  poll(), not waitpid(-1): each Popen keeps its status."""
        self.keepers = [p for p in self.keepers if p.poll() is None]

    def _open_log(self) -> int:
        """engine.log for appending (owner only: the engine's argv and output); degraded, our stderr."""
        try:
            fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            os.fchmod(fd, 0o600)
            return fd
        except OSError:
            if not self.degraded:
                raise
            return os.dup(2)

    def adopt(self, pid: int, strategy: str) -> EngineProcess:
        """Record a process restartkit did not spawn itself (a CRIU restore) as the engine."""
        ensure_private_dir(self.state_dir)
        proc = EngineProcess(pid=pid, create_time=create_time(pid), start_ticks=proc_start_ticks(pid),
                             log_path=self.log_path, seam=self.seam)
        self._write_pidfile(proc, strategy, ready=False)
        return proc

    def mark_ready(self, proc: EngineProcess, strategy: str) -> None:
        self._write_pidfile(proc, strategy, ready=True)

    def _write_pidfile(self, proc: EngineProcess, strategy: str, ready: bool) -> None:
        self.last = proc
        if self.degraded:
            return  # the state dir cannot be written: the engine is kept in memory (self.last)
        record = {"pid": proc.pid, "create_time": proc.create_time, "start_ticks": proc.start_ticks,
                  "port": self.policy.service["port"], "strategy": strategy, "ready": ready, "written_at": time.time()}
        if ready:  # the weights it serves: what is on disk now (the digests are cached; off the path to ready)
            record["model_digest"] = _disk_digest(self.policy.service["model"])
            record["shm"] = shm.describe(tree_pids(proc.pid))  # removed once it is gone (restartkit.process.shm)
            self.sweep_gone()  # the engine before it, when it left its files behind
        write_json_atomic(self.pidfile, record)

    def shm_now(self, proc: EngineProcess | None) -> list[dict]:
        """The recorded engine's /dev/shm files, with the ones its tree holds now (made after it was ready)."""
        files = {f["path"]: f for f in self.recorded().get("shm") or [] if isinstance(f, dict) and "path" in f}
        if proc is not None:
            files.update({f["path"]: f for f in shm.describe(tree_pids(proc.pid))})
        return list(files.values())

    def note_shm(self, proc: EngineProcess) -> None:
        """Record the /dev/shm files the engine made since it was ready (supervise asks now and then), so a
        crash leaves none behind either."""
        rec = self.recorded()
        if self.degraded or rec.get("pid") != proc.pid:
            return
        files = self.shm_now(proc)
        if len(files) != len(rec.get("shm") or []):
            write_json_atomic(self.pidfile, {**rec, "shm": files})

    def sweep_gone(self) -> list[str]:
        """Remove the /dev/shm files of the recorded engine when it is gone (a crash, a stop)."""
        before = self.recorded()
        if not before.get("shm"):
            return []
        gone = EngineProcess(pid=before["pid"], create_time=before.get("create_time"),
                             start_ticks=before.get("start_ticks"), seam=self.seam)
        return [] if gone.alive() else shm.sweep(before["shm"])

    def recorded(self) -> dict:
        """engine.json as written ({} when there is none or it cannot be read)."""
        try:
            data = json.loads(self.pidfile.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def hand_over(self) -> Handover:
        """Stop the old engine the fast way for a restart: SIGTERM, and return
        as soon as it no longer listens (it closes its listener first, then
        drains).  Its exit is awaited in the background, with the usual
        SIGKILL at the stop timeout; the new engine, started at once, waits
        for that exit before it allocates device memory (RESTARTKIT_AFTER_PID),
        so the old one's teardown overlaps the new one's start-up."""
        proc = self.current()
        h = Handover(proc)
        if proc is None:
            self.pidfile.unlink(missing_ok=True)
            return h
        r = self.policy.restart
        left = self.shm_now(proc)  # removed once it has exited (the pidfile goes before that)
        tree = set(tree_pids(proc.pid))
        t0 = time.monotonic()
        proc.to(ProcState.STOPPING)
        try:
            self.seam.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = t0 + r["stop_timeout_s"]
        if self.held is None:  # a held socket is never closed: the next engine starts now, and accepts beside it
            self.seam.wait_until(lambda: not (proc.alive() and self.port_listening()) or stopped_in(proc.pid) is not None,
                                 deadline - time.monotonic(), 0.005)
        if self.held is None and proc.alive() and self.port_listening():  # ignored SIGTERM or frozen (SIGSTOP): kill it
            h.how = proc.stop(timeout_s=0, signalled=True)
            h.exit_s = h.port_free_s = round(time.monotonic() - t0, 4)
            shm.sweep(left)
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
            shm.sweep(left, tree, wait_s=SHM_RELEASE_S)
        h.thread = threading.Thread(target=finish, daemon=True)
        h.thread.start()
        h.env = {"RESTARTKIT_AFTER_PID": f"{proc.pid}:{proc.create_time or ''}",
                 "RESTARTKIT_AFTER_TIMEOUT_S": str(r["stop_timeout_s"] + 15)}
        return h

    def restart(self, strategy: str, extra_args=(), phases: dict | None = None) -> Started:
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
            started = self.start(strategy=strategy, extra_args=extra_args, extra_env=h.env if h else None)
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
            self.sweep_gone()
            self.pidfile.unlink(missing_ok=True)
            return "not running"
        if not ours(proc.pid, proc.start_ticks):  # engine.json names a process restartkit never started: left alone
            self.pidfile.unlink(missing_ok=True)
            return f"not running (engine.json named PID {proc.pid}, which restartkit did not start: not signalled)"
        r = self.policy.restart
        left, tree = self.shm_now(proc), set(tree_pids(proc.pid))
        how = proc.stop(timeout_s=r["stop_timeout_s"])
        shm.sweep(left, tree, wait_s=SHM_RELEASE_S)
        try:
            self.pidfile.unlink(missing_ok=True)
        except OSError:  # a read-only state dir: it names a process that is gone, which nothing takes for ours
            pass
        return how
