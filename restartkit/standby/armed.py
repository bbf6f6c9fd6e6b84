"""The standby engine: a second engine process kept armed, so that a crash or a restart pays
for activation only (KV cache, graph capture, the port), not for Python, `import torch`, the
device context, the tokenizer and the weights (attached zero-copy from the weight cache: no
second copy) nor the first forward pass (run ahead, on a small KV cache it frees).

It is the reference engine in prepare-only mode with no activation deadline: it answers on a
private loopback port only, never on the service's, until it is promoted (SIGUSR1: activate;
SIGUSR2: take the public port, SO_REUSEPORT).  `standby.json` in the state dir names it (PID and
start ticks, what it was armed with: engine version, code, weights); `standby-status.json` is the
engine's own account of its state (preparing, prepared, active, ready, failed).  At tensor parallel
size > 1 its workers prepare with it and wait for rank 0's go (restartkit.reference.serving.workers).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import time
from pathlib import Path

from restartkit.files import write_json_atomic
from restartkit.process.engine import EngineProcess
from restartkit.process.memory import tree_memory
from restartkit.process.procfs import kill_tree, proc_start_ticks

STANDBY = "standby.json"
STATUS = "standby-status.json"
NO_DEADLINE_S = 10 * 365 * 86400.0  # an armed standby waits for its promotion as long as it lives


@functools.cache
def code_digest() -> str:
    """The engine's code as this restartkit has it (a standby armed by other code is not promoted)."""
    import restartkit.reference as ref
    h = hashlib.sha256()
    for p in sorted(Path(ref.__file__).parent.glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def _paths(service) -> tuple[Path, Path]:
    return service.state_dir / STANDBY, service.state_dir / STATUS


def cannot_stand_by(policy) -> str | None:
    """Why no standby can be held for this service (None: one can)."""
    from restartkit.engines import get_adapter
    adapter, problem = get_adapter(policy.service["engine"])
    return problem if adapter is None else adapter.standby_problem(policy)


def arm(service) -> dict:
    """Start a standby (no wait: `state(service)` says when it is prepared); returns its record."""
    from restartkit.errors import UsageError
    from restartkit.process.lifecycle import _disk_digest
    if why := cannot_stand_by(service.policy):  # before any process is spawned
        raise UsageError(f"no standby can be armed for {service.policy.name}: {why}",
                         hint=f"set [standby] enabled = false in {service.policy.path}, or see the README's standby section")
    path, status = _paths(service)
    status.unlink(missing_ok=True)
    ahead, why = kv_ahead(service)
    args = service.adapter.ipc_args(service.policy) + ["--prepare-only", "--status-file", str(status),
                                                      "--activate-timeout", str(NO_DEADLINE_S)]
    if ahead:
        args.append("--activate-ahead")
    proc, _ = service.engine.spawn("standby", args)  # it inherits the service's held socket, if one is held
    proc.close_ready_fd()  # its readiness comes through the status file
    rec = {"pid": proc.pid, "start_ticks": proc.start_ticks, "create_time": proc.create_time,
           "listen_inode": _held_inode(service),
           "armed_at": time.time(), "version": service.adapter.version(), "code": code_digest(),
           "model_digest": _disk_digest(service.policy.service["model"]), "status_file": str(status),
           "kv_ahead": ahead, "kv_ahead_why": why}
    try:
        write_json_atomic(path, rec)
    except OSError:
        proc.stop(timeout_s=5)  # a standby no record names would be nobody's: never left running
        raise
    return rec


def arm_prepared(service, say) -> dict:
    """`restartkit standby arm`: replace any standby with a new one and wait until it is prepared (within
    [restart] start_timeout_s); EngineStartError, the standby stopped, when it is not."""
    from restartkit.errors import EngineStartError
    disarm(service)
    rec = arm(service)
    say(f"{service.policy.name}: standby PID {rec['pid']} preparing; its log: {service.engine.log_path}")
    timeout = service.policy.restart["start_timeout_s"]
    done = service.seam.wait_until(lambda: (state(service) or {}).get("state") in ("prepared", "dead", "failed"),
                                   timeout, 0.05)
    st = state(service) or {"state": "dead"}
    if not done or st["state"] != "prepared":
        disarm(service)
        what = f"was not prepared within {timeout:.0f} s" if not done else f"{st['state']} while preparing"
        raise EngineStartError(f"the standby {what}; stopped", hint=f"see its log: {service.engine.log_path}")
    if st.get("kv_ahead"):  # its activation ahead done too, then its canary ahead (else the promotion asks its own)
        service.seam.wait_until(lambda: (state(service) or {}).get("engine_state") in ("active", "dead", "failed"),
                                timeout, 0.05)
        try:
            if canary_ahead(service):
                st = state(service) or st
        except Exception as e:
            say(f"{service.policy.name}: the standby's canary ahead failed ({getattr(e, 'message', None) or e}); its "
                "promotion will take its canary on the service's port")
    return st


def canary_ahead(service) -> bool:
    """A standby activated ahead (its KV cache and graph ready) answers the policy's canary on its private
    port while it waits; kept in standby.json, it is the promotion's proof, so that no client's first request
    queues behind a canary of restartkit's own on the public port.  Run under the service's lock (a promotion
    consumes standby.json).  True when the record holds one now."""
    path, _ = _paths(service)
    rec = state(service)
    if rec is None or not rec.get("kv_ahead") or rec.get("engine_state") != "active" or not rec.get("admin_port"):
        return False  # not activated ahead, or its activation (KV cache, graph capture) not done yet
    r = service.policy.restart
    if canary_of(service, rec) is not None:
        return True
    tokens = service.adapter.canary(service.policy, base=f"http://127.0.0.1:{rec['admin_port']}")
    raw = json.loads(path.read_text())
    if raw.get("pid") != rec["pid"]:
        return False  # replaced meanwhile
    raw["canary"] = {"prompts": r["canary_prompts"], "max_tokens": r["canary_max_tokens"], "tokens": tokens,
                     "at": time.time()}
    write_json_atomic(path, raw)
    return True


def canary_of(service, rec: dict) -> list | None:
    """The canary the standby answered while it waited, if it was asked the policy's canary as it is now."""
    c = rec.get("canary") or {}
    r = service.policy.restart
    if c.get("prompts") == r["canary_prompts"] and c.get("max_tokens") == r["canary_max_tokens"]:
        return c.get("tokens")
    return None


def kv_ahead(service) -> tuple[bool, str]:
    """Whether the standby allocates its KV cache while it waits ([standby] kv_ahead), and why."""
    from restartkit.process.memory import free_memory
    want = service.policy.standby["kv_ahead"]
    if want != "auto":
        return want == "always", f"[standby] kv_ahead = {want!r}"
    if service.policy.service["device"] != "cuda":
        return False, "on the CPU an activated standby would take the serving engine's cores while it waits"
    if getattr(service.adapter, "kv_cache_when_built", False):
        return True, (f"{service.adapter.label} allocates its KV cache when it is built: activated ahead at no cost, "
                      "its canary is asked on its private port while it waits (never in a batch of clients' requests)")
    if (tp := service.policy.service["tensor_parallel_size"]) > 1:
        return False, (f"at tensor_parallel_size {tp} only GPU 0's free memory would be known; the KV caches are "
                       "allocated at promotion (kv_ahead = \"always\" allocates them ahead on every rank)")
    try:
        kv = service.adapter.stats(service.policy, timeout=5).get("kv_cache_bytes") or 0
    except Exception:
        return False, "the running engine did not say how large its KV cache is"
    free = free_memory(service.policy.service["device"])
    if free is None or not kv:
        return False, "free memory or the KV cache's size unknown"
    ok = free >= 2 * kv
    return ok, f"{free / 1e9:.1f} GB free {'holds' if ok else 'cannot hold'} twice the KV cache ({kv / 1e9:.2f} GB)"


def state(service) -> dict | None:
    """The standby as it is now: its record, `alive`, and the engine's own `state` (prepared: armed);
    None when there is none."""
    path, status = _paths(service)
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("pid"), int):
        return None
    rec["alive"] = service.seam.alive(rec["pid"], start_ticks=rec.get("start_ticks"))
    try:
        st = json.loads(status.read_text())
    except (OSError, ValueError):
        st = {}
    rec["state"] = st.get("state", "starting") if rec["alive"] else "dead"
    rec["engine_state"] = rec["state"]  # its own word (an activated-ahead standby: "active" once done)
    rec["admin_port"] = st.get("admin_port")
    if rec["state"] == "active" and rec.get("kv_ahead"):
        rec["state"] = "prepared"  # activated ahead: its KV cache and graph are ready, it waits for the port
    if st.get("state") in ("prepared", "active"):
        rec["prepared_at"] = st.get("at")
        rec["prepare_s"] = round(st["at"] - rec["armed_at"], 3) if st.get("at") else None
        rec["phases"] = st.get("phases") or {}
    rec["rss_bytes"] = tree_memory(rec["pid"], "cpu") if rec["alive"] else None  # its tensor-parallel ranks too
    return rec


# how long an armed standby may take to answer /health on its private port before it counts as busy (not frozen)
LIVENESS_TIMEOUT_S = 1.0


def frozen(rec: dict, probe: bool = True) -> str | None:
    """Why an armed standby that is alive would not answer if promoted now (None: it answers, or is only busy):
    a process of its tree stopped (SIGSTOP), or (`probe`) nothing listening on its private port any more.  A
    slow answer is not one of them: on a loaded host a prepared standby's /health can take seconds, and a busy
    standby promoted still beats a cold start (its promotion has a deadline of its own, then the recovery)."""
    from restartkit import http
    from restartkit.process.procfs import port_has_listener, stopped_in
    if (pid := stopped_in(rec["pid"])) is not None:
        return (f"the standby (PID {rec['pid']}) is frozen: PID {pid} is stopped (state T; SIGCONT resumes it, or "
                "`restartkit standby disarm`)")
    if not probe or not rec.get("admin_port"):
        return None
    try:
        http.get(f"http://127.0.0.1:{rec['admin_port']}/health", timeout=LIVENESS_TIMEOUT_S)
    except http.HTTPFailure as e:
        # no answer at all (any HTTP status, 503 not activated yet, is one): dead only when nothing listens
        if e.status is None and not port_has_listener(rec["admin_port"]):
            return (f"the standby (PID {rec['pid']}) has nothing listening on its private port {rec['admin_port']} "
                    f"any more ({e.message})")
    return None


def process(service, rec: dict) -> EngineProcess:
    return EngineProcess(pid=rec["pid"], create_time=rec.get("create_time"), start_ticks=rec.get("start_ticks"),
                         log_path=service.engine.log_path, seam=service.seam)


def consumed(service) -> None:
    """The standby became the service's engine: it is no standby any more."""
    for p in _paths(service):
        p.unlink(missing_ok=True)


def disarm(service, timeout_s: float = 10.0) -> int | None:
    """Stop the standby (SIGTERM, then its tree killed); returns its PID, None when there was none (or the
    process standby.json names is not one restartkit started: another user's, or not under its keeper)."""
    from restartkit.process.lifecycle import ours
    rec = state(service)
    consumed(service)
    if rec is None or not rec["alive"]:
        return None
    current = service.current()
    if current is not None and current.pid == rec["pid"]:
        return None  # promoted (by a command that died before it said so): the service's engine now
    if proc_start_ticks(rec["pid"]) != rec.get("start_ticks") or not ours(rec["pid"], rec.get("start_ticks")):
        return None  # not ours (any more): another user's, or not under a keeper of ours, whatever standby.json says
    try:
        os.kill(rec["pid"], signal.SIGTERM)
    except ProcessLookupError:
        return rec["pid"]
    if not service.seam.wait_until(lambda: not service.seam.alive(rec["pid"], start_ticks=rec["start_ticks"]),
                                   timeout_s, 0.05):
        kill_tree(rec["pid"])
        service.seam.reap_until_gone([rec["pid"]], 5.0)
    return rec["pid"]


def stop_orphaned(service, say) -> None:
    """An armed standby left holding a copy of the service's socket with no engine serving and no supervisor
    (its supervisor killed right after a crash, before it promoted it): it never accepts, so clients queue and the
    port stays taken.  Stopped, and said, before anything else starts."""
    from restartkit.service import supervised
    if service.current() is not None or supervised(service.state_dir):
        return  # an engine serves, or a supervisor owns the standby (it may be promoting it now)
    from restartkit.process.procfs import listeners
    rec = state(service)
    if rec is None or not rec.get("alive") or rec["pid"] not in listeners(service.policy.service["port"]):
        return  # armed without the service's socket (by `standby arm`): a crash restart by hand promotes it
    if (pid := disarm(service)) is not None:
        say(f"{service.policy.name}: stopped the standby (PID {pid}) left holding the service's socket with no "
            "engine serving (its supervisor died before it promoted it)")


def _held_inode(service) -> int | None:
    held = service.engine.listener()
    return held.inode if held is not None else None


def stale(service, rec: dict) -> str | None:
    """Why an armed standby may not be promoted for this service as it is now (None: it may)."""
    from restartkit.process.lifecycle import _disk_digest
    if rec["version"] != service.adapter.version() or rec["code"] != code_digest():
        return f"it was armed by another engine version or code ({rec['version']}, code {rec['code']})"
    if rec.get("listen_inode") != (held := _held_inode(service)):
        return ("it was armed before the service's socket was held; it would bind the port itself" if held
                else "it was armed on a socket its supervisor held, and no supervisor holds it now")
    digest = _disk_digest(service.policy.service["model"])
    if digest and rec.get("model_digest") and digest != rec["model_digest"]:
        return "the weights on disk changed since it was armed"
    return None

