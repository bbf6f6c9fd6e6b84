#!/usr/bin/env python3
"""criu+ipc on one GPU: a snapshot without the weights, restored with the weights re-attached
from the weight cache, for two model sizes.

    python3 scripts/gpu_criu_ipc_bench.py --out DIR [--presets 8b-shape,14b-shape] [--repeat 3]

For each preset: the weight cache started, the engine started and restarted through ipc
(so that it maps its weights from the cache), a snapshot taken (weights released first: the
image holds the engine's host memory and its CUDA context, not the weights or the KV cache),
then `restart --strategy criu+ipc` N times and one plain ipc restart for comparison; every
restart proven by the canary.  Reported: the image against its target, time to ready, and
restore to ready (time to ready without stopping the old engine and waiting for its PID).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_ipc_bench import cli, engine_stats, restart, teardown, write_policy  # noqa: E402

T0 = time.monotonic()


def step(what: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f} s] {what}", flush=True)


def gpu_used_bytes(pid: int) -> int | None:
    """Device memory nvidia-smi charges to `pid` (memory imported over CUDA IPC is the exporter's)."""
    r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True)
    for line in r.stdout.splitlines():
        p, mib = (x.strip() for x in line.split(","))
        if p.isdigit() and int(p) == pid:
            return int(mib) << 20
    return None


def one_model(args, work: Path, preset: str, port: int) -> dict:
    model = work / "models" / preset
    if not (model / "config.json").exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        cli("model", "create", "--preset", preset, "--out", model, "--device", args.device, timeout=1200)
        step(f"{preset}: checkpoint created")
    res: dict = {"preset": preset}
    pol = write_policy(work, f"wl-{preset}", model, args.device, port, restart="stop_timeout_s = 60\n",
                       sections=f'[ipc]\nsocket_dir = "{work / "sockets"}"\nfallback = true\nstartup_timeout_s = 900\n'
                                f'[criu]\nimages_dir = "{work / "snapshots" / preset}"\npid_wait_s = 30\n'
                                'restore_timeout_s = 120\n')
    pol.write_text(pol.read_text().replace("start_timeout_s = 600", f"start_timeout_s = {args.start_timeout}"))
    try:
        cli("weightcache", "release", "--policy", pol, "--stop", "--force", check=False)
        cli("stop", "--policy", pol, check=False)
        t0 = time.monotonic()
        cli("preload", "--policy", pol, "--detach", timeout=1200)
        res["preload_s"] = round(time.monotonic() - t0, 2)
        step(f"{preset}: weight cache ready in {res['preload_s']} s")
        cli("start", "--policy", pol)
        res["ipc_first"] = restart(pol, "ipc")
        stats = engine_stats(port)
        res["weight_bytes"], res["rss_bytes"] = stats.get("weight_bytes"), stats.get("rss_bytes")
        res["kv_cache_bytes"] = stats.get("kv_cache_bytes")
        res["gpu_used_bytes"] = gpu_used_bytes(stats["pid"])
        step(f"{preset}: on the weight cache (ipc {res['ipc_first']['time_to_ready_s']} s)")
        t0 = time.monotonic()
        step(f"{preset}: snapshot create")
        snap = json.loads(cli("snapshot", "create", "--policy", pol, "--json", timeout=240).stdout)
        res["create_s"] = round(time.monotonic() - t0, 2)
        res["snapshot"] = {k: snap.get(k) for k in ("id", "kind", "image_bytes", "phases", "weights_released_bytes",
                                                    "reattach", "gpu", "criu_via")}
        step(f"{preset}: snapshot {snap['kind']} {snap['image_bytes'] / 1e9:.2f} GB")
        res["criu_ipc"] = []
        for i in range(args.repeat):
            res["criu_ipc"].append(restart(pol, "criu+ipc"))
            step(f"{preset}: criu+ipc #{i + 1}: {res['criu_ipc'][-1]['served_by']} {res['criu_ipc'][-1]['time_to_ready_s']} s")
        step(f"{preset}: criu+ipc " + ", ".join(str(r["time_to_ready_s"]) for r in res["criu_ipc"]))
        res["ipc_after"] = restart(pol, "ipc")
    except Exception as e:
        res["error"] = str(e)[-3000:]
    finally:
        teardown(pol)
    return res


def main() -> int:
    import argparse
    import os
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--work", default="/tmp/rk-criu-ipc")
    p.add_argument("--presets", default="8b-shape,14b-shape")
    p.add_argument("--device", default="cuda")
    p.add_argument("--port", type=int, default=8700)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--start-timeout", type=int, default=600, help="[restart] start_timeout_s of the policy")
    args = p.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "models": []}
    for i, preset in enumerate(args.presets.split(",")):
        results["models"].append(one_model(args, work, preset, args.port + i))
        (out / "criu_ipc_results.json").write_text(json.dumps(results, indent=2))
    print(verdict(results))
    return 0


def restore_to_ready(run: dict) -> float | None:
    ph = run.get("phases") or {}
    if run.get("time_to_ready_s") is None:
        return None
    return round(run["time_to_ready_s"] - ph.get("stop", 0) - ph.get("wait_pids", 0), 3)


def verdict(r: dict) -> str:
    lines = ["", "criu+ipc on one GPU: reference engine, weights-less snapshots"]
    medians = {}
    for m in r["models"]:
        lines.append(f"-- {m['preset']}")
        if "error" in m:
            lines.append(f"ERROR: {m['error'][-1500:]}")
        s = m.get("snapshot")
        if s:
            other = (m.get("gpu_used_bytes") or 0) - (m.get("kv_cache_bytes") or 0)
            limit = 1.1 * ((m.get("rss_bytes") or 0) + max(0, other))
            lines.append(f"snapshot {s['kind']}: image {s['image_bytes'] / 1e9:.2f} GB (weights released "
                         f"{(s.get('weights_released_bytes') or 0) / 1e9:.2f} GB); target <= 1.1 x (host "
                         f"{(m.get('rss_bytes') or 0) / 1e9:.2f} GB + device other than weights and KV "
                         f"{other / 1e9:.2f} GB) = {limit / 1e9:.2f} GB: {'met' if s['image_bytes'] <= limit else 'MISSED'}; "
                         f"under 3.5 GB: {'met' if s['image_bytes'] < 3.5e9 else 'MISSED'}")
            lines.append("create " + ", ".join(f"{k} {v:.2f} s" for k, v in (s.get("phases") or {}).items()))
        runs = m.get("criu_ipc") or []
        clean = [x for x in runs if x["served_by"] == "criu+ipc" and not x["via_recovery"]]
        for x in runs:
            lines.append(f"criu+ipc served by {x['served_by']:<8} ready {x['time_to_ready_s']} s, restore to ready "
                         f"{restore_to_ready(x)} s, canary {'same' if x['canary_identical'] else x['canary_identical']}, "
                         f"ipc {x.get('ipc')}; " + ", ".join(f"{k} {v:.3f}" for k, v in (x.get("phases") or {}).items()))
        if clean:
            med = statistics.median(x["time_to_ready_s"] for x in clean)
            rtr = statistics.median(restore_to_ready(x) for x in clean)
            medians[m["preset"]] = (med, rtr)
            lines.append(f"median time to ready {med:.2f} s (target <= 1.5 s: {'met' if med <= 1.5 else 'MISSED'}); "
                         f"median restore to ready {rtr:.2f} s")
        for key in ("ipc_first", "ipc_after"):
            if m.get(key):
                lines.append(f"{key}: ipc ready {m[key]['time_to_ready_s']} s, canary "
                             f"{'same' if m[key]['canary_identical'] else m[key]['canary_identical']}")
    if len(medians) >= 2:
        (a, (ma, ra)), (b, (mb, rb)) = list(medians.items())[:2]
        lines.append(f"size independence: {b} {mb:.2f} s vs {a} {ma:.2f} s (+{mb - ma:.2f} s; target <= +0.3 s: "
                     f"{'met' if mb - ma <= 0.3 else 'MISSED'}); restore to ready {rb:.2f} vs {ra:.2f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
