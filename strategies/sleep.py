"""sleep: the engine parks its weights (level 1: in host memory; level 2:
dropped), frees its KV cache, and wakes up in the same process.

It fails quietly in the wild, so every step is checked: the process's own
memory must really go down, free memory must cover the awake footprint
before waking, and the canary must be identical after the wake.  Any
failure: kill, cold start, recorded.
"""
from __future__ import annotations

import time

from restartkit.strategies.base import BaseStrategy, Facts, Outcome, adapter_available

SATISFIABLE = ("restart",)


def _stats(facts: Facts) -> dict:
    return facts.service.extra.get("engine_stats") or {}


def engine_supports_sleep(facts: Facts, policy) -> str | None:
    from restartkit.engines import get_adapter
    adapter = get_adapter(policy.service["engine"])[0]
    if adapter is None:
        return None
    return adapter.feature_problems(policy).get("sleep", f"the {adapter.name} adapter cannot drive sleep mode")


def engine_alive_with_sleep_mode(facts: Facts, policy) -> str | None:
    if not facts.service.engine_running:
        return "the engine is not running: a sleep cycle needs the live process"
    state = facts.service.extra.get("sleep_state") or {}
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
    need = _stats(facts).get("weight_bytes")
    if not need:  # engines that do not report it (vLLM): the checkpoint's size
        from restartkit.engines import get_adapter
        adapter = get_adapter(policy.service["engine"])[0]
        need = (adapter.sleep_expected_bytes(policy, {}) if adapter else None) or 0
    if need > facts.host.mem_available_bytes:
        return (f"level 1 parks {need / 1e9:.1f} GB of weights in host memory and only "
                f"{facts.host.mem_available_bytes / 1e9:.1f} GB are available; use [sleep] level = 2")
    return None


class SleepStrategy(BaseStrategy):
    name = "sleep"
    prerequisites = [adapter_available, engine_supports_sleep, engine_alive_with_sleep_mode, reason_fits,
                     not_zero_copy_ipc, host_memory_for_level_1]

    def execute(self, service, facts: Facts) -> Outcome:
        from restartkit.sleepcycle import Cycle, SleepCycleError
        pol = service.policy
        state = service.adapter.sleep_state(pol, facts.service.pid)
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
