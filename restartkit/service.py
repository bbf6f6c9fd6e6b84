"""One service: its policy, its state directory, its canary and the facts every strategy shares.
Its engine's life cycle (start, adopt, hand over, stop) is restartkit.process.lifecycle's, as
`service.engine`.

State directory (0700): engine.json and engine.log (the engine's; see restartkit.process.lifecycle),
canary.json (the last canary taken from a serving engine), history.jsonl (one record per restart),
metrics.prom (Prometheus textfile), intent.json and lock (restartkit.guard).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from restartkit.contracts import FACT_TIMEOUT_S, ServiceFacts
from restartkit.engines import get_adapter
from restartkit.files import ensure_private_dir, write_json_atomic
from restartkit.guard.intent import Intent
from restartkit.process.engine import EngineProcess
from restartkit.process.lifecycle import EngineLifecycle
from restartkit.process.seam import Seam


class Service:
    def __init__(self, policy, seam: Seam | None = None, behind_front: bool | None = None):
        """`behind_front`: the engines serve behind supervise's front (Policy.behind_front); None: when a
        supervisor of this service runs and the policy's front is enabled (a command run beside supervise)."""
        if behind_front is None:
            behind_front = policy.front["enabled"] and supervised(policy.state_dir())
        self.policy = policy.behind_front() if behind_front else policy
        self.seam = seam or Seam()
        self.adapter, self.adapter_problem = get_adapter(policy.service["engine"])
        self.state_dir = policy.state_dir()
        self.intent = Intent(self.state_dir)  # written only once a guarded command has begun it
        self.engine = EngineLifecycle(self.policy, self.adapter, self.adapter_problem, self.state_dir, self.seam,
                                      note_pids=lambda pids: self.intent.update(pids=pids))
        self.interrupts: list[int] = []  # termination signals deferred by the guarded command (restartkit.guard)
        self.reconciled: dict | None = None  # what the guarded command's reconcile did (restartkit.commands.reconcile)

    @classmethod
    def from_policy_file(cls, path, state_root: str = "", seam: Seam | None = None,
                         behind_front: bool | None = None) -> "Service":
        from restartkit.policy import load_policy
        return cls(load_policy(path, state_root), seam, behind_front)

    def ensure_state_dir(self) -> Path:
        return ensure_private_dir(self.state_dir)

    @property
    def canary_path(self) -> Path:
        return self.state_dir / "canary.json"

    def current(self) -> EngineProcess | None:
        """The engine this service started, if it still runs (PID and start time match)."""
        return self.engine.current()

    # ---- what is running --------------------------------------------------------
    def is_ready(self, timeout_s: float | None = None) -> bool:
        return self.probe(timeout_s)[0]

    def probe(self, timeout_s: float | None = None) -> tuple[bool, bool]:
        """(ready, answered): did a real completion pass, and did the engine answer at all
        (a 503 while asleep or loading is an answer; a hung engine gives none)."""
        from restartkit.http import HTTPFailure
        try:
            if timeout_s is None:
                self.adapter.probe(self.policy)
            else:
                self.adapter.probe(self.policy, timeout=timeout_s)
            return True, True
        except HTTPFailure as e:
            return False, e.status is not None
        except Exception:
            return False, True

    def service_facts(self) -> ServiceFacts:
        """The facts every strategy shares; each strategy gathers its own beside them."""
        s = self.policy.service
        sf = ServiceFacts(engine=s["engine"], adapter_problem=self.adapter_problem)
        if self.adapter is None:
            return sf
        sf.model_problem = self.adapter.model_problem(self.policy) or self.adapter.key_problem(self.policy)
        sf.engine_version = self.adapter.version()
        sf.overlap_problem = self.adapter.overlap_problem(self.policy)
        sf.engine_notes = self.adapter.plan_notes(self.policy)
        held = self.engine.listener()
        sf.held_socket = held.describe() if held is not None else None
        sf.engine_notes.append(connections_note(self.adapter, sf.held_socket))
        if not sf.model_problem:
            from restartkit.weightcache.fingerprint import local_checkpoint_identity
            sf.model_digest = local_checkpoint_identity(s["model"]) or (f"{s['model']}@{s['revision']}" if s["revision"] else None)
        proc = self.engine.current()
        if proc is not None:
            sf.engine_running, sf.pid, sf.start_ticks = True, proc.pid, proc.start_ticks
            sf.loaded_digest = self.engine.recorded().get("model_digest")
            # a hung engine must cost seconds here, not the minutes a loaded one may take to answer
            sf.engine_ready, sf.engine_answered = self.probe(timeout_s=FACT_TIMEOUT_S)
            try:  # a busy engine may queue a completion past the probe's timeout; its stats answer at once
                sf.stats = self.adapter.stats(self.policy, timeout=FACT_TIMEOUT_S)
                sf.engine_answered = True
            except Exception:
                pass
        return sf

    # ---- canary -------------------------------------------------------------------
    def canary(self) -> list[list[int]]:
        return self.remember_canary(self.adapter.canary(self.policy))

    def remember_canary(self, tokens: list) -> list:
        """canary.json: the baseline of a restart that finds no live engine to ask."""
        try:
            self.ensure_state_dir()
            write_json_atomic(self.canary_path, {"taken_at": time.time(), "model": self.policy.service["model"],
                                                 "prompts": self.policy.restart["canary_prompts"], "tokens": tokens})
        except OSError:
            if not self.engine.degraded:
                raise
        return tokens

    def stored_canary(self) -> tuple[list[list[int]] | None, str]:
        try:
            data = json.loads(self.canary_path.read_text())
        except (OSError, ValueError):
            return None, "no canary stored"
        if data.get("prompts") != self.policy.restart["canary_prompts"] or data.get("model") != self.policy.service["model"]:
            return None, "the stored canary is for other prompts or another model"
        return data["tokens"], time.strftime("stored canary from %Y-%m-%d %H:%M:%S", time.localtime(data["taken_at"]))


def connections_note(adapter, held: dict | None) -> str:
    """What a client connecting during this restart sees: kept waiting in a held socket's queue, or refused."""
    if held is not None:
        return (f"connections: the service's socket {held['address']} is held by `restartkit supervise` "
                f"({held['source']}): no connection is refused while the engine changes; up to {held['backlog']} "
                "wait in its queue until the next engine accepts")
    if getattr(adapter, "serves_on_socket", False):
        return ("connections: the engine binds its port itself: from its exit until the next engine listens, "
                "connections are refused (`restartkit supervise` holds the socket across restarts)")
    return (f"connections: {adapter.label} binds its port itself (it cannot serve on a socket it is given): "
            "connections are refused while it restarts")


def supervised(state_dir: Path) -> bool:
    """A supervisor of this service runs (its supervisor.json names a live `restartkit supervise`)."""
    from restartkit.process.procfs import holder_alive
    try:
        data = json.loads((state_dir / "supervisor.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and holder_alive(data)
