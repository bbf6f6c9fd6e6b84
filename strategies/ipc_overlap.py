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

import json
import os
import signal
import time

from restartkit import http
from restartkit.contracts import Outcome
from restartkit.process.memory import free_memory
from restartkit.process.states import ProcState


def draft_proof(load: dict) -> tuple[str, dict]:
    """From an engine's load stats: "hit" when every rank attached its draft model from the weight
    cache, else what the ranks did ("fallback", "disk", "hit/fallback", ...); and the draft's stats."""
    draft = load.get("draft") or {}
    ranks = draft.get("ranks") or [draft.get("ipc") or draft.get("source") or "not loaded"]
    return ("hit" if all(r == "hit" for r in ranks) else "/".join(ranks)), draft


def _status(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _wait_state(path, proc, wanted: str, deadline_s: float) -> dict:
    st: dict = {}

    def reached() -> bool:
        st.update(_status(path))
        if st.get("state") == "failed":
            raise RuntimeError(st.get("error", "the new engine failed"))
        if st.get("state") != wanted and not proc.alive():
            raise RuntimeError(f"the new engine exited (code {proc.returncode()}) before it was {wanted}")
        return st.get("state") == wanted
    if not proc.seam.wait_until(reached, deadline_s, 0.01):
        raise RuntimeError(f"the new engine was not {wanted} within {deadline_s:.0f} s")
    return st


def _old_serves(out: Outcome, error: str) -> Outcome:
    """Failed before the old engine was touched: it keeps serving, nothing to recover."""
    out.error, out.old_still_serving = error, True
    return out


def _took_over(service, new, how: str, new_stats: dict, out: Outcome, t0: float) -> Outcome:
    """The new engine serves on the public port and the old one is gone: it is the service's engine now."""
    new.to(ProcState.READY)
    service.engine.mark_ready(new, how)
    out.engine_phases = new_stats.get("phases", {})
    out.phases["start_to_ready"] = round(time.monotonic() - t0, 4)
    out.ok = True
    return out


def _spawn_prepared(service, name: str):
    """Start the new engine in prepare-only mode; returns (process, its status file)."""
    status_path = service.state_dir / "overlap-status.json"
    status_path.unlink(missing_ok=True)
    args = service.adapter.ipc_args(service.policy) + ["--prepare-only", "--status-file", str(status_path)]
    new, _ = service.engine.spawn(name, args)
    new.close_ready_fd()  # readiness comes through the status file here
    return new, status_path


def _activate(service, new, status_path, out: Outcome, old, deadline_s: float | None = None) -> tuple[str, dict]:
    """SIGUSR1, wait until active, and require a weight-cache hit; returns (private URL, its stats).
    `old`: the engine it replaces (None after a crash)."""
    os.kill(new.pid, signal.SIGUSR1)
    st = _wait_state(status_path, new, "active", deadline_s or service.policy.restart["start_timeout_s"])
    private = f"http://127.0.0.1:{st['admin_port']}"
    new_stats = http.get(private + "/admin/stats", timeout=10, headers=service.adapter.admin_headers(service.policy))
    load = new_stats.get("load") or {}
    ranks = load.get("ranks") or [load.get("ipc")]  # tensor parallel (a standby): every rank's own attach
    verdict = "hit" if all(r == "hit" for r in ranks) else "mixed" if "hit" in ranks else load.get("ipc")
    out.proof.update(ipc=verdict, ranks=ranks, mode=load.get("mode"), attach_s=load.get("attach_s"),
                     new_pid=new.pid, old_pid=old.pid if old is not None else None, private_port=st["admin_port"])
    if verdict != "hit":
        raise RuntimeError(f"the new engine did not attach from the weight cache on every rank: ranks {ranks} "
                           f"({load.get('fallback_reason')})")
    if service.policy.service["draft_model"]:
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
    how = service.engine.stop()  # SIGTERM: the old engine finishes what it is answering, closes its listener
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
    out.proof["old_stop"] = service.engine.stop()  # drained, exited: its KV cache is free
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


def _canary_at(service, base: str, first_only: bool = False, max_tokens: int | None = None) -> list[list[int]]:
    pol = service.policy
    prompts = pol.restart["canary_prompts"][:1] if first_only else pol.restart["canary_prompts"]
    n = max_tokens or pol.restart["canary_max_tokens"]
    return [service.adapter.completion(pol, p, n, base=base)["choices"][0]["token_ids"] for p in prompts]
