#!/usr/bin/env python3
"""`auto` by evidence on one GPU: bench ipc, criu and cold, then let `plan` rank them.

    python3 scripts/gpu_rank_bench.py --out DIR [--preset 8b-shape] [--repeat 3]

Start the reference engine cold, take a criu snapshot of it, start the weight
cache, then `restartkit bench --strategies criu,cold,ipc --repeat N` (criu
first: a snapshot cannot be restored over an engine that maps its weights from
the weight cache).  Then `plan --strategy auto` must rank by the measured
medians (expected on the H200: ipc, cold, criu); then, after a cold restart and
with the weight cache stopped, `plan` must choose cold over criu, and a
`restart --strategy auto` must serve by cold.  Every restart proven by the
canary; both plans are printed verbatim.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import bench_setup, cli, teardown, write_policy  # noqa: E402


def main() -> int:
    args, out, work, model = bench_setup("/tmp/rk-rank", 8600, lambda p: p.add_argument("--repeat", type=int, default=3))
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "repeat": args.repeat}
    pol = write_policy(work, "ref-rank", model, args.device, args.port, restart="stop_timeout_s = 60\n",
                       sections=f'[ipc]\nsocket_dir = "{work / "sockets"}"\nfallback = true\nstartup_timeout_s = 900\n'
                                f'[criu]\nimages_dir = "{work / "snapshots"}"\npid_wait_s = 30\nrestore_timeout_s = 500\n')
    try:
        cli("weightcache", "release", "--policy", pol, "--stop", "--force", check=False)
        cli("stop", "--policy", pol, check=False)
        cli("start", "--policy", pol)
        step("engine started cold")
        t0 = time.monotonic()
        snap = json.loads(cli("snapshot", "create", "--policy", pol, "--json").stdout)
        res["snapshot"] = {"id": snap["id"], "image_bytes": snap["image_bytes"], "create_s": round(time.monotonic() - t0, 2)}
        t0 = time.monotonic()
        cli("preload", "--policy", pol, "--detach")
        res["preload_s"] = round(time.monotonic() - t0, 2)
        step(f"snapshot {snap['id']} and the weight cache ready")
        res["plan_before"] = cli("plan", "--policy", pol).stdout
        bench = json.loads(cli("bench", "--policy", pol, "--strategies", "criu,cold,ipc", "--repeat", args.repeat,
                               "--json", timeout=1800).stdout)
        res["bench"] = {r["strategy"]: {"clean_runs": r["clean_runs"], "median": r["time_to_ready_s"].get("median"),
                                        "min": r["time_to_ready_s"].get("min"), "max": r["time_to_ready_s"].get("max"),
                                        "canary_identical": r["canary_identical"],
                                        "served_by": [x["served_by"] for x in r["runs"]]} for r in bench["rows"]}
        step("bench done: " + ", ".join(f"{k} {v['median']}" for k, v in res["bench"].items()))
        res["plan_after_bench"] = cli("plan", "--policy", pol).stdout
        res["plan_after_bench_json"] = json.loads(cli("plan", "--policy", pol, "--json").stdout)
        # the engine off the weight cache, then the cache stopped: criu and cold remain
        res["cold_restart"] = _served(cli("restart", "--policy", pol, "--strategy", "cold", "--json").stdout)
        cli("weightcache", "release", "--policy", pol, "--stop", "--force", check=False)
        res["plan_without_cache"] = cli("plan", "--policy", pol).stdout
        res["plan_without_cache_json"] = json.loads(cli("plan", "--policy", pol, "--json").stdout)
        res["auto_without_cache"] = _served(cli("restart", "--policy", pol, "--json").stdout)
    except Exception as e:
        res["error"] = str(e)[-3000:]
    finally:
        teardown(pol, out / "rank_results.json", res)
    print(verdict(res))
    return 0


T0 = time.monotonic()


def step(what: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f} s] {what}", flush=True)


def _served(stdout: str) -> dict:
    rec = json.loads(stdout)
    return {"served_by": rec["served_by"], "via_recovery": rec["via_recovery"], "time_to_ready_s": rec["time_to_ready_s"],
            "canary_identical": rec["proof"].get("canary_identical"), "ranked_by": rec["plan"].get("ranked_by"),
            "attempt": rec["plan"].get("attempt")}


def verdict(r: dict) -> str:
    lines = ["", "auto by evidence on one GPU: reference engine"]
    if "error" in r:
        lines.append(f"ERROR: {r['error'][-1500:]}")
    if r.get("snapshot"):
        s = r["snapshot"]
        lines.append(f"snapshot {s['id']}: {s['image_bytes'] / 1e9:.2f} GB in {s['create_s']:.1f} s; "
                     f"weight cache ready in {r.get('preload_s', 0):.1f} s")
    for name, b in (r.get("bench") or {}).items():
        lines.append(f"bench {name:<5} clean {b['clean_runs']}/{r['repeat']}  median {b['median'] or 0:.2f} s "
                     f"(min {b['min'] or 0:.2f}, max {b['max'] or 0:.2f})  canary {'same' if b['canary_identical'] else 'DIFF'}")
    checks = []
    pj = r.get("plan_after_bench_json")
    if pj:
        ranked = [s for s in pj["order"] if s in ("ipc", "cold", "criu")]
        checks.append(("after bench, plan ranks ipc, cold, criu", ranked == ["ipc", "cold", "criu"], " > ".join(ranked)))
    pw = r.get("plan_without_cache_json")
    if pw:
        checks.append(("weight cache stopped: plan chooses cold over criu", pw["attempt"] == "cold"
                       and pw["order"].index("cold") < pw["order"].index("criu"), f"attempt {pw['attempt']}"))
    a = r.get("auto_without_cache")
    if a:
        checks.append(("restart --strategy auto then serves by cold, canary identical",
                       a["served_by"] == "cold" and a["canary_identical"] is True and not a["via_recovery"],
                       f"served by {a['served_by']} in {a['time_to_ready_s']} s"))
    for what, ok, detail in checks:
        lines.append(f"{'met' if ok else 'MISSED':<7} {what}: {detail}")
    for key in ("plan_before", "plan_after_bench", "plan_without_cache"):
        if r.get(key):
            lines += ["", f"--- {key} (verbatim) ---", r[key].rstrip()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
