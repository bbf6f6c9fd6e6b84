"""`restartkit bench`: each strategy N times on the same service, side by side."""
from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

from restartkit.restart import restart
from restartkit.service import Service


def _summary(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": round(statistics.median(values), 4),
            "min": round(min(values), 4), "max": round(max(values), 4)}


def run_bench(service: Service, strategies: list[str], repeat: int, out: str | None = None,
              say: Callable[[str], None] = lambda _m: None, clients: int = 0) -> dict:
    """`clients`: that many clients (restartkit.clients.ClientLoad: no retries, a new connection each)
    send greedy completions through the whole bench; each strategy's row says what they saw."""
    if service.current() is None or not service.is_ready():
        say(f"starting {service.policy.name} before the bench")
        service.engine.stop()
        service.engine.start("cold")
        service.canary()
    rows, load = [], _load(service, clients)
    for name in strategies:
        runs, seen = [], len(load.snapshot()) if load else 0
        for i in range(repeat):
            if name == "standby":
                _armed(service, say)
            rec = restart(service, name, "restart", strict=False)
            say(f"{name} #{i + 1}: {rec.final_state} by {rec.served_by}"
                + (f" in {rec.time_to_ready_s:.2f} s" if rec.time_to_ready_s is not None else "")
                + (" (recovered)" if rec.via_recovery else ""))
            served = rec.attempts[-1] if rec.attempts else {}
            runs.append({"record": rec.id, "served_by": rec.served_by, "via_recovery": rec.via_recovery,
                         "time_to_ready_s": rec.time_to_ready_s, "first_completion_s": rec.first_completion_s,
                         "canary_identical": rec.proof.get("canary_identical"),
                         "phases": served.get("phases", {}), "engine_phases": served.get("engine_phases", {})})
        clean = [r for r in runs if not r["via_recovery"] and r["served_by"] == name]
        phase_names = sorted({k for r in clean for k in r["engine_phases"]} )
        rows.append({
            "strategy": name, "runs": runs, "clean_runs": len(clean),
            "time_to_ready_s": _summary([r["time_to_ready_s"] for r in clean]),
            "first_completion_s": _summary([r["first_completion_s"] for r in clean if r["first_completion_s"] is not None]),
            "engine_phases_median_s": {p: round(statistics.median([r["engine_phases"].get(p, 0.0) for r in clean]), 4)
                                       for p in phase_names},
            "canary_identical": all(r["canary_identical"] is not False for r in runs),
            **({"clients": _client_counts(load.snapshot()[seen:])} if load else {}),
        })
    if load:
        load.stop()
    result = {"service": service.policy.name, "policy": service.policy.path, "repeat": repeat, "clients": clients,
              "host": {"machine": platform.machine(), "node": platform.node(), "python": platform.python_version()},
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": rows}
    if out:
        outdir = Path(out).expanduser()
        outdir.mkdir(parents=True, exist_ok=True)
        (outdir / "bench.json").write_text(json.dumps(result, indent=2))
        result["plot"] = _plot(result, outdir / "bench.png")
    return result


def _armed(service: Service, say) -> None:
    """A standby prepared before a standby run: a promotion uses it up, and nothing but supervise arms the
    next one, so each run of a standby bench arms its own (arming is not part of a restart's time: doing it
    ahead is what a standby is for).  One that cannot be armed leaves the run to say why it fell back."""
    from restartkit.standby.armed import arm_prepared, state
    from restartkit.errors import RestartkitError
    if (state(service) or {}).get("state") == "prepared":
        return
    try:
        arm_prepared(service, say)
    except RestartkitError as e:
        say(f"standby not armed: {e}")


def _load(service: Service, clients: int):
    if not clients:
        return None
    from restartkit.clients import ClientLoad
    s, adapter = service.policy.service, service.adapter
    host = "127.0.0.1" if s["host"] in ("0.0.0.0", "::", "") else s["host"]
    return ClientLoad(host, s["port"], adapter.served_name(service.policy), clients=clients, max_tokens=32,
                      timeout_s=service.policy.restart["start_timeout_s"],
                      headers=adapter.auth_headers(service.policy)).start()


def _client_counts(requests) -> dict:
    counts: dict[str, int] = {}
    for r in requests:  # an HTTP error by its status (a 503 while an engine loads is not a 500)
        key = f"{r.outcome} {r.detail}" if r.outcome in ("5xx", "other") and r.detail else r.outcome
        counts[key] = counts.get(key, 0) + 1
    return counts


def _plot(result: dict, path: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None  # the plot is an optional extra: pip install restartkit[plot]
    rows = [r for r in result["rows"] if r["clean_runs"]]
    fig, ax = plt.subplots(figsize=(6, 3))
    for i, r in enumerate(rows):
        ys = [x["time_to_ready_s"] for x in r["runs"] if x["served_by"] == r["strategy"] and not x["via_recovery"]]
        ax.scatter([i] * len(ys), ys)
        ax.bar(i, r["time_to_ready_s"]["median"], alpha=0.3)
    ax.set_xticks(range(len(rows)), [r["strategy"] for r in rows])
    ax.set_ylabel("time to ready (s)")
    ax.set_title(f"{result['service']}: restart strategies")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return str(path)


def render_bench(result: dict) -> str:
    head = f"{'strategy':<9}{'runs':>5}{'ready median':>14}{'min':>8}{'max':>8}{'1st compl.':>12}  canary   phases (median)"
    load = f", {result['clients']} clients sending throughout" if result.get("clients") else ""
    lines = [f"bench of {result['service']} ({result['repeat']} runs each{load}, {result['date']})", head,
             "-" * len(head)]
    for r in result["rows"]:
        t, fc = r["time_to_ready_s"], r["first_completion_s"]
        if not r["clean_runs"]:
            why = "; ".join(sorted({f"served by {x['served_by']} (recovered)" if x["via_recovery"] else "failed" for x in r["runs"]}))
            lines.append(f"{r['strategy']:<9}{0:>5}  did not run clean: {why}")
            continue
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r["engine_phases_median_s"].items())
        lines.append(f"{r['strategy']:<9}{r['clean_runs']:>5}{t['median']:>13.2f}s{t['min']:>7.2f}s{t['max']:>7.2f}s"
                     f"{fc.get('median', 0):>11.3f}s  {'same' if r['canary_identical'] else 'DIFF':<8} {phases}")
        if "clients" in r:
            lines.append(f"{'':<9}clients: " + ", ".join(f"{k} {v}" for k, v in sorted(r["clients"].items())))
    if result.get("plot"):
        lines.append(f"plot: {result['plot']}")
    return "\n".join(lines)
