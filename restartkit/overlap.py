"""Overlapped restart: prepare the new engine while the old one serves.

The new engine starts in prepare-only mode: process start, imports, device
context, weights attached from the weight cache, model built, on a private
loopback port.  Then it is activated (KV cache, warm-up, graph capture) and
takes the public port beside the old engine (SO_REUSEPORT: the kernel hands
new connections to both, so the port is never closed); it is checked alone on
its private port (a real completion and the canary); only then is the old
engine drained and stopped.  Any failure before that leaves the old engine
serving and says why.

Why SO_REUSEPORT rather than passing the listening socket from restartkit:
restartkit is not a long-lived parent of the engine, and a socket passed at
start would have to be owned by someone between restarts; with SO_REUSEPORT
each engine owns its socket and the port stays open throughout.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

from restartkit import http
from restartkit.memory import free_memory
from restartkit.strategies.base import Outcome
from restartkit.supervise import ProcState


def _status(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _wait_state(path, proc, wanted: str, deadline_s: float) -> dict:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        st = _status(path)
        if st.get("state") == wanted:
            return st
        if st.get("state") == "failed":
            raise RuntimeError(st.get("error", "the new engine failed"))
        if not proc.alive():
            raise RuntimeError(f"the new engine exited (code {proc.returncode()}) before it was {wanted}")
        time.sleep(0.01)
    raise RuntimeError(f"the new engine was not {wanted} within {deadline_s:.0f} s")


def _old_serves(out: Outcome, error: str) -> Outcome:
    """Failed before the old engine was touched: it keeps serving, nothing to recover."""
    out.error, out.old_still_serving = error, True
    return out


def _took_over(service, new, how: str, new_stats: dict, out: Outcome, t0: float) -> Outcome:
    """The new engine serves on the public port and the old one is gone: it is the service's engine now."""
    new.to(ProcState.READY)
    service.mark_ready(new, how)
    out.engine_phases = new_stats.get("phases", {})
    out.phases["start_to_ready"] = round(time.monotonic() - t0, 4)
    out.ok = True
    return out


def _spawn_prepared(service, name: str):
    """Start the new engine in prepare-only mode; returns (process, its status file)."""
    status_path = service.state_dir / "overlap-status.json"
    status_path.unlink(missing_ok=True)
    args = service.adapter.ipc_args(service.policy) + ["--prepare-only", "--status-file", str(status_path)]
    new, _ = service.spawn(name, args)
    new.close_ready_fd()  # readiness comes through the status file here
    return new, status_path


def _activate(service, new, status_path, out: Outcome, old) -> tuple[str, dict]:
    """SIGUSR1, wait until active, and require a weight-cache hit; returns (private URL, its stats)."""
    os.kill(new.pid, signal.SIGUSR1)
    st = _wait_state(status_path, new, "active", service.policy.restart["start_timeout_s"])
    private = f"http://127.0.0.1:{st['admin_port']}"
    new_stats = http.get(private + "/admin/stats", timeout=10)
    load = new_stats.get("load") or {}
    out.proof.update(ipc=load.get("ipc"), mode=load.get("mode"), attach_s=load.get("attach_s"),
                     new_pid=new.pid, old_pid=old.pid, private_port=st["admin_port"])
    if load.get("ipc") != "hit":
        raise RuntimeError(f"the new engine did not attach from the weight cache: {load.get('ipc')}({load.get('fallback_reason')})")
    if service.policy.service["draft_model"]:
        from restartkit.strategies.ipc import draft_proof
        out.proof["draft"], draft = draft_proof(load)
        if out.proof["draft"] != "hit":
            raise RuntimeError("the new engine did not attach its draft model from the weight cache: "
                               f"{out.proof['draft']}({draft.get('fallback_reason')})")
    return private, new_stats


def overlapped_ipc(service, facts, strategy_name: str = "ipc") -> Outcome:
    pol = service.policy
    phases: dict[str, float] = {}
    out = Outcome(strategy_name, ok=False, phases=phases, proof={"overlap": True})
    old = service.current()
    stats = facts.service.extra.get("engine_stats") or {}
    if old is not None and pol.restart["overlap_mode"] == "prestart":
        out.proof["overlap_mode"] = "prestart"
        return _prestart(service, old, out)
    if old is None or not stats.get("reuse_port"):
        out.error = "the running engine was not started with SO_REUSEPORT ([restart] overlap = true): restart it once first"
        out.old_still_serving = old is not None
        return out
    kv = stats.get("kv_cache_bytes") or 0
    free = free_memory(pol.service["device"])
    out.proof["memory"] = {"free": free, "new_kv_cache": kv}
    mode = pol.restart["overlap_mode"]
    if mode == "auto":
        mode = "serve_beside" if free is None or free >= kv else "prestart"
    out.proof["overlap_mode"] = mode
    if mode == "prestart":
        return _prestart(service, old, out)
    if free is not None and free < kv:
        return _old_serves(out, f"{free / 1e9:.2f} GB free cannot hold a second KV cache of {kv / 1e9:.2f} GB: "
                           "set [restart] overlap_mode = 'prestart' (or 'auto'): the new engine then activates once "
                           "the old one stopped")
    t0 = time.monotonic()
    new, status_path = _spawn_prepared(service, "ipc-overlap")
    try:
        _wait_state(status_path, new, "prepared", pol.restart["start_timeout_s"])
        phases["prepare"] = round(time.monotonic() - t0, 4)
        t1 = time.monotonic()
        private, new_stats = _activate(service, new, status_path, out, old)
        phases["activate"] = round(time.monotonic() - t1, 4)
        # checked alone, before it takes a single public request
        out.proof["new_engine_canary"] = _canary_at(service, private)
        os.kill(new.pid, signal.SIGUSR2)
        _wait_state(status_path, new, "ready", 30)
    except Exception as e:
        new.stop(timeout_s=5)
        return _old_serves(out, f"the new engine failed before the old one was stopped: {e}")
    t2 = time.monotonic()
    how = service.stop()  # SIGTERM: the old engine finishes what it is answering, closes its listener
    phases["stop_old"] = round(time.monotonic() - t2, 4)
    out.proof["old_stop"] = how
    return _took_over(service, new, "ipc-overlap", new_stats, out, t0)


def _prestart(service, old, out: Outcome) -> Outcome:
    """The new engine does everything that needs no memory of its own (process
    start, imports, device context, weights mapped zero_copy) while the old one
    serves; then the old one stops, and the new one allocates its KV cache,
    warms up, is checked alone on its private port and takes the public port.
    Downtime: the old engine's stop plus the activation, not the process start."""
    pol, phases = service.policy, out.phases
    if pol.ipc["mode"] != "zero_copy":
        return _old_serves(out, "prestart needs [ipc] mode = 'zero_copy' (copied weights would need their memory "
                                "beside the old engine's)")
    t0 = time.monotonic()
    new, status_path = _spawn_prepared(service, "ipc-prestart")
    try:
        _wait_state(status_path, new, "prepared", pol.restart["start_timeout_s"])
    except Exception as e:
        new.stop(timeout_s=5)
        return _old_serves(out, f"the new engine failed before the old one was stopped: {e}")
    phases["prepare"] = round(time.monotonic() - t0, 4)
    t1 = time.monotonic()
    out.proof["old_stop"] = service.stop()  # drained, exited: its KV cache is free
    phases["stop_old"] = round(time.monotonic() - t1, 4)
    try:
        private, new_stats = _activate(service, new, status_path, out, old)
        phases["activate"] = round(time.monotonic() - t1 - phases["stop_old"], 4)
        # every check here is downtime: one canary prompt before the port opens, all of them by the restart's verify
        out.proof["new_engine_canary"] = _canary_at(service, private, first_only=True)
        os.kill(new.pid, signal.SIGUSR2)
        _wait_state(status_path, new, "ready", 30)
    except Exception as e:  # the old engine is gone: the restart's recovery (cold) takes over
        if new.alive():
            new.stop(timeout_s=5)
        out.error = f"the prestarted engine failed after the old one stopped: {e}"
        return out
    phases["stop_to_ready"] = round(time.monotonic() - t1, 4)
    return _took_over(service, new, "ipc-prestart", new_stats, out, t0)


def _canary_at(service, base: str, first_only: bool = False) -> list[list[int]]:
    pol = service.policy
    prompts = pol.restart["canary_prompts"][:1] if first_only else pol.restart["canary_prompts"]
    return [service.adapter.completion(pol, p, pol.restart["canary_max_tokens"], base=base)["choices"][0]["token_ids"]
            for p in prompts]


class DowntimeProbe:
    """A client hammering the service through a restart: the longest gap
    between two answered requests is the downtime as users see it."""

    def __init__(self, service, interval_s: float = 0.02, timeout_s: float = 2.0):
        self.service, self.interval, self.timeout = service, interval_s, timeout_s
        self.events: list[tuple[float, bool, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.started_at = time.monotonic()  # the service answered just before: the baseline canary
        self._thread.start()

    def stop(self) -> None:
        """Idempotent; waits for a short tail of answers after the restart."""
        if self._stop.is_set() or not self._thread.is_alive():
            self._stop.set()
            return
        time.sleep(0.3)
        self._stop.set()
        self._thread.join(5)

    def _run(self):
        url = self.service.adapter.base_url(self.service.policy) + "/v1/completions"
        body = {"model": self.service.adapter.served_name(self.service.policy), "prompt": "ping", "max_tokens": 1,
                "temperature": 0.0}
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                http.post(url, body, timeout=self.timeout)
                self.events.append((t, True, ""))
            except http.HTTPFailure as e:
                self.events.append((t, False, str(e.status or "connection")))
            except Exception as e:  # a connection cut mid-answer (IncompleteRead...): still a failed request
                self.events.append((t, False, type(e).__name__))
            time.sleep(self.interval)

    def summary(self) -> dict:
        ok = [getattr(self, "started_at", None)] + [t for t, good, _ in self.events if good]
        ok = [t for t in ok if t is not None]
        gaps = [b - a for a, b in zip(ok, ok[1:])]
        worst = max(range(len(gaps)), key=gaps.__getitem__) if gaps else None
        errors: dict[str, int] = {}
        for _, good, kind in self.events:
            if not good:
                errors[kind] = errors.get(kind, 0) + 1
        base = getattr(self, "started_at", 0.0)
        return {"requests": len(self.events), "answered": len(ok) - 1, "failed": errors,
                "downtime_s": round(gaps[worst], 4) if gaps else None,
                "gap_from_s": round(ok[worst] - base, 4) if gaps else None}


