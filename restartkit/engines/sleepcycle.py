"""One sleep cycle over an engine's HTTP sleep interface, every step checked.

The protocol is vLLM's (the reference engine speaks it too):
  POST /sleep?level=N          -> {"status": "sleeping", "level": N}
  GET  /is_sleeping            -> {"is_sleeping": bool}
  POST /wake_up?tags=weights   -> {"status": "sleeping" | "awake", "tags": [...]}
  (level 2, vLLM) POST /collective_rpc {"method": "reload_weights"}
  POST /wake_up?tags=kv_cache  -> {"status": "awake", ...}
The adapter supplies the engine's dialect (see EngineAdapter's sleep_*
methods).  Sleep fails quietly in the wild, so the process tree's own memory
must really go down, free memory must cover what waking takes back, each
answer must say what was asked, and the caller proves the wake by the canary.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from restartkit import http
from restartkit.process.memory import free_memory, tree_memory


RSS_NOISE_BYTES = 32 << 20


class SleepCycleError(Exception):
    def __init__(self, message: str, proof: dict):
        super().__init__(message)
        self.message, self.proof = message, proof


@dataclass
class Cycle:
    service: object
    pid: int
    level: int
    phases: dict = field(default_factory=dict)
    proof: dict = field(default_factory=dict)

    @property
    def adapter(self):
        return self.service.adapter

    @property
    def policy(self):
        return self.service.policy

    @property
    def device(self) -> str:
        return self.policy.service["device"]

    def fail(self, message: str):
        raise SleepCycleError(message, self.proof)

    def _asleep(self) -> bool:
        try:
            return self.adapter.sleep_is_confirmed(self.policy)
        except http.HTTPFailure as e:
            self.fail(f"/is_sleeping does not answer: {e.message}")

    # ---- sleep ----------------------------------------------------------------
    def sleep(self, verify_memory: bool = True) -> dict:
        pol, ad = self.policy, self.adapter
        self.proof.update(level=self.level, device=self.device, memory_before=tree_memory(self.pid, self.device))
        t0 = time.monotonic()
        try:
            answer = ad.sleep_request(pol, self.level)
        except http.HTTPFailure as e:
            self.fail(f"the engine refused to sleep: {e.message}")
        self.phases["sleep"] = round(time.monotonic() - t0, 4)
        self.proof["sleep_answer"] = answer
        if ad.can_confirm_sleep and not self._asleep():
            self.fail("the engine answered /sleep but /is_sleeping says it is awake")
        asleep = tree_memory(self.pid, self.device)
        before = self.proof["memory_before"]
        self.proof["memory_asleep"] = asleep
        expected = ad.sleep_expected_bytes(pol, answer)
        self.proof["expected_bytes"] = expected
        if before is not None and asleep is not None:
            freed = before - asleep
            self.proof["freed_bytes"] = freed
            want = pol.sleep["min_freed_fraction"] * (expected or before)
            if verify_memory and self.device != "cuda" and expected is not None and expected < RSS_NOISE_BYTES:
                # a serving process's resident memory moves by megabytes with every request (allocator
                # arenas, page cache of its own files): too little parked to see it there
                self.proof["memory_check"] = (f"not conclusive: the engine parked {expected / 1e6:.1f} MB, below the "
                                              f"{RSS_NOISE_BYTES / 1e6:.0f} MB that a serving process's resident "
                                              "memory moves by; its answer and the canary prove the cycle")
                verify_memory = False
            if verify_memory and freed < want:
                what = "device" if self.device == "cuda" else "resident"
                self.fail(f"sleep freed {freed / 1e6:.1f} MB of the engine's {what} memory, less than "
                          f"{want / 1e6:.1f} MB ({pol.sleep['min_freed_fraction']:.0%} of "
                          f"{(expected or before) / 1e6:.1f} MB): memory was not released")
        return answer

    # ---- wake -------------------------------------------------------------------
    def wake(self, footprint: int | None = None) -> dict:
        """Weights first (then, after level 2, their reload), then the KV cache."""
        pol, ad = self.policy, self.adapter
        if footprint is None and self.proof.get("freed_bytes") is not None:
            footprint = max(0, self.proof["freed_bytes"])
        free = free_memory(self.device)
        self.proof.update(free_before_wake=free, awake_footprint=footprint)
        if free is not None and footprint and free < footprint:
            self.fail(f"only {free / 1e9:.2f} GB are free and waking needs {footprint / 1e9:.2f} GB: "
                      "not waking into an out-of-memory")
        t0 = time.monotonic()
        try:
            first = ad.wake_request(pol, ["weights"])
            if self.level != 1 and ad.sleep_needs_reload:
                t1 = time.monotonic()
                ad.reload_weights(pol)
                self.phases["reload"] = round(time.monotonic() - t1, 4)
            second = ad.wake_request(pol, ["kv_cache"])
        except http.HTTPFailure as e:
            self.fail(f"wake failed: {e.message}")
        self.phases["wake"] = round(time.monotonic() - t0, 4)
        self.proof["wake"] = {**first, **{k: v for k, v in second.items() if k not in first}}
        self.proof["wake_answers"] = [first, second]
        if not ad.wake_is_complete(second):
            self.fail(f"the engine's last wake answer does not say awake: {second}")
        if ad.can_confirm_sleep and self._asleep():
            self.fail("/is_sleeping still says asleep after the wake")
        self.proof["memory_after"] = tree_memory(self.pid, self.device)
        return self.proof["wake"]
