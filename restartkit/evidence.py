"""What this service has measured about each strategy, summarized once before planning (I/O:
history.jsonl, the running engine's own start-up phases, the current snapshot's test restore,
the read bandwidth of the images dir).  The planner ranks by what this returns and never reads
anything itself.

For each strategy: the expected time to ready (or, for an overlapped ipc restart, the expected
client-seen downtime) and where it comes from:
  measured   the median of this service's last successful restarts by that strategy (restarts and
             `restartkit bench` runs alike), on this host, with this engine version and these weights;
  estimated  from quantities measured without restarting anything (labelled with how);
  none       neither: ranked by the built-in order.
And its recent failures: the last restarts that tried it first and ended in recovery.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from restartkit.contracts import Evidence, Facts
from restartkit.record import load_history

HISTORY_LINES = 2000  # how far back history.jsonl is read
# the phases of a snapshot's creation that move its bytes (device memory to the host, pages to the images,
# the engine resumed): a restore moves the same bytes back.  Measured on the H200 (8B shapes): dump side
# 23.0 s, restore 15.5 s; a raw read of the images from the page cache (7.4 GB/s) said 2.4 s.
DUMP_MOVES = ("cuda_checkpoint", "criu_dump", "resume")
# What a restore of each kind costs whatever its size (its fixed phases), the floor of every estimate made
# from bytes: CRIU forking the tree and mapping its files (0.12-0.21 s for the smallest CPU engine,
# docs/BENCHMARKS.md), the readiness probe, and for criu+ipc the weights re-attached (0.13-0.14 s on the H200).
# An estimate of 0 s would rank a strategy first on no evidence.
RESTORE_FLOOR_S = {"criu": {"criu_restore": 0.1, "ready": 0.02},
                   "criu+ipc": {"criu_restore": 0.1, "reattach_weights": 0.05, "ready": 0.02}}
ESTIMATE_FLOOR_S = 0.01  # no estimate rounds to 0, whatever it is made of


def context(facts: Facts, policy) -> dict:
    """What a measurement is valid for: this host, this engine and version, these weights, this layout."""
    s = policy.service
    return {"host": facts.host.machine_id or facts.host.kernel, "engine": s["engine"],
            "engine_version": facts.service.engine_version, "model": facts.service.model_digest or s["model"],
            "device": s["device"], "tp": s["tensor_parallel_size"]}


def _ok_run(rec: dict, name: str) -> bool:
    return (rec.get("served_by") == name and rec.get("final_state") == "serving" and not rec.get("via_recovery")
            and rec.get("time_to_ready_s") is not None)


def _first(rec: dict) -> str | None:
    """The strategy a restart tried first, as its primary: a restart that went straight to its
    recovery (the asked-for strategy not eligible) tried nothing first, and a recovery is never
    counted as a failure of the strategy it recovered with."""
    tried = [a for a in rec.get("attempts") or [] if not a.get("skipped") and a.get("role", "primary") == "primary"]
    if tried and tried[0].get("interrupted"):
        return None  # cut by a signal: says nothing of the strategy
    return tried[0]["strategy"] if tried else None


def summarize(records: list[dict], ctx: dict, policy, names, now: float) -> dict[str, Evidence]:
    """Pure: history records -> what was measured per strategy (newest records last)."""
    r = policy.restart
    oldest = now - r["rank_max_age_h"] * 3600
    # this service's own records only (the name and the context it wrote), within the window
    mine = [rec for rec in records if rec.get("context") == ctx and rec.get("service", policy.name) == policy.name
            and (rec.get("started_at") or 0) >= oldest]
    out = {}
    for name in names:
        ev = Evidence(name)
        runs = [rec for rec in mine if _ok_run(rec, name)][-r["rank_runs"]:]
        if runs:
            ev.time_s = round(statistics.median(rec["time_to_ready_s"] for rec in runs), 3)
            ev.source, ev.n = "measured", len(runs)
            ev.detail = f"median of the last {len(runs)} {name} restart(s) here"
            downs = [rec["downtime"]["downtime_s"] for rec in runs
                     if (rec.get("downtime") or {}).get("downtime_s") is not None
                     and any((a.get("proof") or {}).get("overlap") for a in rec.get("attempts") or [])]
            if downs:
                ev.downtime_s = round(statistics.median(downs), 3)
        # recent failures: the newest restarts that tried this strategy first, until one that served by it
        streak, last = 0, None
        for rec in reversed(mine):
            if _first(rec) != name:
                continue
            if _ok_run(rec, name):
                break
            streak += 1
            last = last or rec.get("finished_at") or rec.get("started_at")
        if streak >= r["rank_failures"] and last and now - last < r["rank_cooldown_s"]:
            ev.failures, ev.failed_at = streak, last
            ev.retry_in_s = round(r["rank_cooldown_s"] - (now - last))
        out[name] = ev
    return out


def gather(service, facts: Facts, names, now: float | None = None) -> dict[str, Evidence]:
    """Measured evidence from the history, then estimates where there is none.  Evidence is
    advice, never a reason a restart cannot run: a history that cannot be read, or records that
    are not restartkit's, are passed over and said (facts.notes), never raised."""
    now = time.time() if now is None else now
    ctx = context(facts, service.policy)
    history = load_history(service.state_dir, HISTORY_LINES)
    if note := history.note():
        facts.notes.append(note)
    try:
        evidence = summarize(history.records, ctx, service.policy, names, now)
    except Exception as e:  # a record of a shape no check foresaw: ranked by the built-in order, and said
        facts.notes.append(f"history.jsonl not used ({type(e).__name__}: {e}); ranked by the built-in order")
        evidence = {name: Evidence(name) for name in names}
    if history.problem:
        for ev in evidence.values():
            ev.detail = f"history.jsonl not read ({history.problem})"
    for name, ev in evidence.items():
        if ev.source == "measured":
            continue
        try:
            est = _estimate(name, facts)
        except Exception as e:  # an estimate is a nicety: never a reason to fail a plan
            est = None
            ev.detail = f"no estimate ({type(e).__name__}: {e})"
        if est is not None:
            ev.time_s, ev.detail = est
            ev.source = "estimated"
    return evidence


def _estimate(name: str, facts: Facts) -> tuple[float, str] | None:
    est = _estimate_raw(name, facts)
    if est is None:
        return None
    t, how = est
    return max(ESTIMATE_FLOOR_S, round(t, 3)), how


def _estimate_raw(name: str, facts: Facts) -> tuple[float, str] | None:
    stats = facts.service.stats or {}
    phases = stats.get("phases") or {}
    spawn = phases.get("ready_since_spawn")
    source = (stats.get("load") or {}).get("source")
    if name == "cold" and spawn and source == "disk":
        return round(spawn, 3), f"the running engine's own cold start ({spawn:.2f} s from spawn to ready)"
    if name == "ipc" and spawn:
        if source == "ipc":
            return round(spawn, 3), f"the running engine's own start through the weight cache ({spawn:.2f} s)"
        if source == "disk" and "weight_load" in phases:
            attach = 0.1
            t = max(0.0, spawn - phases["weight_load"]) + attach
            return round(t, 3), (f"the running engine's cold start ({spawn:.2f} s) minus its weight load "
                                 f"({phases['weight_load']:.2f} s) plus an attach (~{attach:.1f} s)")
    if name == "standby" and phases.get("kv_cache_alloc") is not None:
        parts = {k: phases[k] for k in ("kv_cache_alloc", "warmup", "cuda_graph_capture") if k in phases}
        if "early_warmup" in phases:  # an engine prepared beside another warmed up ahead: its warm-up is short
            parts["warmup"] = min(parts.get("warmup", 0.0), 0.1)
        t = sum(parts.values()) + 0.05
        return round(t, 3), (f"the running engine's own activation ({' + '.join(f'{k} {v:.2f} s' for k, v in parts.items())})"
                             " plus the port and one canary prompt (~0.05 s), not counting the old engine's stop")
    if name in ("criu", "criu+ipc"):
        snap = facts.of("criu")
        if (snap.get("kind") == "weightless") != (name == "criu+ipc"):
            return None  # the current snapshot is the other kind
        tested = snap.get("tested_phases")
        if tested:
            t = sum(v for k, v in tested.items() if k != "canary")
            return round(t, 3), ("the snapshot's test restore (CRIU restore, KV cache, first answer: "
                                 f"{t:.2f} s), not counting the old engine's stop")
        dump = {k: v for k, v in (snap.get("dump_phases") or {}).items() if k in DUMP_MOVES}
        if "criu_dump" in dump:
            t = sum(dump.values())
            return round(t, 3), (f"the snapshot's own dump ({' + '.join(f'{k} {v:.2f} s' for k, v in dump.items())}): "
                                 "a restore moves the same bytes back")
        images, nbytes = snap.get("images_dir"), snap.get("image_bytes")
        if images and nbytes:
            bw = read_bandwidth(Path(images))
            if bw:
                floor = RESTORE_FLOOR_S[name]
                fixed = sum(floor.values())
                t = fixed + nbytes / bw
                return t, (f"{nbytes / 1e9:.2f} GB of images at the {bw / 1e9:.2f} GB/s this host reads them "
                           f"now, plus the fixed phases of a restore ({fixed:.2f} s: "
                           f"{', '.join(f'{k} {v:.2f} s' for k, v in floor.items())})")
    return None


def read_bandwidth(images: Path, sample_bytes: int = 64 << 20) -> float | None:
    """Bytes per second reading the start of the largest page image as it is now (from the page
    cache if it is there, as a restore would), up to `sample_bytes`; None when there is nothing.
    The cache is left as it is: a plan must not make the next restore slower."""
    files = sorted((p for p in images.glob("pages-*.img")), key=lambda p: p.stat().st_size, reverse=True)
    if not files:
        return None
    fd = os.open(files[0], os.O_RDONLY)
    try:
        t0, got = time.perf_counter(), 0
        while got < sample_bytes:
            chunk = os.read(fd, 8 << 20)
            if not chunk:
                break
            got += len(chunk)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    return got / dt if got and dt > 0 else None
