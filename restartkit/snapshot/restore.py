"""Restore a snapshot as the service's engine: identity check -> the image's PIDs free (with a deadline) -> CRIU
restore -> (GPU: driver restore + unlock) -> KV cache back -> a real completion.  The caller verifies the
canary and runs recovery on failure."""
from __future__ import annotations

import os
import signal
import time

from restartkit.errors import StrategyError
from restartkit.process.engine import EngineProcess, describe_exit
from restartkit.process.procfs import comm, kill_tree, parent, proc_state, reap
from restartkit.process.seam import Seam
from restartkit.snapshot.criu import Criu, CriuError, put_back_shm, restored_exit
from restartkit.snapshot.ops import (REATTACH_TIMEOUT_S, device_restore, host_identity, image_damage, mismatches,
                                     take_back_listener)
from restartkit.snapshot.seal import seal_problem
from restartkit.snapshot.store import Snapshot


ZOMBIE_GRACE_S = 2.0  # how long another parent may take to collect an exited process before it is named


def wait_pids_free(pids: list[int], deadline_s: float, seam: Seam | None = None) -> list[int]:
    """The PIDs still taken when the deadline passed (empty: all free).  A zombie that is not ours
    waits for its parent, not for us: once every PID left has been such a zombie for ZOMBIE_GRACE_S,
    waiting out the rest of the deadline buys nothing.  Not at once: an engine stopped a moment ago is
    a zombie until its keeper is next scheduled (milliseconds, more on a loaded host)."""
    seam = seam or Seam()
    taken: list[int] = []
    zombies_since: float | None = None  # since when every PID left has been a zombie that is not ours

    def free() -> bool:
        nonlocal zombies_since
        for p in pids:
            reap(p)
        taken[:] = [p for p in pids if os.path.exists(f"/proc/{p}")]
        if not taken:
            return True
        if not all(proc_state(p) == "Z" and parent(p) != os.getpid() for p in taken):
            zombies_since = None
            return False
        zombies_since = zombies_since if zombies_since is not None else seam.clock()
        return seam.clock() - zombies_since >= ZOMBIE_GRACE_S
    seam.wait_until(free, deadline_s)
    return taken


def snapshot_fault(e: Exception) -> Exception:
    """Mark an error as the snapshot's own (its images do not restore): the snapshot becomes suspect."""
    e.snapshot_fault = True
    return e


def restore(service, facts, snap: Snapshot) -> tuple[EngineProcess, dict, dict]:
    """Restore `snap` as the service's engine; returns the process, the phases and, for a
    weights-less snapshot, how its weights came back (the engine's load info: ipc hit).
    Raises StrategyError (CriuError with the log tail) on any failure; the
    caller kills what is left and runs recovery.  Only a failure of the images
    themselves carries `snapshot_fault`: a host that does not match, PIDs or a
    port taken by others, a restored engine killed or stopped by someone else
    say nothing about the snapshot.  One deadline, [restart] start_timeout_s,
    bounds everything after CRIU's own restore (KV cache back, readiness)."""
    # long: the restore's phases in order, each timed and each failure named with its hint
    phases: dict[str, float] = {}
    miss = mismatches(snap.manifest["identity"], host_identity(service, facts))
    if miss:
        raise StrategyError("the snapshot does not match this host: " + "; ".join(miss))
    t = time.monotonic()
    taken = wait_pids_free(snap.manifest["tree_pids"], service.policy.criu["pid_wait_s"], service.seam)
    phases["wait_pids"] = round(time.monotonic() - t, 3)
    if taken:
        holders = ", ".join(f"{p} ({comm(p)}" + (f", a zombie its parent PID {parent(p)} has not collected)"
                                                  if proc_state(p) == "Z" else ")") for p in taken)
        raise StrategyError(f"the snapshot's PIDs are taken: {holders}",
                            hint="CRIU restores processes under their old PIDs; they stayed taken past [criu] pid_wait_s")
    if holder := service.engine.port_holder():
        raise StrategyError(f"port {service.policy.service['port']} is already in use by {holder}; "
                            "the restored engine could not listen there",
                            hint=f"stop that process, or set another [service] port in {service.policy.path}")
    damaged = image_damage(snap)
    if damaged:
        raise snapshot_fault(StrategyError("the snapshot's images are damaged: " + "; ".join(damaged)))
    gathered = facts.of("criu")  # the plan checked the seal a moment ago: not hashed twice on the restore's path
    problem = gathered["seal_problem"] if gathered.get("current") == snap.id and "seal_problem" in gathered else \
        seal_problem(snap.manifest, snap.path)
    if problem:
        raise snapshot_fault(StrategyError(f"snapshot {snap.id} is not restored: {problem}",
                                           hint="take a new one: restartkit snapshot create"))
    crit = Criu(facts.host.criu.path)
    t = time.monotonic()
    put_back_shm(snap.path)
    service.intent.update(pids=snap.manifest["tree_pids"])
    try:
        pid = crit.restore(snap.path, service.policy.criu["restore_timeout_s"], snap.manifest["tree_pids"],
                           note_pids=lambda pids: service.intent.update(pids=pids))
    except CriuError as e:
        raise (e if e.external or e.message.startswith("could not run") else snapshot_fault(e))
    phases["criu_restore"] = round(time.monotonic() - t, 3)
    proc = service.engine.adopt(pid, "criu")
    deadline = time.monotonic() + service.policy.restart["start_timeout_s"]
    try:
        if snap.manifest.get("gpu"):
            phases["cuda_restore"] = device_restore(pid)
        t = time.monotonic()
        weightless = snap.manifest.get("kind") == "weightless"
        base = admin_base(snap.manifest)  # it gave up the held socket for its dump: admin calls go there
        try:
            # a re-attach maps one handle and allocates the KV cache: seconds at most, whatever the start timeout
            limit = max(1.0, deadline - time.monotonic())
            load = service.adapter.after_resume(service.policy, timeout=min(limit, REATTACH_TIMEOUT_S) if weightless
                                                else limit, weights=weightless, base=base)
        except Exception as e:
            what = "its weights from the weight cache" if weightless else "its KV cache"
            raise StrategyError(f"the restored engine (PID {pid}) did not take {what} back: "
                                f"{getattr(e, 'message', None) or e}",
                                hint=_ask_for_stacks(service, pid) if _no_answer(e) else None) from None
        phases["reattach_weights" if weightless else "kv_cache_restore"] = round(time.monotonic() - t, 3)
        if base is not None:  # then the held socket, from supervise
            phases["take_back_listener"] = take_back_listener(service, pid)
        t = time.monotonic()
        remaining = max(1.0, deadline - time.monotonic())
        proc.wait_ready(lambda: service.adapter.probe(service.policy, timeout=min(30.0, remaining)), remaining)
        phases["ready"] = round(time.monotonic() - t, 3)
    except BaseException as e:
        kill_tree(pid)
        service.engine.pidfile.unlink(missing_ok=True)
        if isinstance(e, StrategyError):
            raise _blame(e, pid, restored_exit(snap.path)) from None
        raise
    service.engine.mark_ready(proc, "criu+ipc" if weightless else "criu")
    return proc, phases, load


def admin_base(manifest: dict) -> str | None:
    """Where a restored engine of this snapshot answers admin calls before it takes the held socket back
    (None: it restores with its own socket)."""
    port = (manifest.get("listener") or {}).get("admin_port")
    return f"http://127.0.0.1:{int(port)}" if port else None


# how a restored engine ends when others end it (a stop, a kill): nothing to do with its images
EXTERNAL_ENDS = {-signal.SIGKILL, -signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP, -signal.SIGQUIT}


def _blame(e: StrategyError, pid: int, ended: int | None) -> StrategyError:
    """A restored engine that died by itself (a crash signal, an exit of its own) before it served:
    its images are at fault, and the snapshot is marked.  One that is still alive (a timeout), or
    that others stopped or killed, says nothing about the snapshot."""
    if ended is None or ended in EXTERNAL_ENDS:
        return e
    return snapshot_fault(StrategyError(f"{e.message}; the restored engine (PID {pid}) {describe_exit(ended)} "
                                        "on its own: its snapshot is at fault", hint=e.hint))


def _no_answer(e: Exception) -> bool:
    """The engine did not answer at all (a timeout), as opposed to answering with an error."""
    return hasattr(e, "status") and e.status is None


def _ask_for_stacks(service, pid: int) -> str | None:
    """Before a stuck restored engine is killed: have it write its threads' stacks to its log
    (where the engine can), and say where they are."""
    sig = service.adapter.stack_signal
    if sig is None:
        return None
    try:
        os.kill(pid, sig)
    except OSError:
        return None
    service.seam.sleep(0.5)  # the engine writes them from its signal handler
    return f"its threads' stacks, written when it was given up on, are at the end of {service.engine.log_path}"
