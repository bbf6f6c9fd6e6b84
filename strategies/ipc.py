"""ipc: the restarted engine attaches its weights from the weight-cache
daemons (one per device) instead of reading and processing the checkpoint.

Proof: the engine must report a hit on every rank.  A fallback to disk is
never silent: it is recorded as fallback(reason), and counts as a recovery.
"""
from __future__ import annotations

import time

from restartkit.strategies.base import BaseStrategy, Facts, Outcome, adapter_available, model_loadable


def _ipc(facts: Facts) -> dict:
    return facts.service.extra.get("ipc") or {}


def engine_supports_ipc(facts: Facts, policy) -> str | None:
    if policy.service["engine"] != "reference":
        return f"the {policy.service['engine']} adapter cannot load through the weight cache yet"
    return None


def no_pipeline_parallel(facts: Facts, policy) -> str | None:
    pp = policy.service["pipeline_parallel_size"]
    return None if pp == 1 else f"pipeline parallelism ({pp}) is not supported by the weight cache"


def not_with_sleep_zero_copy(facts: Facts, policy) -> str | None:
    sleepy = policy.sleep["enabled"] or "--enable-sleep-mode" in policy.service["engine_args"]
    if sleepy and policy.ipc["mode"] == "zero_copy":
        return "sleep mode cannot park weights the engine maps from the daemon: use [ipc] mode = 'copy' or drop sleep mode"
    return None


def daemons_ready(facts: Facts, policy) -> str | None:
    info = _ipc(facts)
    if "error" in info:
        return f"could not ask the weight-cache daemons: {info['error']}"
    bad = [d for d in info.get("daemons", []) if d.get("state") != "ready"]
    if not info.get("daemons"):
        return "no weight-cache daemon information"
    if bad:
        d = bad[0]
        if d["state"] == "absent":
            return f"no weight-cache daemon for {d['device_uuid']}: start one with `restartkit preload --policy {policy.path}`"
        return f"the weight-cache daemon for {d['device_uuid']} is {d['state']}" + (f" ({d['error']})" if d.get("error") else "")
    return None


def fingerprints_match(facts: Facts, policy) -> str | None:
    from restartkit.weightcache.fingerprint import describe, differences
    info = _ipc(facts)
    reasons = []
    for d, want in zip(info.get("daemons", []), info.get("expected", [])):
        if d.get("state") != "ready":
            continue
        diffs = differences(d.get("fingerprint") or {}, want)
        if diffs:
            reasons.append(f"{d['device_uuid']}: {describe(diffs)}")
    return ("the daemon holds other weights than the engine wants: " + " | ".join(reasons)) if reasons else None


class IPCStrategy(BaseStrategy):
    name = "ipc"
    prerequisites = [adapter_available, model_loadable, engine_supports_ipc, no_pipeline_parallel,
                     not_with_sleep_zero_copy, daemons_ready, fingerprints_match]

    def execute(self, service, facts: Facts) -> Outcome:
        phases: dict[str, float] = {}
        t0 = time.monotonic()
        service.stop()
        phases["stop"] = round(time.monotonic() - t0, 4)
        t1 = time.monotonic()
        started = service.start_engine(strategy=self.name, extra_args=service.adapter.ipc_args(service.policy))
        phases["start_to_ready"] = round(time.monotonic() - t1, 4)
        load = (started.stats or {}).get("load") or {}
        ranks = load.get("ranks") or [load.get("ipc")]
        proof = {"ipc": load.get("ipc"), "ranks": ranks, "mode": load.get("mode"),
                 "attach_s": load.get("attach_s"), "weight_source": load.get("source")}
        out = Outcome(self.name, ok=True, phases=phases, engine_phases=started.engine_phases, proof=proof)
        if all(r == "hit" for r in ranks):
            proof["ipc"] = "hit"
            return out
        proof["ipc"] = "mixed" if "hit" in ranks else "fallback"
        out.fallback = f"{proof['ipc']}({load.get('fallback_field') or load.get('fallback_reason')})"
        out.detail["fallback_reason"] = load.get("fallback_reason")
        return out
