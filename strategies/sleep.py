"""sleep: the engine parks its weights (level 1: in host memory; level 2:
dropped), frees its KV cache, and wakes up in the same process.

It fails quietly in the wild, so every step is checked: the process's own
memory must really go down, free memory must cover the awake footprint
before waking, and the canary must be identical after the wake.  Any
failure: kill, cold start, recorded.
"""
from __future__ import annotations

import time

from restartkit import http
from restartkit.memory import free_memory, process_memory
from restartkit.strategies.base import BaseStrategy, Facts, Outcome, adapter_available

SATISFIABLE = ("restart",)


def _stats(facts: Facts) -> dict:
    return facts.service.extra.get("engine_stats") or {}


def engine_supports_sleep(facts: Facts, policy) -> str | None:
    from restartkit.engines import get_adapter
    adapter = get_adapter(policy.service["engine"])[0]
    if adapter is None:
        return None
    problem = adapter.feature_problems(policy).get("sleep", f"the {adapter.name} adapter cannot drive sleep mode")
    if problem is None and policy.service["engine"] != "reference":
        return (f"sleep cycles of {adapter.name} are not driven by restartkit yet "
                "(its endpoints are known; this path was never run against a GPU engine here)")
    return problem


def engine_alive_with_sleep_mode(facts: Facts, policy) -> str | None:
    if not facts.service.engine_running:
        return "the engine is not running: a sleep cycle needs the live process"
    if not (_stats(facts).get("sleep") or {}).get("enabled"):
        return "the running engine was started without sleep mode: set [sleep] enabled = true and restart it once (cold)"
    return None


def reason_fits(facts: Facts, policy) -> str | None:
    if facts.reason in SATISFIABLE:
        return None
    if facts.reason == "crash":
        return "the restart is for a crash: there is no healthy process to put to sleep and wake"
    return f"the restart is for new {facts.reason}: a sleep cycle keeps the process, so it applies no new code, flags or weights"


def not_zero_copy_ipc(facts: Facts, policy) -> str | None:
    load = _stats(facts).get("load") or {}
    if load.get("source") == "ipc" and load.get("mode") == "zero_copy":
        return "the engine maps its weights zero_copy from the weight cache; they are not its own to park"
    return None


def host_memory_for_level_1(facts: Facts, policy) -> str | None:
    if policy.sleep["level"] != 1:
        return None
    need = _stats(facts).get("weight_bytes") or 0
    if need > facts.host.mem_available_bytes:
        return (f"level 1 parks {need / 1e9:.1f} GB of weights in host memory and only "
                f"{facts.host.mem_available_bytes / 1e9:.1f} GB are available; use [sleep] level = 2")
    return None


class SleepStrategy(BaseStrategy):
    name = "sleep"
    prerequisites = [adapter_available, engine_supports_sleep, engine_alive_with_sleep_mode, reason_fits,
                     not_zero_copy_ipc, host_memory_for_level_1]

    def execute(self, service, facts: Facts) -> Outcome:
        pol, level = service.policy, service.policy.sleep["level"]
        device = pol.service["device"]
        base = service.adapter.base_url(pol)
        pid = facts.service.pid
        stats = service.adapter.stats(pol)
        footprint = (stats.get("weight_bytes") or 0) + (stats.get("kv_cache_bytes") or 0)
        phases: dict[str, float] = {}
        proof: dict = {"level": level, "device": device, "memory_before": process_memory(pid, device)}
        out = Outcome(self.name, ok=False, phases=phases, proof=proof)
        already = (stats.get("sleep") or {}).get("level", 0)
        t0 = time.monotonic()
        if not already:
            answer = http.post(f"{base}/sleep?level={level}", timeout=300)
            phases["sleep"] = round(time.monotonic() - t0, 4)
            if not http.get(f"{base}/is_sleeping", timeout=10).get("is_sleeping"):
                out.error = "the engine says it is not asleep after /sleep"
                return out
            proof["memory_asleep"] = process_memory(pid, device)
            freed = (proof["memory_before"] or 0) - (proof["memory_asleep"] or 0)
            proof["freed_bytes"], proof["expected_bytes"] = freed, answer.get("weight_bytes", 0) + answer.get("kv_cache_bytes", 0)
            if proof["memory_before"] is not None and freed < pol.sleep["min_freed_fraction"] * proof["expected_bytes"]:
                out.error = (f"sleep freed {freed / 1e6:.1f} MB of the process's memory, less than "
                             f"{pol.sleep['min_freed_fraction']:.0%} of {proof['expected_bytes'] / 1e6:.1f} MB: memory was not released")
                return out
        else:
            proof["note"] = f"the engine was already asleep (level {already}); waking it"
            footprint = (stats.get("sleep", {}).get("last") or {}).get("weight_bytes", 0) + \
                        (stats.get("sleep", {}).get("last") or {}).get("kv_cache_bytes", 0)
        free = free_memory(device)
        proof["free_before_wake"], proof["awake_footprint"] = free, footprint
        if free is not None and free < footprint:
            out.error = (f"only {free / 1e9:.2f} GB are free and waking needs {footprint / 1e9:.2f} GB: "
                         "not waking into an out-of-memory")
            return out
        t1 = time.monotonic()
        try:
            wake = http.post(f"{base}/wake_up", timeout=600)
        except http.HTTPFailure as e:
            out.error = f"wake failed: {e.message}"
            return out
        phases["wake"] = round(time.monotonic() - t1, 4)
        proof["wake"] = wake
        proof["memory_after"] = process_memory(pid, device)
        out.ok = True
        phases["start_to_ready"] = round(time.monotonic() - t0, 4)
        return out
