#!/usr/bin/env python3
"""The held listening socket under load: SIGKILLs of the serving engine under supervise with an armed
standby, while clients that never retry open a new connection per request.

    python3 scripts/gpu_held_socket_bench.py [--device cuda] [--preset 8b-shape] [--kills 5] [--clients 4]
                                             [--before-s 20] [--after-s 20] [--remove-model]
                                             [--front] [--max-tokens 4]

The engine runs on its weight cache under `restartkit supervise`, which holds the service's socket; a
standby is armed.  The clients run `--before-s` seconds, then the engine is SIGKILLed `--kills` times
(each time once a fresh standby is armed and the engine has served past [supervise] min_uptime_s), then
they run `--after-s` seconds more.  Prints what the clients saw (restartkit.clients.summarize): refused
connections, HTTP 5xx, requests lost and how many of them were in flight at a kill, the longest wait,
kill -> first answer under load, and the clients' p50/p99 before the first kill and after the last,
with a verdict table.  Works on the CPU too (`--device cpu --preset small`).

--front: supervise keeps the front on --port, the engines behind it on --port + 1 ([front] engine_port), and the
clients go through it; a request in flight at a kill is continued on the standby (restartkit.front), so none may be
lost.  Before the kills, the same load runs 10 s straight at the engine and 10 s through the front: the front's
cost on the clients' p50 and p99.  Without --front, [front] enabled = false: the engines take --port themselves.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import RK, ROOT, answers, ask, print_verdicts, standby_prepared  # noqa: E402

from restartkit.clients import ClientLoad, summarize  # noqa: E402


def write_policy(work: Path, model: Path, device: str, port: int, front: bool = False) -> Path:
    pol = work / "held.toml"
    pol.write_text(f"""[service]
name = "held"
engine = "reference"
model = "{model}"
port = {port}
device = "{device}"
max_model_len = 512
state_dir = "{work / 'state'}"
[restart]
start_timeout_s = 600
stop_timeout_s = 15
[ipc]
socket_dir = "{work / 'sockets'}"
[supervise]
health_interval_s = 1
[standby]
enabled = true
""" + (f"[front]\nengine_port = {port + 1}\n" if front else "[front]\nenabled = false\n"))
    return pol


def status(pol: Path) -> dict:
    return json.loads(ask("status", "--policy", pol, "--json").stdout)


def run(pol: Path, port: int, kills: int, clients: int, before_s: float, after_s: float, front: bool = False,
        max_tokens: int = 4) -> dict:
    ask("weightcache", "release", "--policy", pol, "--stop", "--force")
    ask("stop", "--policy", pol)
    ask("preload", "--policy", pol, "--detach", check=True)
    sup = subprocess.Popen([*RK, "supervise", "--policy", str(pol)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, cwd=ROOT, start_new_session=True)
    try:
        while not answers(port + 1 if front else port):  # the engine (behind the front, if any)
            time.sleep(0.2)
        ask("restart", "--policy", pol, "--strategy", "ipc", "--wait", "120", check=True)  # onto the cache
        standby_prepared(pol)
        overhead = front_overhead(port, clients, max_tokens) if front else None
        load = ClientLoad("127.0.0.1", port, None, clients=clients, max_tokens=max_tokens).start()
        kill_times, seen, served_by, kill_records = [], set(), [], []
        try:
            time.sleep(before_s)
            for _ in range(kills):
                engine = status(pol)["pid"]
                seen.add(engine)
                sb = standby_prepared(pol)
                while sb["pid"] in seen:
                    time.sleep(0.2)
                    sb = standby_prepared(pol)
                before = last_record(pol).get("id")
                uptime = time.time() - psutil_create_time(engine)
                time.sleep(max(0.0, 6.0 - uptime))  # past min_uptime_s: a crash, not a failed start
                kill_times.append(time.monotonic())
                os.kill(engine, signal.SIGKILL)
                end = time.monotonic() + 120
                while time.monotonic() < end:
                    st = status(pol)
                    if st.get("serving") and st.get("pid") not in seen:
                        break
                    time.sleep(0.1)
                while (rec := last_record(pol)).get("id") == before and time.monotonic() < end:
                    time.sleep(0.2)
                served_by.append(rec.get("served_by"))
                trig = rec.get("trigger") or {}
                kill_records.append({"served_by": rec.get("served_by"), "time_to_ready_s": rec.get("time_to_ready_s"),
                                     "noticed_to_serving_s": trig.get("noticed_to_serving_s"),
                                     "lost_in_flight": trig.get("lost_in_flight"),
                                     "phases": (rec.get("attempts") or [{}])[-1].get("phases")})
            time.sleep(after_s)
        finally:
            load.stop()
        got = summarize(load.snapshot(), kill_times, clients=clients)
        # the slow ones: when each started against the kill before it, how long its connect took (the kernel's
        # accept queue: no engine needed) and how long it waited in all
        got["slow"] = [{"after_kill": next((round(r.started - k, 3) for k in reversed(kill_times) if k <= r.started), None),
                        "connect_s": round(r.connected - r.started, 3) if r.connected else None,
                        "waited_s": round(r.waited_s, 3), "outcome": r.outcome}
                       for r in load.snapshot() if r.waited_s > 1.0]
        got["served_by"], got["records"], got["front_overhead"] = served_by, kill_records, overhead
        got["same_answers"] = len({tuple(a) for a in load.answers}) == 1
        got["answers"] = len(load.answers)
        return got
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGTERM)
            sup.wait(120)
        ask("weightcache", "release", "--policy", pol, "--stop", "--force")


def front_overhead(port: int, clients: int, max_tokens: int, seconds: float = 10.0) -> dict:
    """The same load 10 s straight at the engine, then 10 s through the front: each one's p50 and p99."""
    out = {}
    for name, at in (("direct", port + 1), ("front", port)):  # the engine behind the front, the front
        load = ClientLoad("127.0.0.1", at, None, clients=clients, max_tokens=max_tokens).start()
        time.sleep(seconds)
        load.stop()
        lat = sorted(r.waited_s for r in load.snapshot() if r.outcome == "ok")
        out[name] = {"requests": len(lat), "p50_s": round(statistics.median(lat), 4) if lat else None,
                     "p99_s": round(lat[int(0.99 * (len(lat) - 1))], 4) if lat else None}
    return out


def psutil_create_time(pid: int) -> float:
    import psutil
    return psutil.Process(pid).create_time()


def last_record(pol: Path) -> dict:
    return (json.loads(ask("history", "--policy", pol, "--last", "1", "--json").stdout)["records"] or [{}])[-1]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="8b-shape")
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--before-s", type=float, default=20.0)
    p.add_argument("--after-s", type=float, default=20.0)
    p.add_argument("--work", default="/tmp/rk-held")
    p.add_argument("--port", type=int, default=8781)
    p.add_argument("--model", help="an existing checkpoint (default: WORK/PRESET, created when missing)")
    p.add_argument("--remove-model", action="store_true")
    p.add_argument("--front", action="store_true", help="the clients through supervise's front (the engines on port + 1)")
    p.add_argument("--max-tokens", type=int, default=4)
    a = p.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model = Path(a.model) if a.model else work / a.preset
    if not (model / "config.json").exists():
        ask("model", "create", "--preset", a.preset, "--out", model, "--device", a.device, check=True)
    pol = write_policy(work, model, a.device, a.port, a.front)
    try:
        got = run(pol, a.port, a.kills, a.clients, a.before_s, a.after_s, a.front, a.max_tokens)
    finally:
        if a.remove_model and not a.model:
            shutil.rmtree(model, ignore_errors=True)
    answered = [s for s in got["kill_to_answer_s"] if s is not None]
    print(f"\nheld socket under load: {a.kills} x SIGKILL under supervise with a standby, {a.clients} clients "
          f"(a new connection per request, no retries; {a.preset}, {a.device}, {time.strftime('%Y-%m-%d %H:%M %Z')})")
    print(f"  requests {got['requests']}: {got['counts']}; served by {got['served_by']}")
    print(f"  refused {got['refused']}, 5xx {got['http_5xx']}, lost {got['lost']} (in flight at a kill "
          f"{got['lost_in_flight']}, at most {got['lost_max']}), longest wait {got['longest_wait_s']} s")
    print(f"  kill -> first answer under load: {got['kill_to_answer_s']} s, median {got['kill_to_answer_median_s']} s")
    print(f"  clients' latency p50 {got['p50_s']} s; p99 before the kills {got['p99_before_s']} s, "
          f"after {got['p99_after_s']} s; one greedy answer throughout: {got['same_answers']} ({got['answers']})")
    for i, (rec, after) in enumerate(zip(got["records"], got["kill_to_answer_s"])):
        print(f"  kill {i + 1}: first answer {after} s; record: {rec}")
    for slow in got["slow"][:12]:
        print(f"  slow: {slow}")
    if got["front_overhead"]:
        print(f"  the front's cost, same load without kills: {got['front_overhead']}")
    verdicts = [
        (f"refused connections: {got['refused']} (0)", got["refused"] == 0),
        (f"HTTP 5xx: {got['http_5xx']} (0)", got["http_5xx"] == 0),
        (f"lost {got['lost']} (0 through the front)", got["lost"] == 0) if a.front else
        (f"lost {got['lost']} = in flight at a kill {got['lost_in_flight']} (<= {got['lost_max']})",
         got["lost"] == got["lost_in_flight"] <= got["lost_max"]),
        (f"every kill served by the standby: {got['served_by']}", got["served_by"] == ["standby"] * a.kills),
        (f"kill -> first answer median {got['kill_to_answer_median_s']} s (<= 1 s)",
         bool(answered) and statistics.median(answered) <= 1.0),
        (f"longest wait {got['longest_wait_s']} s (<= 3 s)", got["longest_wait_s"] <= 3.0),
        (f"one greedy answer before and after ({got['answers']} answers)", got["same_answers"] and got["answers"] > 0),
    ]
    return print_verdicts(verdicts)


if __name__ == "__main__":
    sys.exit(main())
