"""ipc: the restarted engine attaches its weights from the weight-cache
daemons (one per device) instead of reading and processing the checkpoint.

Proof: the engine must report a hit on every rank.  A fallback to disk is
never silent: it is recorded as fallback(reason), and counts as a recovery.
"""
from __future__ import annotations

from restartkit.contracts import Facts, Outcome, Plan
from restartkit.strategies.base import BaseStrategy, adapter_available, model_loadable
from restartkit.standby.prepared import draft_proof
from restartkit.strategies.ipc_overlap import overlapped_ipc


def _ipc(facts: Facts) -> dict:
    return facts.of("ipc")


def engine_supports_ipc(facts: Facts, policy) -> str | None:
    return _ipc(facts).get("engine_problem")


def no_pipeline_parallel(facts: Facts, policy) -> str | None:
    pp = policy.service["pipeline_parallel_size"]
    return None if pp == 1 else f"pipeline parallelism ({pp}) is not supported by the weight cache"


def not_with_sleep_zero_copy(facts: Facts, policy) -> str | None:
    sleepy = policy.sleep["enabled"] or "--enable-sleep-mode" in policy.service["engine_args"]
    if sleepy and policy.ipc["mode"] == "zero_copy":
        return "sleep mode cannot park weights the engine maps from the daemon: use [ipc] mode = 'copy' or drop sleep mode"
    return None


def _daemon(d: dict) -> str:
    """A daemon as plan names it: its device, and which group it serves."""
    return f"{d['device_uuid']}{' (draft model)' if d.get('draft') else ''}"


def daemons_ready(facts: Facts, policy) -> str | None:
    info = _ipc(facts)
    if "engine_cache" in info:  # the engine's own weight cache (vLLM's `vllm preload`)
        return info["engine_cache"]
    if "error" in info:
        return f"could not ask the weight-cache daemons: {info['error']}"
    bad = [d for d in info.get("daemons", []) if d.get("state") != "ready"]
    if not info.get("daemons"):
        return "no weight-cache daemon information"
    if bad:
        d = bad[0]
        which = _daemon(d)
        if d["state"] == "absent":
            return f"no weight-cache daemon for {which}: start one with `restartkit preload --policy {policy.path}`"
        return f"the weight-cache daemon for {which} is {d['state']}" + (f" ({d['error']})" if d.get("error") else "")
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
            reasons.append(f"{_daemon(d)}: {describe(diffs)}")
    return ("the daemon holds other weights than the engine wants: " + " | ".join(reasons)) if reasons else None


# With fallback on, an engine asked to load through the cache checks the fingerprint itself and
# loads from disk when it differs, saying which field: `restart --strategy ipc` may run it anyway.
fingerprints_match.forceable = lambda policy: policy.ipc["fallback"] is True


def daemon_facts(policy) -> dict:
    """The daemons' states and fingerprints, and what the engine would ask for."""
    try:
        from restartkit.weightcache.client import daemon_stats, layout_from_policy
        from restartkit.weightcache.fingerprint import checkpoint_digest, fingerprint
        daemons = daemon_stats(policy)
        if not any(d.get("state") == "ready" for d in daemons):
            return {"daemons": daemons, "expected": []}
        lay = layout_from_policy(policy)
        expected = []  # in daemon_stats' order: the model's ranks, then the draft model's
        for model, draft in lay.groups():
            digest = checkpoint_digest(model)[0]
            expected += [fingerprint(model, tp_size=lay.tp_size, tp_rank=r, dp_size=lay.dp_size,
                                     dp_rank=lay.dp_start_rank, expert_parallel=lay.expert_parallel,
                                     dtype=lay.dtype, quantization=lay.quantization, revision=lay.revision,
                                     checkpoint=digest, draft=draft) for r in range(lay.tp_size)]
        return {"daemons": daemons, "expected": expected}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def engine_cache_problem(policy) -> str | None:
    """An engine's own weight cache (vLLM's `vllm preload`): its health endpoint must say ready."""
    from restartkit import http
    i = policy.ipc
    if not i["health_port"]:
        return ("set [ipc] health_port to the port of the engine's own weight cache "
                "(`vllm preload --weight-cache-health-port N`), so restartkit can see that it is ready")
    try:
        http.get(f"http://{i['health_host']}:{i['health_port']}/health", timeout=3)
        return None
    except http.HTTPFailure as e:
        return f"the weight cache's health at {i['health_host']}:{i['health_port']} says {e.status or 'nothing'}: not ready"


class IPCStrategy(BaseStrategy):
    name = "ipc"
    prerequisites = [adapter_available, model_loadable, engine_supports_ipc, no_pipeline_parallel,
                     not_with_sleep_zero_copy, daemons_ready, fingerprints_match]

    def gather(self, service, facts: Facts) -> dict:
        adapter = service.adapter
        if adapter is None:
            return {}
        out = {"engine_problem": adapter.feature_problems(service.policy).get(
            "ipc", f"the {adapter.name} adapter cannot load through a weight cache")}
        if adapter.weight_cache_of(service.policy) == "engine":
            out["engine_cache"] = engine_cache_problem(service.policy)
        elif not facts.service.model_problem:
            out.update(daemon_facts(service.policy))
        return out

    def execute(self, service, facts: Facts, plan: Plan) -> Outcome:
        if plan.overlap:
            return overlapped_ipc(service, facts, self.name)
        phases: dict[str, float] = {}
        started = service.engine.restart(self.name, service.adapter.ipc_args(service.policy), phases)
        if service.adapter.ipc_proof_in_log and service.adapter.weight_cache_of(service.policy) == "engine":
            return self._log_proof(service, started, phases)
        load = (started.stats or {}).get("load") or {}
        ranks = load.get("ranks") or [load.get("ipc")]
        proof = {"ipc": load.get("ipc"), "ranks": ranks, "mode": load.get("mode"),
                 "attach_s": load.get("attach_s"), "weight_source": load.get("source")}
        missed = None if all(r == "hit" for r in ranks) else load
        if service.policy.service["draft_model"]:  # the draft model must come from its own group too, every rank
            proof["draft"], draft = draft_proof(load)
            if proof["draft"] != "hit" and missed is None:
                missed = {**draft, "fallback_field": f"draft: {draft.get('fallback_field') or proof['draft']}"}
        out = Outcome(self.name, ok=True, phases=phases, engine_phases=started.engine_phases, proof=proof,
                      ready_at=started.ready_at)
        if missed is None:
            proof["ipc"] = "hit"
            return out
        proof["ipc"] = "mixed" if "hit" in ranks + [proof.get("draft")] else "fallback"
        out.fallback = f"{proof['ipc']}({missed.get('fallback_field') or missed.get('fallback_reason')})"
        out.detail["fallback_reason"] = missed.get("fallback_reason")
        return out

    def _log_proof(self, service, started, phases) -> Outcome:
        """vLLM says hit or fallback only in its log: read every rank's lines since this start."""
        with open(service.engine.log_path, "rb") as f:
            f.seek(started.log_offset)
            text = f.read().decode(errors="replace")
        verdict = service.adapter.ipc_log_verdict(service.policy, text)
        out = Outcome(self.name, ok=True, phases=phases, engine_phases=started.engine_phases, ready_at=started.ready_at,
                      proof={"ipc": verdict["ipc"], "ranks": verdict["ranks"], "source": "engine log"})
        if verdict["ipc"] == "unknown":
            out.ok, out.error = False, f"{service.adapter.label}'s log says neither hit nor fallback: the ipc path cannot be proven"
        elif verdict["ipc"] != "hit":
            out.fallback = verdict["summary"]
        return out
