#!/usr/bin/env python3
"""Downtime of a cold restart, a plain ipc restart and an overlapped ipc
restart, side by side in one run, measured by a client hammering the service
(`restartkit restart --measure-downtime`; overlap always measures).

    python3 scripts/gpu_overlap_bench.py --out DIR [--model DIR | --preset 8b-shape]

Target: overlapped downtime at least 10x shorter than a cold restart's.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import bench_setup, cli, teardown, write_policy  # noqa: E402


def main() -> int:
    args, out, work, model = bench_setup("/tmp/rk-overlap", 8800, lambda p: p.add_argument("--repeat", type=int, default=2))
    (work / "sockets").mkdir(exist_ok=True, mode=0o700)
    pol = write_policy(work, "ref-overlap", model, args.device, args.port, restart="overlap = true\n",
                       sections=f'[ipc]\nsocket_dir = "{work / "sockets"}"\nstartup_timeout_s = 900\n')
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "runs": []}
    try:
        cli("preload", "--policy", pol, "--detach")
        cli("stop", "--policy", pol, check=False)
        cli("start", "--policy", pol)
        for kind, flags in (("cold", ["--strategy", "cold", "--measure-downtime"]),
                            ("ipc", ["--strategy", "ipc", "--no-overlap", "--measure-downtime"]),
                            ("ipc overlapped", ["--strategy", "ipc", "--overlap"])):
            for _ in range(args.repeat):
                rec = json.loads(cli("restart", "--policy", pol, *flags, "--json").stdout)
                res["runs"].append({"kind": kind, "served_by": rec["served_by"], "via_recovery": rec["via_recovery"],
                                    "recovery_reason": rec["recovery_reason"], "time_to_ready_s": rec["time_to_ready_s"],
                                    "downtime": rec.get("downtime"), "canary_identical": rec["proof"].get("canary_identical"),
                                    "phases": rec["attempts"][-1].get("phases")})
    except Exception as e:
        res["error"] = str(e)[-3000:]
    finally:
        teardown(pol, out / "overlap_results.json", res)
    print(verdict(res))
    return 0


def verdict(res: dict) -> str:
    lines = ["", "downtime as a client saw it (longest gap between answered requests, one request every 20 ms)",
             f"{'restart':<16}{'downtime s':>11}{'cycle s':>9}{'ready s':>9}  failed requests        canary  phases"]
    for r in res["runs"]:
        d = r["downtime"] or {}  # cycle: the probe's median gap, one answer plus the interval (no restart in it)
        lines.append(f"{r['kind']:<16}{d.get('downtime_s') or float('nan'):>11.3f}"
                     f"{d.get('median_gap_s') or float('nan'):>9.3f}{r['time_to_ready_s'] or 0:>9.2f}  "
                     f"{json.dumps(d.get('failed') or {}):<22} {'same' if r['canary_identical'] else r['canary_identical']!s:<6}  "
                     + ", ".join(f"{k} {v:.2f}" for k, v in (r.get("phases") or {}).items())
                     + (f"  RECOVERED: {r['recovery_reason']}" if r["via_recovery"] else ""))
    med = lambda xs: sorted(x for x in xs if x is not None)[len([x for x in xs if x is not None]) // 2] if any(x is not None for x in xs) else None  # noqa: E731
    cold = med([r["downtime"]["downtime_s"] for r in res["runs"] if r["kind"] == "cold" and r.get("downtime")])
    ov = med([r["downtime"]["downtime_s"] for r in res["runs"] if r["kind"] == "ipc overlapped" and r.get("downtime")])
    if cold and ov:
        lines.append(f"overlapped vs cold downtime: {cold / ov:.0f}x shorter; target >= 10x: {'met' if cold / ov >= 10 else 'MISSED'}")
    if "error" in res:
        lines.append("ERROR: " + res["error"][-1500:])
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
