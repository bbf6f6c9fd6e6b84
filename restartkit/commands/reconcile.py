"""Finish what a killed restartkit left behind.

A command that held the service's lock writes intent.json before it starts
or changes an engine.  Found by the next command (which holds the lock now),
it means that command died halfway.  The engines it may have left are the
recorded engine (engine.json) and the processes the intent names that were
created after the dead command started (a PID reused since is older than
that, or not a child of it).  For each, in that order: give it its KV cache
back if the dead command had taken it (a snapshot or a restore), then adopt
it if it answers and passes the canary; stop the rest.  When nothing serves
and the dead command was to leave the service serving, start it cold.
The interrupted restart gets its record in history.jsonl.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path
from typing import Callable, Iterator

from restartkit.guard.deferred import deferred_signals
from restartkit.guard.intent import Intent
from restartkit.guard.lock import service_lock
from restartkit.guard.preflight import preflight_writable
from restartkit.guard.trust import check_trusted
from restartkit.record import Record, write_record
from restartkit.snapshot.store import MANIFEST
from restartkit.process.engine import EngineProcess
from restartkit.process.lifecycle import ours
from restartkit.process import keeper
from restartkit.process.seam import Cut
from restartkit.process.procfs import (argv, comm, kill_tree, listeners, owner, proc_start_ticks, proc_state, tracer,
                                       tree_pids)

# commands after which the service was meant to serve
SERVING_COMMANDS = {"restart", "start", "wake", "snapshot restore", "snapshot create", "snapshot refresh", "rollout",
                    "sleep"}



def meant_to_serve(stale: dict) -> bool:
    """The interrupted command would have left the service serving: a serving command on a service that
    served when it began, or supervise's restart of one that crashed (it did not serve, and was to)."""
    command = str(stale.get("command", ""))
    return command.startswith(("supervise restart", "supervise start")) or (command in SERVING_COMMANDS and stale.get("was_serving", True))


def reconcile(service, say: Callable[[str], None], stopping: bool = False) -> dict | None:
    """Returns what was done, or None when there was nothing to reconcile.  `stopping`: a stop
    follows, which stops the recorded engine the usual way: nothing is adopted or started, the
    rest is killed."""
    intent = Intent(service.state_dir)
    stale = intent.read_stale()
    if stale is None:
        return None
    command = stale.get("command", "?")
    say(f"{service.policy.name}: an interrupted `restartkit {command}` (PID {stale.get('pid')}) left work unfinished; "
        "reconciling")
    adopted, stopped = None, []
    found = candidates(service, stale)
    if stale.get("standby"):  # a promotion was under way: its standby is adopted or stopped below, no standby after
        (service.state_dir / "standby.json").unlink(missing_ok=True)
    recorded = service.current()
    kept = recorded.pid if stopping and recorded is not None else None  # for the stop that follows
    # engines first; keepers (a restore's, an engine's) last: the keeper of an adopted engine stays with it
    for pid in sorted(found, key=lambda p: keeper.KEEPER in argv(p)):
        _let_go_by_criu(pid, say, service.seam)
        _continue_if_stopped(pid, say, service.seam)
        if pid == kept:
            continue
        if (adopted is None and not stopping and keeper.KEEPER not in argv(pid)
                and _try_adopt(service, pid, stale, say)):
            adopted = pid
            continue
        if (adopted or kept) is not None and (adopted or kept) in tree_pids(pid):
            continue  # its parent (the keeper that reaps it, or CRIU that restored it): not ours to end
        kill_tree(pid)
        stopped.append(pid)
    if stopped:
        service.seam.reap_until_gone(stopped, service.policy.restart["stop_timeout_s"])
        say(f"{service.policy.name}: stopped {', '.join(map(str, stopped))} (left by the interrupted command, "
            "not serving or not passing the canary)")
    if adopted is None and kept is None:
        service.engine.pidfile.unlink(missing_ok=True)
    _discard_partial_images(stale, say)
    result = {"command": command, "adopted": adopted, "stopped": stopped, "started": None}
    if adopted is None and not stopping and meant_to_serve(stale):
        say(f"{service.policy.name}: nothing serves; recovering with a cold start")
        started = service.engine.start("cold")
        service.canary()
        result["started"] = started.process.pid
    intent.clear()
    _record(service, stale, result)
    return result


def candidates(service, stale: dict) -> list[int]:
    """Live engines the dead command may have left: the recorded one first, then those it started
    (a PID the intent names that anyone else holds now is left alone)."""
    out = []
    proc = service.current()
    if proc is not None:
        out.append(proc.pid)
    since = stale.get("start_ticks")
    sb = stale.get("standby") if isinstance(stale.get("standby"), dict) else {}
    if isinstance(sb.get("pid"), int) and sb["pid"] not in out and proc_start_ticks(sb["pid"]) == sb.get("start_ticks") \
            and owner(sb["pid"]) == os.getuid():
        out.append(sb["pid"])  # a standby the dead command was promoting: armed before it started, ours all the same
    for pid in stale.get("pids") or []:
        # ours only: created after the dead command started, as this user, under a keeper of ours
        if isinstance(pid, int) and pid not in out and ours(pid, since if isinstance(since, int) else None):
            out.append(pid)
    return out


CRIU_LEFT_S = 60.0  # how long a CRIU the dead command left dumping may take to finish before it is killed


def _let_go_by_criu(pid: int, say, seam) -> None:
    """A dump whose restartkit was killed: its CRIU may still hold the tree (ptrace).  Left to finish
    (it leaves the tree running, as the dump asked), within CRIU_LEFT_S; past that it is killed, which lets
    the tree go too.  Until then nothing else touches the tree."""
    tracers = {t for p in tree_pids(pid) if (t := tracer(p)) and "criu" in comm(t)}
    if not tracers:
        return
    say(f"PID {pid}: CRIU (PID {', '.join(map(str, sorted(tracers)))}) still holds it, left by the interrupted "
        "command; waiting for it to let go")
    if not seam.wait_until(lambda: not any(os.path.exists(f"/proc/{t}") and "criu" in comm(t) for t in tracers),
                           CRIU_LEFT_S):
        for t in tracers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(t, signal.SIGKILL)
        say(f"PID {pid}: killed CRIU after {CRIU_LEFT_S:.0f} s")
        seam.wait_until(lambda: not any(tracer(p) in tracers for p in tree_pids(pid)), 5.0)


def _continue_if_stopped(pid: int, say, seam) -> None:
    """A CRIU killed while it held the tree frozen (a dump) leaves it stopped: let it run again."""
    stopped = [p for p in tree_pids(pid) if proc_state(p) in ("T", "t")]
    for p in stopped:
        try:
            os.kill(p, signal.SIGCONT)
        except ProcessLookupError:
            pass
    if stopped:
        say(f"PID {pid}: {len(stopped)} stopped process(es) continued (left frozen by an interrupted CRIU)")
        seam.wait_until(lambda: all(proc_state(p) not in ("T", "t") for p in stopped), 1.0)


def _try_adopt(service, pid: int, stale: dict, say) -> bool:
    adapter, policy = service.adapter, service.policy
    recorded = service.current()
    if (recorded is None or recorded.pid != pid) and pid not in listeners(policy.service["port"]):
        return False  # whoever answers on the port, it is not this process (a keeper, CRIU)
    weights = stale.get("kv_dropped") == "weights" or stale.get("strategy") == "criu+ipc"
    detached = stale.get("detached") or {}
    base = f"http://127.0.0.1:{detached['admin_port']}" if detached.get("admin_port") else None
    if stale.get("kv_dropped") or stale.get("strategy") in ("criu", "criu+ipc"):
        try:  # a restored engine, or one snapshotted, waits for its KV cache (and its weights: weights-less)
            adapter.after_resume(policy, timeout=10.0, weights=weights, base=base)
        except Exception as e:
            say(f"{policy.name}: PID {pid} did not take its KV cache back: {e}")
    if detached.get("pid") == pid:  # it gave up the held socket for a dump: it takes it back from supervise
        from restartkit.snapshot.ops import take_back_listener
        try:
            take_back_listener(service, pid)
        except Exception as e:
            say(f"{policy.name}: PID {pid} did not take the held socket back: {getattr(e, 'message', e)}")
    try:
        adapter.probe(policy, timeout=10.0)
        after = adapter.canary(policy)
    except Exception as e:
        say(f"{policy.name}: PID {pid} does not serve: {e}")
        return False
    baseline, _source = service.stored_canary()
    if baseline is not None and baseline != after:
        say(f"{policy.name}: PID {pid} serves a different canary; not adopted")
        return False
    proc = EngineProcess(pid=pid, start_ticks=proc_start_ticks(pid), log_path=service.engine.log_path, seam=service.seam)
    service.engine.mark_ready(proc, stale.get("strategy") or "adopted")
    say(f"{policy.name}: adopted PID {pid}: it serves and its canary is identical")
    return True


def _discard_partial_images(stale: dict, say) -> None:
    """A snapshot directory the dead command was writing (no manifest: never complete)."""
    images = Path(stale["images"]) if stale.get("images") else None
    if images is not None and images.is_dir() and not (images / MANIFEST).exists():
        shutil.rmtree(images, ignore_errors=True)
        say(f"removed the unfinished snapshot {images}")


def _record(service, stale: dict, result: dict) -> None:
    if stale.get("record") and not (result["adopted"] or result["started"] or result["stopped"]):
        return  # a command cut short wrote its record already, and nothing was left to do
    rec = Record(service=service.policy.name, policy=service.policy.path, requested=stale.get("strategy") or "-",
                 reason=stale.get("reason") or "restart", plan={})
    rec.started_at = stale.get("started_at") or rec.started_at
    rec.via_recovery = True
    how = (f"adopted PID {result['adopted']}" if result["adopted"] else
           f"cold start (PID {result['started']})" if result["started"] else "nothing started")
    rec.recovery_reason = f"`restartkit {result['command']}` was interrupted; reconciled by the next command: {how}"
    rec.attempts.append({"strategy": "reconcile", "role": "recovery", "ok": bool(result["adopted"] or result["started"]),
                         "adopted": result["adopted"], "stopped": result["stopped"], "started": result["started"]})
    if result["adopted"] or result["started"]:
        rec.final_state, rec.served_by = "serving", "adopted engine" if result["adopted"] else "cold"
    rec.finish(strict=False)
    write_record(service, rec)


@contextlib.contextmanager
def guarded(service, command: str, wait_s: float = 0.0, say: Callable[[str], None] = lambda _m: None,
            extra_dirs: tuple[tuple[Path, str], ...] = (), defer_signals: bool = True,
            writes: bool = True) -> Iterator[list[int]]:
    """Everything a command that changes a service does first: the state dir (and
    `extra_dirs`) proven writable, the service's lock, signals deferred, an
    interrupted command before it reconciled, and its own intent begun.
    `writes=False` (stop): a full or read-only state dir does not stop it, its intent is written where it can be.
    Yields the list of deferred signals received (empty: none)."""
    if writes:
        preflight_writable(service.state_dir)
    else:
        check_trusted(service.state_dir, "state dir", "--state-dir / [service] state_dir")
        service.intent.best_effort = True
    for directory, what in extra_dirs:
        preflight_writable(directory, what)
    with service_lock(service.state_dir, service.policy.name, command, wait_s, say):
        with (deferred_signals(say, f"`restartkit {command}`") if defer_signals else contextlib.nullcontext([])) as got:
            service.reconciled = reconcile(service, say, stopping=command.endswith("stop"))
            from restartkit.standby.armed import stop_orphaned
            stop_orphaned(service, say)
            service.intent.begin(command, was_serving=service.current() is not None)
            if defer_signals:  # else the caller's own (supervise's) list stays
                service.interrupts = got
            try:
                yield got
            except Cut:  # cut at a safe point: what it started is gone; the intent says what it was doing
                raise
            except BaseException:
                service.intent.clear()
                raise
            else:
                service.intent.clear()
