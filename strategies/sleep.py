"""sleep: the engine parks its weights (level 1: in host memory; level 2:
dropped), frees its KV cache, and wakes up in the same process.

It fails quietly in the wild, so every step is checked: the process's own
memory must really go down, free memory must cover the awake footprint
before waking, and the canary must be identical after the wake.  Any
failure: kill, cold start, recorded.
"""
from __future__ import annotations

import time

from restartkit.contracts import FACT_TIMEOUT_S, Facts, Outcome, Plan
from restartkit.strategies.base import BaseStrategy, adapter_available

SATISFIABLE = ("restart",)


def _stats(facts: Facts) -> dict:
    return facts.service.stats


def engine_supports_sleep(facts: Facts, policy) -> str | None:
    return facts.of("sleep").get("engine_problem")


def engine_alive_with_sleep_mode(facts: Facts, policy) -> str | None:
    if not facts.service.engine_running:
        return "the engine is not running: a sleep cycle needs the live process"
    state = facts.of("sleep").get("state") or {}
    if not state.get("enabled"):
        return state.get("why") or "the running engine runs without sleep mode (it does not report one)"
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
    # engines that do not report it (vLLM): the checkpoint's size
    need = _stats(facts).get("weight_bytes") or facts.of("sleep").get("checkpoint_bytes") or 0
    if need > facts.host.mem_available_bytes:
        return (f"level 1 parks {need / 1e9:.1f} GB of weights in host memory and only "
                f"{facts.host.mem_available_bytes / 1e9:.1f} GB are available; use [sleep] level = 2")
    return None


class SleepStrategy(BaseStrategy):
    name = "sleep"
    prerequisites = [adapter_available, engine_supports_sleep, engine_alive_with_sleep_mode, reason_fits,
                     not_zero_copy_ipc, host_memory_for_level_1]

    def gather(self, service, facts: Facts) -> dict:
        adapter, pol = service.adapter, service.policy
        if adapter is None:
            return {}
        out = {"engine_problem": adapter.feature_problems(pol).get(
            "sleep", f"the {adapter.name} adapter cannot drive sleep mode")}
        if pol.sleep["level"] == 1 and not facts.service.stats.get("weight_bytes"):
            out["checkpoint_bytes"] = adapter.sleep_expected_bytes(pol, {})
        if not facts.service.engine_running:
            return out
        if facts.service.engine_answered:
            try:
                out["state"] = adapter.sleep_state(pol, facts.service.pid)
            except Exception as e:
                out["state"] = {"enabled": False, "why": f"could not ask the engine: {e}"}
        else:
            out["state"] = {"enabled": False, "asleep": None, "level": None,
                            "why": f"the engine does not answer within {FACT_TIMEOUT_S:.0f} s"}
        return out

    def execute(self, service, facts: Facts, plan: Plan) -> Outcome:
        from restartkit.engines.sleepcycle import Cycle, SleepCycleError
        pol = service.policy
        state = facts.of("sleep").get("state") or {}
        level = state.get("level") or pol.sleep["level"]
        cycle = Cycle(service, facts.service.pid, level)
        out = Outcome(self.name, ok=False, phases=cycle.phases, proof=cycle.proof)
        t0 = time.monotonic()
        try:
            if state.get("asleep"):
                # a cycle that stopped half-way (or `restartkit sleep`): wake it, reloading when the level is unknown
                cycle.proof["note"] = f"the engine was already asleep (level {state.get('level') or 'unknown'}); waking it"
                if state.get("level") is None:
                    cycle.level = 2
                last = state.get("last") or {}
                cycle.wake(footprint=(last.get("weight_bytes") or 0) + (last.get("kv_cache_bytes") or 0) or None)
            else:
                cycle.sleep()
                cycle.wake()
        except SleepCycleError as e:
            out.error = e.message
            return out
        out.ok = True
        cycle.phases["start_to_ready"] = round(time.monotonic() - t0, 4)
        return out
