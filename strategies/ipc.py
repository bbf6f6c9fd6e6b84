"""ipc: the restarted engine attaches its weights from the weight-cache
daemons (one per device) instead of reading and processing the checkpoint.

Proof: the engine must report a hit on every rank.  A fallback to disk is
never silent: it is recorded as fallback(reason), and counts as a recovery.
"""
from __future__ import annotations

from restartkit.strategies.base import BaseStrategy, Facts, Outcome, adapter_available, model_loadable


def _ipc(facts: Facts) -> dict:
    return facts.service.extra.get("ipc") or {}


def _adapter(policy):
    from restartkit.engines import get_adapter
    return get_adapter(policy.service["engine"])[0]


def engine_supports_ipc(facts: Facts, policy) -> str | None:
    adapter = _adapter(policy)
    if adapter is None:
        return None  # adapter_available says why
    return adapter.feature_problems(policy).get("ipc", f"the {adapter.name} adapter cannot load through a weight cache")


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


def draft_proof(load: dict) -> tuple[str, dict]:
    """From an engine's load stats: "hit" when every rank attached its draft model from the weight
    cache, else what the ranks did ("fallback", "disk", "hit/fallback", ...); and the draft's stats."""
    draft = load.get("draft") or {}
    ranks = draft.get("ranks") or [draft.get("ipc") or draft.get("source") or "not loaded"]
    return ("hit" if all(r == "hit" for r in ranks) else "/".join(ranks)), draft


def daemons_ready(facts: Facts, policy) -> str | None:
    if policy.service["engine"] != "reference":
        return engine_cache_healthy(policy)
    info = _ipc(facts)
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


def engine_cache_healthy(policy) -> str | None:
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

    def execute(self, service, facts: Facts) -> Outcome:
        if facts.overlap:
            from restartkit.overlap import overlapped_ipc
            return overlapped_ipc(service, facts, self.name)
        phases: dict[str, float] = {}
        started = service.restart_engine(self.name, service.adapter.ipc_args(service.policy), phases)
        if service.policy.service["engine"] == "vllm":
            return self._vllm_proof(service, started, phases)
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

    def _vllm_proof(self, service, started, phases) -> Outcome:
        """vLLM says hit or fallback only in its log: read every rank's lines since this start."""
        from restartkit.engines.vllm import parse_ipc_log
        with open(service.log_path, "rb") as f:
            f.seek(started.log_offset)
            text = f.read().decode(errors="replace")
        s = service.policy.service
        verdict = parse_ipc_log(text, s["tensor_parallel_size"] * s["data_parallel_size"])
        out = Outcome(self.name, ok=True, phases=phases, engine_phases=started.engine_phases, ready_at=started.ready_at,
                      proof={"ipc": verdict["ipc"], "ranks": verdict["ranks"], "source": "engine log"})
        if verdict["ipc"] == "unknown":
            out.ok, out.error = False, "vLLM's log says neither hit nor fallback: the ipc path cannot be proven"
        elif verdict["ipc"] != "hit":
            out.fallback = verdict["summary"]
        return out
