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
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RK = [sys.executable, "-m", "restartkit.cli"]


def cli(*args, check=False) -> subprocess.CompletedProcess:
    r = subprocess.run([*RK, *map(str, args)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    if check and r.returncode != 0:
        raise RuntimeError(f"restartkit {' '.join(map(str, args))} -> {r.returncode}\n{r.stderr[-2000:]}")
    return r


def answers(port: int) -> bool:
    body = json.dumps({"prompt": "ping", "max_tokens": 1, "temperature": 0}).encode()  # model: the one served
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


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


def engines_on(port: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"restartkit.reference.serving.server" in cmd and str(port).encode() in cmd:
            out.append(int(d))
    return out


def gpu_mib(pid: int) -> int | None:
    """Device memory the process holds (nvidia-smi), None without a GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        a, _, b = line.partition(",")
        if a.strip() == str(pid):
            return int(b.strip())
    return None


def standby_prepared(pol: Path, timeout: float = 300) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        sb = json.loads(cli("status", "--policy", pol, "--json").stdout).get("standby") or {}
        if sb.get("state") == "prepared" and (sb.get("canary") or not sb.get("kv_ahead")):
            return sb  # (activated ahead: once it answered its canary ahead too)
        time.sleep(0.2)
    raise RuntimeError("no standby was prepared in time")


def run(pol: Path, port: int, kills: int, with_cache: bool, snapshot: bool = False, watchdog_s: float = 0,
        sigterm: bool = False, standby: bool = False) -> dict:
    cli("weightcache", "release", "--policy", pol, "--stop", "--force")
    cli("stop", "--policy", pol)
    if not snapshot:  # a snapshot of an earlier mode would serve these crashes (auto ranks criu+ipc first)
        import shutil
        shutil.rmtree(pol.parent / "state" / "supervised" / "snapshots", ignore_errors=True)
    if with_cache:
        cli("preload", "--policy", pol, "--detach", check=True)
    notes = Notes(pol.parent / "notify.sock")
    env = {**os.environ, "NOTIFY_SOCKET": notes.path, **({"WATCHDOG_USEC": str(int(watchdog_s * 1e6))} if watchdog_s else {})}
    sup = subprocess.Popen([*RK, "supervise", "--policy", str(pol)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           cwd=ROOT, start_new_session=True, env=env)
    out, result = [], {}
    try:
        while not answers(port):
            time.sleep(0.2)
        if with_cache:  # onto the cache first, as rollout would
            cli("restart", "--policy", pol, "--strategy", "ipc", "--wait", "120", check=True)
        if snapshot:  # taken while supervise watches: it holds the service's lock meanwhile
            cli("snapshot", "create", "--policy", pol, "--wait", "120", check=True)
        watched_from = time.monotonic()
        for _ in range(kills):
            if standby:  # a crash finds an armed standby (the last one's re-arm is done)
                sb = standby_prepared(pol)
                result.setdefault("standby", []).append({"pid": sb["pid"], "prepare_s": sb.get("prepare_s"),
                                                         "rss_bytes": sb.get("rss_bytes"), "gpu_mib": gpu_mib(sb["pid"])})
            last = (json.loads(cli("history", "--policy", pol, "--last", "1", "--json").stdout)["records"] or [{}])[-1].get("id")
            pid = json.loads(cli("status", "--policy", pol, "--json").stdout)["pid"]
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
            while (rec := (json.loads(cli("history", "--policy", pol, "--last", "1", "--json").stdout)["records"]
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
        cli("weightcache", "release", "--policy", pol, "--stop", "--force")
        notes.sock.close()
    result["runs"] = out
    return result


def sigterm_mid_restart(sup, notes: Notes, pol: Path, port: int) -> dict:
    """One more crash; SIGTERM to supervise while its restart runs."""
    t0 = time.monotonic()
    pid = json.loads(cli("status", "--policy", pol, "--json").stdout)["pid"]
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


def print_verdicts(verdicts: list[tuple[str, bool]]) -> int:
    """The verdict table every device script ends with; its exit code (0: every verdict ok)."""
    print("verdict")
    for what, ok in verdicts:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
    return 0 if all(ok for _, ok in verdicts) else 1


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
        cli("model", "create", "--preset", a.preset, "--out", model, "--device", a.device, check=True)
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
