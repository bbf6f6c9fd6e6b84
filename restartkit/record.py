"""Restart records: one JSON object per restart, a JSON-lines history, and a
Prometheus textfile with counters that survive across commands."""
from __future__ import annotations

import errno
import json
import math
import os
import secrets
import stat
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
    """One line appended to history.jsonl, which must be a regular file of ours: a link is not
    followed and a FIFO is not waited on (OSError: the caller prints the record instead)."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = state_dir / "history.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        os.write(fd, (json.dumps(record.to_dict()) + "\n").encode())
    finally:
        os.close(fd)
    return path


HISTORY_MAX_BYTES = 8 << 20  # how much of history.jsonl's end is read at the most (thousands of records)


@dataclass
class History:
    """The records read back from history.jsonl, oldest first, and what was passed over: a history
    is advice (evidence, status), never a reason a command cannot run."""
    records: list[dict] = field(default_factory=list)
    skipped: int = 0  # lines that are not a record restartkit writes (torn, edited, planted)
    problem: str | None = None  # why the file was not read at all (not a regular file, unreadable)

    def note(self) -> str | None:
        """One line for `plan` and `history` when anything was passed over."""
        if self.problem:
            return f"history.jsonl not read: {self.problem}"
        if self.skipped:
            return f"history.jsonl: {self.skipped} malformed record(s) skipped"
        return None


def load_history(state_dir: Path, last: int = 0, max_bytes: int = HISTORY_MAX_BYTES) -> History:
    """The last `last` records (0: all that the last `max_bytes` hold).  Only a regular file is
    read (a FIFO would block, a link to /dev/zero would never end: neither is followed), and each
    line counts only when it has the shape of a record (record_problem)."""
    out = History()
    try:
        fd = os.open(state_dir / "history.jsonl", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return out
    except OSError as e:
        out.problem = "it is a symbolic link" if e.errno == errno.ELOOP else (e.strerror or str(e))
        return out
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            out.problem = "it is not a regular file"
            return out
        start = max(0, st.st_size - max_bytes)
        raw = os.pread(fd, min(st.st_size, max_bytes), start)
    except OSError as e:
        out.problem = e.strerror or str(e)
        return out
    finally:
        os.close(fd)
    lines = raw.split(b"\n")
    if start:
        lines = lines[1:]  # the first line read from the middle of the file is a part of one
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line, parse_constant=_no_constant)
        except (ValueError, UnicodeDecodeError, RecursionError):
            out.skipped += 1  # a torn last line from a crash must not hide the rest
            continue
        if record_problem(rec):
            out.skipped += 1
            continue
        out.records.append(rec)
    if last:
        out.records = out.records[-last:]
    return out


def read_history(state_dir: Path, last: int = 0) -> list[dict]:
    return load_history(state_dir, last).records


def _no_constant(name: str):
    raise ValueError(f"{name} is not a value a record holds")


def _number(v, none_ok: bool = True) -> bool:
    if v is None:
        return none_ok
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


RECORD_TYPES = {"final_state": str, "attempts": list}  # what every record has held, from the first version on
RECORD_OPTIONAL = {"id": str, "service": str, "requested": str, "reason": str, "via_recovery": bool,
                   "context": dict, "served_by": str, "recovery_reason": str, "downtime": dict, "trigger": dict,
                   "plan": dict, "proof": dict}


def record_problem(rec) -> str | None:
    """Why `rec` is not a record as restartkit writes them (None: it is one).  Every field a reader
    uses is checked for its type, so that no reader has to."""
    if not isinstance(rec, dict):
        return f"a {type(rec).__name__}, not an object"
    for key, kind in RECORD_TYPES.items():
        if not isinstance(rec.get(key), kind):
            return f"{key} is not a {kind.__name__}"
    for key, kind in RECORD_OPTIONAL.items():
        if rec.get(key) is not None and not isinstance(rec[key], kind):
            return f"{key} is not a {kind.__name__}"
    if not _number(rec.get("started_at"), none_ok=False):
        return "started_at is not a time"
    for key in ("finished_at", "time_to_ready_s", "first_completion_s"):
        if not _number(rec.get(key)):
            return f"{key} is not a number of seconds"
    if not _number((rec.get("downtime") or {}).get("downtime_s")):
        return "downtime.downtime_s is not a number of seconds"
    for a in rec["attempts"]:
        if not isinstance(a, dict) or not isinstance(a.get("strategy"), str):
            return "an attempt is not an object naming its strategy"
        if a.get("proof") is not None and not isinstance(a["proof"], dict):
            return "an attempt's proof is not an object"
    return None


TIME_TO_READY_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)  # seconds


def _counters(state_dir: Path) -> dict:
    """The counters behind metrics.prom, kept across commands in metrics.json."""
    try:
        c = json.loads((state_dir / "metrics.json").read_text())
    except (OSError, ValueError):
        c = None
    return c if isinstance(c, dict) else {"restarts": {}, "fallbacks": {}, "ipc": {}, "time_to_ready": {}}


def _save_counters(state_dir: Path, c: dict) -> None:
    path = state_dir / "metrics.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(c))
    os.replace(tmp, path)


def update_metrics(state_dir: Path, record: Record, prom: Path | None = None) -> Path:
    """Count one restart; rewrite the restarts' textfile (`prom`, default: metrics.prom in the state dir)."""
    c = _counters(state_dir)
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
        h = c.setdefault("time_to_ready_hist", {}).setdefault(record.served_by, {"buckets": [0] * len(
            TIME_TO_READY_BUCKETS), "sum": 0.0, "count": 0})
        for i, le in enumerate(TIME_TO_READY_BUCKETS):
            h["buckets"][i] += record.time_to_ready_s <= le
        h["sum"] += record.time_to_ready_s
        h["count"] += 1
    down = (record.downtime or {}).get("downtime_s")
    if down is not None and record.served_by:
        c.setdefault("downtime", {})[record.served_by] = down
    c["last_restart_at"] = record.finished_at or time.time()
    _save_counters(state_dir, c)
    return write_restart_metrics(state_dir, record.service, prom)


def count_give_up(state_dir: Path, service: str, prom: Path | None = None) -> Path:
    """supervise gave up on the service (its restart limit): counted, the textfile rewritten."""
    c = _counters(state_dir)
    c["give_ups"] = c.get("give_ups", 0) + 1
    c["last_give_up_at"] = time.time()
    _save_counters(state_dir, c)
    return write_restart_metrics(state_dir, service, prom)


def note_standby(state_dir: Path, service: str, armed: bool, rearm_s: float | None = None,
                 prom: Path | None = None) -> Path:
    """supervise's standby: armed or not, and how long the last re-arm left the service without one."""
    c = _counters(state_dir)
    sb = c.setdefault("standby", {})
    sb["armed"] = int(armed)
    if rearm_s is not None:
        sb["last_rearm_s"] = rearm_s
    _save_counters(state_dir, c)
    return write_restart_metrics(state_dir, service, prom)


def write_restart_metrics(state_dir: Path, svc: str, prom: Path | None = None) -> Path:
    from prometheus_client.core import HistogramMetricFamily
    from restartkit import __version__
    c = _counters(state_dir)
    hist = HistogramMetricFamily("restartkit_time_to_ready_seconds", "Time to ready of the restarts served by each "
                                 "strategy (from the restart's start until the engine answered).",
                                 labels=["service", "strategy"])
    for strategy, h in sorted(c.get("time_to_ready_hist", {}).items()):
        hist.add_metric([svc, strategy], [(str(le), n) for le, n in zip(TIME_TO_READY_BUCKETS, h["buckets"])]
                        + [("+Inf", h["count"])], h["sum"])
    families = [
        _family("gauge", "restartkit_build_info", "The restartkit that wrote this file.", ["version"],
                {(__version__,): 1}, svc),
        _family("counter", "restartkit_restart", "Restarts by first strategy tried and outcome (ok, recovered, failed).",
                ["strategy", "outcome"], {tuple(k.split("|")): n for k, n in c["restarts"].items()}, svc),
        _family("counter", "restartkit_fallback", "Restarts that ended on a recovery path, by the strategy that failed.",
                ["strategy"], {(k,): n for k, n in c["fallbacks"].items()}, svc),
        _family("counter", "restartkit_ipc_attach", "Engine starts through the weight cache, by result (hit or fallback).",
                ["result"], {(k,): n for k, n in c["ipc"].items()}, svc),
        _family("counter", "restartkit_supervise_give_ups", "Times supervise gave up on the service (its restart "
                "limit reached: the engine left stopped for systemd or Kubernetes).", [], {(): c.get("give_ups", 0)}, svc),
        hist,
        _family("gauge", "restartkit_last_time_to_ready_seconds", "Time to ready of the last restart served by each "
                "strategy.", ["strategy"], {(k,): v for k, v in c["time_to_ready"].items()}, svc),
        _family("gauge", "restartkit_last_downtime_seconds", "Longest gap between answered client requests during "
                "the last restart served by each strategy (measured when the restart measures downtime, always when "
                "overlapped).", ["strategy"], {(k,): v for k, v in c.get("downtime", {}).items()}, svc),
        # the same under its old name, without the last_ of its neighbours: kept for 0.4 only (README, "Metrics")
        _family("gauge", "restartkit_downtime_seconds", "Deprecated: restartkit_last_downtime_seconds; removed after "
                "0.4.", ["strategy"], {(k,): v for k, v in c.get("downtime", {}).items()}, svc),
    ]
    if sb := c.get("standby"):
        families.append(_family("gauge", "restartkit_standby_armed", "1 while a prepared standby engine is armed.",
                                [], {(): sb.get("armed", 0)}, svc))
        if "last_rearm_s" in sb:
            families.append(_family("gauge", "restartkit_standby_last_rearm_seconds", "How long the service was "
                                    "without a prepared standby after its last promotion or loss.", [],
                                    {(): sb["last_rearm_s"]}, svc))
    if c.get("last_restart_at"):
        families.append(_family("gauge", "restartkit_last_restart_timestamp_seconds", "When the last restart ended.",
                                [], {(): c["last_restart_at"]}, svc))
    prom = prom or state_dir / "metrics.prom"
    write_textfile(prom, families)
    return prom


def write_snapshot_metrics(state_dir: Path, service: str, store, refresh: str | None = None,
                           prom: Path | None = None) -> Path:
    """snapshot.prom beside metrics.prom (or `prom`): the current snapshot's age, size, freeze and
    test, suspect snapshots, and the last refresh's outcome (`refresh`: ok, failed, or None to keep
    the last one), for alerts on a fleet whose snapshots are refreshed by cron or a timer."""
    last_path = store.root / ".last-refresh.json"
    try:
        last = json.loads(last_path.read_text())
    except (OSError, ValueError):
        last = None
    if refresh is not None:
        store.ensure()
        now, before = time.time(), (last or {}).get("success_at") if isinstance(last, dict) else None
        last = {"outcome": refresh, "at": now, "success_at": now if refresh == "ok" else before}
        tmp = last_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(last))
        os.replace(tmp, last_path)
    cur = store.current()
    snaps = store.list()
    cur = None if cur is not None and cur.damaged else cur
    tested = (cur.manifest.get("tested") or {}) if cur else {}
    m = cur.manifest if cur else {}
    families = [
        _family("gauge", "restartkit_snapshot_current_created_timestamp_seconds", "When the current snapshot was taken.",
                [], {(): m.get("created_at", 0)}, service),
        _family("gauge", "restartkit_snapshot_current_bytes", "Size of the current snapshot's images on disk.",
                [], {(): m.get("image_bytes", 0)}, service),
        _family("gauge", "restartkit_snapshot_current_freeze_seconds", "How long taking the current snapshot kept the "
                "engine from serving (its dump; clients got errors meanwhile).", [], {(): m.get("freeze_s", 0)}, service),
        _family("gauge", "restartkit_snapshot_current_test_passed",
                "1 when the current snapshot passed a test restore, else 0.", [], {(): 1 if tested.get("ok") else 0}, service),
        _family("gauge", "restartkit_snapshot_suspect", "Snapshots on disk marked suspect (a failed restore or test).",
                [], {(): sum(1 for s in snaps if s.suspect)}, service),
        _family("gauge", "restartkit_snapshot_damaged", "Snapshots on disk whose manifest cannot be used (kept).",
                [], {(): sum(1 for s in snaps if s.damaged)}, service),
    ]
    if last:
        families += [
            _family("gauge", "restartkit_snapshot_refresh_ok", "1 when the last snapshot refresh succeeded, else 0.",
                    [], {(): 1 if last["outcome"] == "ok" else 0}, service),
            _family("gauge", "restartkit_snapshot_refresh_timestamp_seconds", "When the last snapshot refresh ended.",
                    [], {(): last["at"]}, service)]
        if last.get("success_at"):  # the one alert a cron job needs: time() - this > the schedule's period
            families.append(_family("gauge", "restartkit_snapshot_refresh_last_success_timestamp_seconds",
                                    "When a snapshot refresh last succeeded.", [], {(): last["success_at"]}, service))
    state_dir.mkdir(parents=True, exist_ok=True)
    prom = prom or state_dir / "snapshot.prom"
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
    """Prometheus text format for the node exporter's textfile collector: written beside its place
    under a name the collector skips (not *.prom), then renamed over it, mode 0644 whatever the
    umask (an exporter running as its own user reads it; the state dir itself stays 0700)."""
    from prometheus_client import CollectorRegistry, generate_latest
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    data = generate_latest(registry)
    # through a descriptor of the directory (never a link in its place), into a name made fresh here
    # (O_EXCL), renamed over the output: a link planted at either name is replaced, never followed
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    tmp = f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    fd = -1
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
        os.fchmod(fd, 0o644)
        os.write(fd, data)
        os.close(fd)
        fd = -1
        os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        raise
    finally:
        os.close(dfd)


def textfile(policy, kind: str) -> Path:
    """Where a Prometheus textfile of the service goes (kind: restarts, snapshot): the state dir
    (metrics.prom, snapshot.prom), or [metrics] textfile_dir, shared by the services of a host, as
    restartkit_<service>.prom and restartkit_<service>_snapshot.prom (made 0755 when missing)."""
    where = policy.sections.get("metrics", {}).get("textfile_dir")
    if not where:
        return policy.state_dir() / ("metrics.prom" if kind == "restarts" else "snapshot.prom")
    d = Path(os.path.expandvars(os.path.expanduser(where)))
    if problem := textfile_dir_problem(d):
        raise UntrustedDir(f"{problem}; set [metrics] textfile_dir in {policy.path} to a directory only its owner "
                           "(or root) can write, or one with the sticky bit")
    d.mkdir(parents=True, exist_ok=True, mode=0o755)
    return d / (f"restartkit_{policy.name}.prom" if kind == "restarts" else f"restartkit_{policy.name}_snapshot.prom")


class UntrustedDir(OSError):
    """[metrics] textfile_dir is a directory root must not write into: its message says why and what to do."""


def textfile_dir_problem(d: Path) -> str | None:
    """Why `d` is no place for restartkit (often root) to write: a symlink (its target could be anywhere),
    or a directory every user may write without the sticky bit (anyone could swap the file).  A directory
    owned by another user is fine (Debian's node-exporter dir belongs to the exporter): the files go in
    through a directory descriptor, under a fresh name, renamed into place (write_textfile)."""
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"[metrics] textfile_dir {d} is a symlink (to {os.readlink(d)})"
    if not stat.S_ISDIR(st.st_mode):
        return f"[metrics] textfile_dir {d} is not a directory"
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return f"[metrics] textfile_dir {d} is writable by every user and has no sticky bit"
    return None


def write_record(service, rec: Record) -> bool:
    """history.jsonl and metrics.prom.  A record that cannot be written is printed on stderr
    (never silently lost), and never turns a served restart into a failed command."""
    try:
        append_history(service.state_dir, rec)
        update_metrics(service.state_dir, rec, textfile(service.policy, "restarts"))
        return True
    except OSError as e:
        print(f"restartkit: could not write the record of restart {rec.id} to {service.state_dir} ({e.strerror or e}); "
              f"the record follows:\n{json.dumps(rec.to_dict(), default=str)}", file=sys.stderr)
        return False


def render_record(r: dict) -> str:
    try:
        return _render_record(r)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a record edited by hand: shown, not raised
        return f"restart {r.get('id', '?')}: a record this version cannot show ({type(e).__name__}: {e}): " + \
            json.dumps(r, default=str)[:500]


def _render_record(r: dict) -> str:
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
