"""Restart records: one JSON object per restart, a JSON-lines history, and a
Prometheus textfile with counters that survive across commands."""
from __future__ import annotations

import json
import os
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
    lines = ["# HELP restartkit_restart_total Restarts by first strategy tried and outcome (ok, recovered, failed).",
             "# TYPE restartkit_restart_total counter"]
    for k, n in sorted(c["restarts"].items()):
        strat, out = k.split("|")
        lines.append(f'restartkit_restart_total{{service="{svc}",strategy="{strat}",outcome="{out}"}} {n}')
    lines += ["# HELP restartkit_fallback_total Restarts that ended on a recovery path, by the strategy that failed.",
              "# TYPE restartkit_fallback_total counter"]
    for strat, n in sorted(c["fallbacks"].items()):
        lines.append(f'restartkit_fallback_total{{service="{svc}",strategy="{strat}"}} {n}')
    lines += ["# HELP restartkit_ipc_attach_total Engine starts through the weight cache, by result (hit or fallback).",
              "# TYPE restartkit_ipc_attach_total counter"]
    for result, n in sorted(c["ipc"].items()):
        lines.append(f'restartkit_ipc_attach_total{{service="{svc}",result="{result}"}} {n}')
    lines += ["# HELP restartkit_time_to_ready_seconds Time to ready of the last restart served by each strategy.",
              "# TYPE restartkit_time_to_ready_seconds gauge"]
    for strat, v in sorted(c["time_to_ready"].items()):
        lines.append(f'restartkit_time_to_ready_seconds{{service="{svc}",strategy="{strat}"}} {v}')
    lines += ["# HELP restartkit_downtime_seconds Longest gap between answered client requests during the last "
              "restart served by each strategy (measured when the restart measures downtime, always when overlapped).",
              "# TYPE restartkit_downtime_seconds gauge"]
    for strat, v in sorted(c.get("downtime", {}).items()):
        lines.append(f'restartkit_downtime_seconds{{service="{svc}",strategy="{strat}"}} {v}')
    prom = state_dir / "metrics.prom"
    tmp = prom.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, prom)
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
    lab = f'service="{service}"'
    lines = [
        "# HELP restartkit_snapshot_current_created_timestamp_seconds When the current snapshot was taken.",
        "# TYPE restartkit_snapshot_current_created_timestamp_seconds gauge",
        f"restartkit_snapshot_current_created_timestamp_seconds{{{lab}}} {cur.manifest.get('created_at', 0) if cur else 0}",
        "# HELP restartkit_snapshot_current_test_passed 1 when the current snapshot passed a test restore, else 0.",
        "# TYPE restartkit_snapshot_current_test_passed gauge",
        f"restartkit_snapshot_current_test_passed{{{lab}}} {1 if tested.get('ok') else 0}",
        "# HELP restartkit_snapshot_suspect Snapshots on disk marked suspect (a failed restore or test).",
        "# TYPE restartkit_snapshot_suspect gauge",
        f"restartkit_snapshot_suspect{{{lab}}} {sum(1 for s in snaps if s.suspect)}",
    ]
    if last:
        lines += ["# HELP restartkit_snapshot_refresh_ok 1 when the last snapshot refresh succeeded, else 0.",
                  "# TYPE restartkit_snapshot_refresh_ok gauge",
                  f"restartkit_snapshot_refresh_ok{{{lab}}} {1 if last['outcome'] == 'ok' else 0}",
                  "# HELP restartkit_snapshot_refresh_timestamp_seconds When the last snapshot refresh ended.",
                  "# TYPE restartkit_snapshot_refresh_timestamp_seconds gauge",
                  f"restartkit_snapshot_refresh_timestamp_seconds{{{lab}}} {last['at']}"]
    state_dir.mkdir(parents=True, exist_ok=True)
    prom = state_dir / "snapshot.prom"
    tmp = prom.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, prom)
    return prom
