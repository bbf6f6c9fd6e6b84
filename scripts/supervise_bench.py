#!/usr/bin/env python3
"""`restartkit supervise` against crashes: SIGKILL the engine N times, time kill -> serving again.

    python3 scripts/supervise_bench.py [--preset small] [--kills 5] [--device cpu|cuda] [--work DIR]
                                        [--watchdog-sec 4] [--sigterm-mid-restart]

With the weight cache running (auto brings a crash back through ipc), without it (a cold
restart: what systemd's Restart= alone would give), and (--modes snapshot) with the cache and a
weights-less snapshot of the engine on it (auto ranks criu+ipc first: a crash comes back through a
CRIU restore with the weights re-attached; needs root and CRIU).  Each crash is timed from the
kill to a completion answered again (the client's view), and the record's own numbers are
reported (noticed -> serving, strategy, canary).

supervise runs as systemd runs it: on a notify socket of this script's, with WATCHDOG_USEC
(--watchdog-sec); the longest gap between two WATCHDOG=1 is reported per mode (it must stay under
half of WatchdogSec through every crash restart).  --sigterm-mid-restart: after the kills, one more
crash, and SIGTERM to supervise while that restart runs: the time to STOPPING=1 and to supervise's
exit (at most [restart] stop_timeout_s + 5 s), and nothing of the engine left on the port.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import RK, ROOT, answers, ask, engines_on, gpu_mib, print_verdicts, standby_prepared  # noqa: E402,F401


class Notes:
    """systemd's side of the notify socket: every message, timed as it arrives."""

    def __init__(self, path: Path):
        path.unlink(missing_ok=True)
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.timed: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        while True:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            now = time.monotonic()
            self.timed += [(now, line) for line in data.decode().splitlines()]

    def first(self, word: str, since: float) -> float | None:
        return next((t for t, line in list(self.timed) if t >= since and line.startswith(word)), None)

    def longest_gap(self, word: str, since: float, until: float) -> float:
        ts = [since] + [t for t, line in list(self.timed) if since <= t <= until and line.startswith(word)] + [until]
        return max(b - a for a, b in zip(ts, ts[1:]))


def run(pol: Path, port: int, kills: int, with_cache: bool, snapshot: bool = False, watchdog_s: float = 0,
        sigterm: bool = False, standby: bool = False) -> dict:
    ask("weightcache", "release", "--policy", pol, "--stop", "--force")
    ask("stop", "--policy", pol)
    if not snapshot:  # a snapshot of an earlier mode would serve these crashes (auto ranks criu+ipc first)
        import shutil
        shutil.rmtree(pol.parent / "state" / "supervised" / "snapshots", ignore_errors=True)
    if with_cache:
        ask("preload", "--policy", pol, "--detach", check=True)
    notes = Notes(pol.parent / "notify.sock")
    env = {**os.environ, "NOTIFY_SOCKET": notes.path, **({"WATCHDOG_USEC": str(int(watchdog_s * 1e6))} if watchdog_s else {})}
    sup = subprocess.Popen([*RK, "supervise", "--policy", str(pol)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           cwd=ROOT, start_new_session=True, env=env)
    out, result = [], {}
    try:
        while not answers(port):
            time.sleep(0.2)
        if with_cache:  # onto the cache first, as rollout would
            ask("restart", "--policy", pol, "--strategy", "ipc", "--wait", "120", check=True)
        if snapshot:  # taken while supervise watches: it holds the service's lock meanwhile
            ask("snapshot", "create", "--policy", pol, "--wait", "120", check=True)
        watched_from = time.monotonic()
        for _ in range(kills):
            if standby:  # a crash finds an armed standby (the last one's re-arm is done)
                sb = standby_prepared(pol)
                result.setdefault("standby", []).append({"pid": sb["pid"], "prepare_s": sb.get("prepare_s"),
                                                         "rss_bytes": sb.get("rss_bytes"), "gpu_mib": gpu_mib(sb["pid"])})
            last = (json.loads(ask("history", "--policy", pol, "--last", "1", "--json").stdout)["records"] or [{}])[-1].get("id")
            pid = json.loads(ask("status", "--policy", pol, "--json").stdout)["pid"]
            pidfd = os.pidfd_open(pid)
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            select.select([pidfd], [], [], 30)  # its exit seen, as supervise sees it: after the kernel's teardown
            exit_seen = time.monotonic() - t0
            os.close(pidfd)
            # its exit is seen: whatever answers now is the engine after it (on the held socket, a request sent
            # meanwhile waits in the queue and is answered by that engine)
            while not answers(port):
                time.sleep(0.02)
            seen = time.monotonic() - t0
            while (rec := (json.loads(ask("history", "--policy", pol, "--last", "1", "--json").stdout)["records"]
                           or [{}])[-1]).get("id") == last:
                time.sleep(0.2)
            out.append({"kill_to_answer_s": round(seen, 3), "served_by": rec["served_by"],
                        "kill_to_exit_seen_s": round(exit_seen, 3),
                        "noticed_to_serving_s": (rec.get("trigger") or {}).get("noticed_to_serving_s"),
                        "noticed_to_start_s": (rec.get("trigger") or {}).get("noticed_to_start_s"),
                        "time_to_ready_s": rec.get("time_to_ready_s"),
                        "canary_identical": rec["proof"].get("canary_identical"), "reason": rec["reason"]})
            time.sleep(1)
        if watchdog_s:
            result["watchdog_gap_s"] = round(notes.longest_gap("WATCHDOG=1", watched_from, time.monotonic()), 3)
        if sigterm:
            result["sigterm"] = sigterm_mid_restart(sup, notes, pol, port)
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGTERM)
            sup.wait(120)
        ask("weightcache", "release", "--policy", pol, "--stop", "--force")
        notes.sock.close()
    result["runs"] = out
    return result


def sigterm_mid_restart(sup, notes: Notes, pol: Path, port: int) -> dict:
    """One more crash; SIGTERM to supervise while its restart runs."""
    t0 = time.monotonic()
    pid = json.loads(ask("status", "--policy", pol, "--json").stdout)["pid"]
    os.kill(pid, signal.SIGKILL)
    while notes.first("STATUS=restarting", t0) is None and time.monotonic() - t0 < 30:
        time.sleep(0.01)
    time.sleep(0.2)  # inside the restart
    t1 = time.monotonic()
    os.killpg(sup.pid, signal.SIGTERM)
    rc = sup.wait(120)
    exited = time.monotonic() - t1
    stopping = notes.first("STOPPING=1", t1)
    time.sleep(0.5)
    return {"exit_code": rc, "stopping_after_s": round(stopping - t1, 3) if stopping else None,
            "exit_after_s": round(exited, 3), "engines_left": engines_on(port)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--work", default="/tmp/rk-supervise")
    p.add_argument("--port", type=int, default=8760)
    p.add_argument("--modes", default="cache,cold", help="cache, cold, snapshot, standby (comma-separated)")
    p.add_argument("--watchdog-sec", type=float, default=4.0, help="WATCHDOG_USEC given to supervise (0: none)")
    p.add_argument("--sigterm-mid-restart", action="store_true")
    p.add_argument("--model", help="an existing checkpoint to use (default: WORK/PRESET, created when missing)")
    p.add_argument("--kv-ahead", default="auto", help="[standby] kv_ahead for --modes standby")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (a GPU per rank)")
    a = p.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model = Path(a.model) if a.model else work / a.preset
    if not (model / "config.json").exists():
        ask("model", "create", "--preset", a.preset, "--out", model, "--device", a.device, check=True)
    pol = work / "supervised.toml"
    pol.write_text(f"""[service]
name = "supervised"
engine = "reference"
model = "{model}"
port = {a.port}
device = "{a.device}"
max_model_len = 512
tensor_parallel_size = {a.tp}
state_dir = "{work / 'state'}"
[restart]
start_timeout_s = 600
stop_timeout_s = 15
[ipc]
socket_dir = "{work / 'sockets'}"
[supervise]
health_interval_s = 1
backoff_s = 0.01       # each kill is its own crash here: no backoff between them
backoff_max_s = 0.01
""")
    modes = {"cache": ("with weight cache", True, False), "cold": ("cold only", False, False),
             "snapshot": ("cache + snapshot", True, True), "standby": ("cache + standby", True, False)}
    base = pol.read_text()
    results = {}
    for m in a.modes.split(","):
        pol.write_text(base + (f'[standby]\nenabled = true\nkv_ahead = "{a.kv_ahead}"\n' if m == "standby" else ""))
        try:
            results[modes[m][0]] = run(pol, a.port, a.kills, modes[m][1], modes[m][2], a.watchdog_sec,
                                       a.sigterm_mid_restart, standby=m == "standby")
        except Exception as e:  # one mode failing must not hide the others' results
            results[modes[m][0]] = {"runs": [], "error": f"{type(e).__name__}: {e}"}
    print(f"\nsupervise: {a.kills} x SIGKILL of the engine ({a.preset}, {a.device}, TP{a.tp}, {time.strftime('%Y-%m-%d %H:%M %Z')})")
    verdicts = []
    for name, result in results.items():
        runs = result["runs"]
        if "error" in result:
            print(f"{name:<18} FAILED: {result['error']}")
            verdicts.append((f"{name}: the run failed ({result['error'].splitlines()[0]})", False))
            continue
        if "watchdog_gap_s" in result:
            gap = result["watchdog_gap_s"]
            verdicts.append((f"{name}: longest WATCHDOG=1 gap {gap:.2f} s", gap <= a.watchdog_sec / 2))
        if "sigterm" in result:
            st = result["sigterm"]
            verdicts.append((f"{name}: SIGTERM mid-restart: STOPPING=1 after {st['stopping_after_s']} s, exit "
                             f"{st['exit_code']} after {st['exit_after_s']:.2f} s, engines left {st['engines_left']}",
                             st["exit_code"] == 0 and st["stopping_after_s"] is not None and st["stopping_after_s"] <= 2
                             and st["exit_after_s"] <= 15 + 5 and not st["engines_left"]))
        ks = [r["kill_to_answer_s"] for r in runs]
        ns = [r["noticed_to_serving_s"] for r in runs if r["noticed_to_serving_s"] is not None]
        print(f"{name:<18} served by {sorted({r['served_by'] for r in runs})}  kill -> answering: median "
              f"{statistics.median(ks):.2f} s (min {min(ks):.2f}, max {max(ks):.2f}); noticed -> serving median "
              f"{statistics.median(ns) if ns else 0:.2f} s; canary identical {all(r['canary_identical'] for r in runs)}; "
              f"reasons {sorted({r['reason'] for r in runs})}")
        for r in runs:  # each crash: noticed -> the restart's start (lock, reaping, facts, plan), its time to ready
            print(f"    kill -> answering {r['kill_to_answer_s']:.2f} s: kill -> its exit seen {r['kill_to_exit_seen_s']} s, "
                  f"noticed -> restart start "
                  f"{r['noticed_to_start_s']} s, time to ready {r['time_to_ready_s']} s, noticed -> serving "
                  f"{r['noticed_to_serving_s']} s ({r['served_by']})")
        for sb in result.get("standby", [])[:1]:
            print(f"    standby PID {sb['pid']}: prepared in {sb['prepare_s']} s, {(sb['rss_bytes'] or 0) / 1e6:.0f} MB "
                  f"resident, {sb['gpu_mib']} MiB of device memory")
        verdicts.append((f"{name}: every crash served again with an identical canary",
                         all(r["canary_identical"] for r in runs) and all(r["reason"] == "crash" for r in runs)))
    print()
    return print_verdicts(verdicts)


if __name__ == "__main__":
    sys.exit(main())
