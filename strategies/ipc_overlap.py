"""Overlapped restart: prepare the new engine while the old one serves.

The new engine starts in prepare-only mode: process start, imports, device
context, weights attached from the weight cache, model built, on a private
loopback port.  Then it is activated (KV cache, warm-up, graph capture) and
checked alone on its private port (a real completion and the canary); then it
takes the public port beside the old engine (SO_REUSEPORT, the port never
closed; from then on the kernel hands every new connection to the new engine:
restartkit.reference.serving.reuseport), and the old engine is drained and stopped
(it answers what it accepted, and what was still queued on its listener).
Any failure before that leaves the old engine serving and says why.

Why SO_REUSEPORT rather than passing the listening socket from restartkit:
restartkit is not a long-lived parent of the engine, and a socket passed at
start would have to be owned by someone between restarts; with SO_REUSEPORT
each engine owns its socket and the port stays open throughout.
"""
from __future__ import annotations

import os
import signal
import time

from restartkit.contracts import Outcome
from restartkit.process.memory import free_memory
from restartkit.standby.prepared import activate, canary_at, old_serves, spawn_prepared, took_over, wait_state


def overlapped_ipc(service, facts, strategy_name: str = "ipc") -> Outcome:
    pol = service.policy
    phases: dict[str, float] = {}
    out = Outcome(strategy_name, ok=False, phases=phases, proof={"overlap": True})
    old = service.current()
    stats = facts.service.stats
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
        return old_serves(out, f"{free / 1e9:.2f} GB free cannot hold a second KV cache of {kv / 1e9:.2f} GB: "
                           "set [restart] overlap_mode = 'prestart' (or 'auto'): the new engine then activates once "
                           "the old one stopped")
    t0 = time.monotonic()
    new, status_path = spawn_prepared(service, "ipc-overlap")
    try:
        wait_state(status_path, new, "prepared", pol.restart["start_timeout_s"])
        phases["prepare"] = round(time.monotonic() - t0, 4)
        t1 = time.monotonic()
        private, new_stats = activate(service, new, status_path, out, old)
        phases["activate"] = round(time.monotonic() - t1, 4)
        # checked alone, before it takes a single public request
        out.proof["new_engine_canary"] = canary_at(service, private)
        os.kill(new.pid, signal.SIGUSR2)
        wait_state(status_path, new, "ready", 30)
    except Exception as e:
        new.stop(timeout_s=5)
        return old_serves(out, f"the new engine failed before the old one was stopped: {e}")
    t2 = time.monotonic()
    how = service.engine.stop()  # SIGTERM: the old engine finishes what it is answering, closes its listener
    phases["stop_old"] = round(time.monotonic() - t2, 4)
    out.proof["old_stop"] = how
    return took_over(service, new, "ipc-overlap", new_stats, out, t0)


def _prestart(service, old, out: Outcome) -> Outcome:
    """The new engine does everything that needs no memory of its own (process
    start, imports, device context, weights mapped zero_copy) while the old one
    serves; then the old one stops, and the new one allocates its KV cache,
    warms up, is checked alone on its private port and takes the public port.
    Downtime: the old engine's stop plus the activation, not the process start."""
    pol, phases = service.policy, out.phases
    if pol.ipc["mode"] != "zero_copy":
        return old_serves(out, "prestart needs [ipc] mode = 'zero_copy' (copied weights would need their memory "
                                "beside the old engine's)")
    t0 = time.monotonic()
    new, status_path = spawn_prepared(service, "ipc-prestart")
    try:
        wait_state(status_path, new, "prepared", pol.restart["start_timeout_s"])
    except Exception as e:
        new.stop(timeout_s=5)
        return old_serves(out, f"the new engine failed before the old one was stopped: {e}")
    phases["prepare"] = round(time.monotonic() - t0, 4)
    t1 = time.monotonic()
    out.proof["old_stop"] = service.engine.stop()  # drained, exited: its KV cache is free
    phases["stop_old"] = round(time.monotonic() - t1, 4)
    try:
        private, new_stats = activate(service, new, status_path, out, old)
        phases["activate"] = round(time.monotonic() - t1 - phases["stop_old"], 4)
        # every check here is downtime: one canary prompt before the port opens, all of them by the restart's verify
        out.proof["new_engine_canary"] = canary_at(service, private, first_only=True)
        os.kill(new.pid, signal.SIGUSR2)
        wait_state(status_path, new, "ready", 30)
    except Exception as e:  # the old engine is gone: the restart's recovery (cold) takes over
        if new.alive():
            new.stop(timeout_s=5)
        out.error = f"the prestarted engine failed after the old one stopped: {e}"
        return out
    phases["stop_to_ready"] = round(time.monotonic() - t1, 4)
    return took_over(service, new, "ipc-prestart", new_stats, out, t0)
