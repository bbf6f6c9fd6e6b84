"""The prepared-engine protocol, shared by the overlapped ipc restart and the standby: an engine started with
`--prepare-only --status-file F` (process, imports, device, weights attached from the weight cache, on a private
loopback port) reports its states in F (preparing, prepared, active, ready, failed); SIGUSR1 activates it (KV cache,
warm-up, graph), and it is checked alone on its private port before it takes the service's socket."""
from __future__ import annotations

import json
import os
import signal
import time

from restartkit import http
from restartkit.contracts import Outcome
from restartkit.process.states import ProcState


def draft_proof(load: dict) -> tuple[str, dict]:
    """From an engine's load stats: "hit" when every rank attached its draft model from the weight
    cache, else what the ranks did ("fallback", "disk", "hit/fallback", ...); and the draft's stats."""
    draft = load.get("draft") or {}
    ranks = draft.get("ranks") or [draft.get("ipc") or draft.get("source") or "not loaded"]
    return ("hit" if all(r == "hit" for r in ranks) else "/".join(ranks)), draft


def status(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def wait_state(path, proc, wanted: str, deadline_s: float) -> dict:
    st: dict = {}

    def reached() -> bool:
        st.update(status(path))
        if st.get("state") == "failed":
            raise RuntimeError(st.get("error", "the new engine failed"))
        if st.get("state") != wanted and not proc.alive():
            raise RuntimeError(f"the new engine exited (code {proc.returncode()}) before it was {wanted}")
        return st.get("state") == wanted
    if not proc.seam.wait_until(reached, deadline_s, 0.01):
        raise RuntimeError(f"the new engine was not {wanted} within {deadline_s:.0f} s")
    return st


def old_serves(out: Outcome, error: str) -> Outcome:
    """Failed before the old engine was touched: it keeps serving, nothing to recover."""
    out.error, out.old_still_serving = error, True
    return out


def took_over(service, new, how: str, new_stats: dict, out: Outcome, t0: float) -> Outcome:
    """The new engine serves on the public port and the old one is gone: it is the service's engine now."""
    new.to(ProcState.READY)
    service.engine.mark_ready(new, how)
    out.engine_phases = new_stats.get("phases", {})
    out.phases["start_to_ready"] = round(time.monotonic() - t0, 4)
    out.ok = True
    return out


def spawn_prepared(service, name: str):
    """Start the new engine in prepare-only mode; returns (process, its status file)."""
    status_path = service.state_dir / "overlap-status.json"
    status_path.unlink(missing_ok=True)
    args = service.adapter.ipc_args(service.policy) + ["--prepare-only", "--status-file", str(status_path)]
    new, _ = service.engine.spawn(name, args)
    new.close_ready_fd()  # readiness comes through the status file here
    return new, status_path


def activate(service, new, status_path, out: Outcome, old, deadline_s: float | None = None) -> tuple[str, dict]:
    """SIGUSR1, wait until active, and require a weight-cache hit; returns (private URL, its stats).
    `old`: the engine it replaces (None after a crash)."""
    os.kill(new.pid, signal.SIGUSR1)
    st = wait_state(status_path, new, "active", deadline_s or service.policy.restart["start_timeout_s"])
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


def canary_at(service, base: str, first_only: bool = False, max_tokens: int | None = None) -> list[list[int]]:
    pol = service.policy
    prompts = pol.restart["canary_prompts"][:1] if first_only else pol.restart["canary_prompts"]
    n = max_tokens or pol.restart["canary_max_tokens"]
    return [service.adapter.completion(pol, p, n, base=base)["choices"][0]["token_ids"] for p in prompts]
