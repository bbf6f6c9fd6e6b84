"""Restart records: one JSON object per restart, a JSON-lines history, and a
Prometheus textfile with counters that survive across commands."""
from __future__ import annotations

import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from restartkit.errors import EXIT_DEGRADED, EXIT_NOT_SERVING, EXIT_SERVING


@dataclass
class Record:
    service: str
    policy: str
    requested: str
    reason: str
    plan: dict
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    attempts: list[dict] = field(default_factory=list)
    proof: dict = field(default_factory=dict)
    final_state: str = "not serving"
    served_by: str | None = None
    via_recovery: bool = False
    recovery_reason: str | None = None
    time_to_ready_s: float | None = None
    first_completion_s: float | None = None
    downtime: dict | None = None  # measured by a client hammering the service (--measure-downtime, overlap)
    context: dict = field(default_factory=dict)
    trigger: dict | None = None  # who noticed what (supervise: a crash or a hang) and how long until serving again  # host, engine and version, weights, layout: what the times are valid for
    exit_code: int = EXIT_NOT_SERVING

    def finish(self, strict: bool) -> "Record":
        self.finished_at = time.time()
        if self.final_state != "serving":
            self.exit_code = EXIT_NOT_SERVING
        elif self.via_recovery and strict:
            self.exit_code = EXIT_DEGRADED
        else:
            self.exit_code = EXIT_SERVING
        return self

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def append_history(state_dir: Path, record: Record) -> Path:
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = state_dir / "history.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps(record.to_dict()) + "\n")
    return path


def read_history(state_dir: Path, last: int = 0) -> list[dict]:
    path = state_dir / "history.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    out = []
    for line in lines[-last:] if last else lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a torn last line from a crash must not hide the rest
    return out


def update_metrics(state_dir: Path, record: Record) -> Path:
    """Counters live in metrics.json; metrics.prom is rewritten from them."""
    counters_path = state_dir / "metrics.json"
    try:
        c = json.loads(counters_path.read_text())
    except (OSError, ValueError):
        c = {"restarts": {}, "fallbacks": {}, "ipc": {}, "time_to_ready": {}}
    outcome = "recovered" if record.via_recovery and record.final_state == "serving" else (
        "ok" if record.final_state == "serving" else "failed")
    first = record.attempts[0]["strategy"] if record.attempts else "none"
    key = f"{first}|{outcome}"
    c["restarts"][key] = c["restarts"].get(key, 0) + 1
    if record.via_recovery:
        c["fallbacks"][first] = c["fallbacks"].get(first, 0) + 1
    for a in record.attempts:
        hit = (a.get("proof") or {}).get("ipc")
        if hit:
            c["ipc"][hit] = c["ipc"].get(hit, 0) + 1
    if record.time_to_ready_s is not None and record.served_by:
        c["time_to_ready"][record.served_by] = record.time_to_ready_s
    down = (record.downtime or {}).get("downtime_s")
    if down is not None and record.served_by:
        c.setdefault("downtime", {})[record.served_by] = down
    tmp = counters_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(c))
    os.replace(tmp, counters_path)

    svc = record.service
    families = [
        _family("counter", "restartkit_restart", "Restarts by first strategy tried and outcome (ok, recovered, failed).",
                ["strategy", "outcome"], {tuple(k.split("|")): n for k, n in c["restarts"].items()}, svc),
        _family("counter", "restartkit_fallback", "Restarts that ended on a recovery path, by the strategy that failed.",
                ["strategy"], {(k,): n for k, n in c["fallbacks"].items()}, svc),
        _family("counter", "restartkit_ipc_attach", "Engine starts through the weight cache, by result (hit or fallback).",
                ["result"], {(k,): n for k, n in c["ipc"].items()}, svc),
        _family("gauge", "restartkit_time_to_ready_seconds", "Time to ready of the last restart served by each strategy.",
                ["strategy"], {(k,): v for k, v in c["time_to_ready"].items()}, svc),
        _family("gauge", "restartkit_downtime_seconds", "Longest gap between answered client requests during the last "
                "restart served by each strategy (measured when the restart measures downtime, always when overlapped).",
                ["strategy"], {(k,): v for k, v in c.get("downtime", {}).items()}, svc),
    ]
    prom = state_dir / "metrics.prom"
    write_textfile(prom, families)
    return prom


def write_snapshot_metrics(state_dir: Path, service: str, store, refresh: str | None = None) -> Path:
    """snapshot.prom beside metrics.prom: the current snapshot's age and test, suspect snapshots, and the
    last refresh's outcome (`refresh`: ok, failed, or None to keep the last one), for alerts on a fleet
    whose snapshots are refreshed by cron or a timer."""
    last_path = store.root / ".last-refresh.json"
    if refresh is not None:
        store.ensure()
        tmp = last_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"outcome": refresh, "at": time.time()}))
        os.replace(tmp, last_path)
    try:
        last = json.loads(last_path.read_text())
    except (OSError, ValueError):
        last = None
    cur = store.current()
    snaps = store.list()
    tested = (cur.manifest.get("tested") or {}) if cur else {}
    families = [
        _family("gauge", "restartkit_snapshot_current_created_timestamp_seconds", "When the current snapshot was taken.",
                [], {(): cur.manifest.get("created_at", 0) if cur else 0}, service),
        _family("gauge", "restartkit_snapshot_current_test_passed",
                "1 when the current snapshot passed a test restore, else 0.", [], {(): 1 if tested.get("ok") else 0}, service),
        _family("gauge", "restartkit_snapshot_suspect", "Snapshots on disk marked suspect (a failed restore or test).",
                [], {(): sum(1 for s in snaps if s.suspect)}, service),
    ]
    if last:
        families += [
            _family("gauge", "restartkit_snapshot_refresh_ok", "1 when the last snapshot refresh succeeded, else 0.",
                    [], {(): 1 if last["outcome"] == "ok" else 0}, service),
            _family("gauge", "restartkit_snapshot_refresh_timestamp_seconds", "When the last snapshot refresh ended.",
                    [], {(): last["at"]}, service)]
    state_dir.mkdir(parents=True, exist_ok=True)
    prom = state_dir / "snapshot.prom"
    write_textfile(prom, families)
    return prom


def _family(kind: str, name: str, doc: str, labels: list[str], values: dict[tuple, float], service: str):
    """One metric family with the service label first; label values are escaped by prometheus-client."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    fam = cls(name, doc, labels=["service", *labels])
    for key, v in sorted(values.items()):
        fam.add_metric([service, *key], v)
    return fam


class _Families:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return iter(self.families)


def write_textfile(path: Path, families) -> None:
    """Prometheus text format for the node exporter's textfile collector, written atomically."""
    from prometheus_client import CollectorRegistry, write_to_textfile
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    write_to_textfile(str(path), registry)


def write_record(service, rec: Record) -> bool:
    """history.jsonl and metrics.prom.  A record that cannot be written is printed on stderr
    (never silently lost), and never turns a served restart into a failed command."""
    try:
        append_history(service.state_dir, rec)
        update_metrics(service.state_dir, rec)
        return True
    except OSError as e:
        print(f"restartkit: could not write the record of restart {rec.id} to {service.state_dir} ({e.strerror or e}); "
              f"the record follows:\n{json.dumps(rec.to_dict(), default=str)}", file=sys.stderr)
        return False


def render_record(r: dict) -> str:
    lines = [f"restart {r['id']} of {r['service']}: {r['final_state']}"
             + (f" by {r['served_by']}" if r["served_by"] else "")
             + (" (through the recovery path)" if r["via_recovery"] else "")]
    if r["recovery_reason"]:
        lines.append(f"  why recovery: {r['recovery_reason']}")
    for a in r["attempts"]:
        status = "skipped" if a.get("skipped") else ("ok" if a["ok"] else "failed")
        phases = ", ".join(f"{k} {v:.2f}s" for k, v in (a.get("phases") or {}).items())
        lines.append(f"  {a['role']:<8} {a['strategy']:<6} {status:<7} {phases}")
        if a.get("error") and not a.get("skipped"):
            lines.append(f"           error: {a['error']}")
        eng = a.get("engine_phases") or {}
        if eng:
            lines.append("           engine: " + ", ".join(f"{k} {v:.2f}s" for k, v in eng.items()))
    p = r.get("proof") or {}
    if "canary_identical" in p:
        ident = {True: "identical", False: "DIFFERENT", None: "not compared"}[p["canary_identical"]]
        lines.append(f"  canary: {ident} (baseline: {p.get('baseline_source')})")
    if r["time_to_ready_s"] is not None:
        lines.append(f"  time to ready: {r['time_to_ready_s']:.2f} s; first completion: {r['first_completion_s'] or 0:.3f} s")
    d = r.get("downtime")
    if d:
        lines.append(f"  downtime as a client saw it: {d['downtime_s']} s ({d['answered']}/{d['requests']} requests answered; "
                     f"failures: {d['failed'] or 'none'})")
    return "\n".join(lines)
