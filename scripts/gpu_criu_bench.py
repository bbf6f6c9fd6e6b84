#!/usr/bin/env python3
"""The criu strategy on one GPU, end to end, through the real CLI.

    python3 scripts/gpu_criu_bench.py --out DIR [--preset 8b-shape]

Start the reference engine on the GPU, restart it cold, take a snapshot (KV
cache dropped, device memory moved to the host by the CUDA checkpoint API,
CRIU dump, engine left running), then restart through criu with a warm and
with a dropped page cache; every restart proven by the canary.  The images
directory's sequential read bandwidth is measured in the same run, for the
target: restore to ready within 1.5 x (image bytes / read bandwidth) + 1 s,
and image bytes at most 1.1 x (weights + the engine's host memory).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import bench_setup, cli, drop_page_cache, engine_stats, restart, write_policy  # noqa: E402


def read_bandwidth(path: Path) -> tuple[float, int]:
    """Bytes per second of one plain sequential read of every image file."""
    total, t0 = 0, time.perf_counter()
    buf = bytearray(8 << 20)
    for f in sorted(path.glob("*.img")):
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return total / (time.perf_counter() - t0), total


def main() -> int:
    args, out, work, model = bench_setup("/tmp/rk-criu", 8500)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    pol = write_policy(work, "ref-criu", model, args.device, args.port, restart="stop_timeout_s = 60\n",
                       sections=f'[criu]\nimages_dir = "{work / "snapshots"}"\npid_wait_s = 30\nrestore_timeout_s = 500\n')
    try:
        res["facts"] = json.loads(cli("facts", "--json").stdout)["criu"]
        cli("stop", "--policy", pol, check=False)
        cli("start", "--policy", pol)
        res["cold"] = restart(pol, "cold")
        stats = engine_stats(args.port)
        res["weight_bytes"], res["engine_rss_bytes"] = stats["weight_bytes"], stats["rss_bytes"]
        t0 = time.monotonic()
        create = cli("snapshot", "create", "--policy", pol, "--json")
        res["create_s"] = round(time.monotonic() - t0, 2)
        snap = json.loads(create.stdout)
        res["snapshot"] = {k: snap[k] for k in ("id", "image_bytes", "phases", "kv_cache_freed_bytes", "criu_via", "gpu")}
        images = Path(snap["path"])
        res["serving_after_create"] = json.loads(cli("status", "--policy", pol, "--json", check=False).stdout)["serving"]
        bw_warm, n = read_bandwidth(images)
        res["read_bw_warm_Bps"] = bw_warm
        res["criu_warm"] = restart(pol, "criu")
        res["dropped_cache"] = drop_page_cache()
        if res["dropped_cache"]:
            bw_cold, _ = read_bandwidth(images)
            res["read_bw_cold_Bps"] = bw_cold
            drop_page_cache()
            res["criu_cold"] = restart(pol, "criu")
            drop_page_cache()
            res["cold_dropped"] = restart(pol, "cold")
    except Exception as e:
        res["error"] = str(e)[-3000:]
    finally:
        cli("stop", "--policy", pol, check=False)
        (out / "criu_results.json").write_text(json.dumps(res, indent=2))
    print(verdict(res))
    return 0


def verdict(r: dict) -> str:
    lines = ["", "criu on one GPU: reference engine"]
    if "error" in r:
        lines.append(f"ERROR: {r['error'][-1500:]}")
    s = r.get("snapshot")
    if s:
        runtime = r["engine_rss_bytes"]
        limit = 1.1 * (r["weight_bytes"] + runtime)
        lines.append(f"image {s['image_bytes'] / 1e9:.2f} GB; weights {r['weight_bytes'] / 1e9:.2f} GB + engine host memory "
                     f"{runtime / 1e9:.2f} GB; target <= {limit / 1e9:.2f} GB: {'met' if s['image_bytes'] <= limit else 'MISSED'}")
        lines.append(f"create {r['create_s']:.1f} s: " + ", ".join(f"{k} {v:.2f} s" for k, v in s["phases"].items())
                     + f"; engine serving after create: {r.get('serving_after_create')}")
    for key, bw_key in (("cold", None), ("criu_warm", "read_bw_warm_Bps"), ("criu_cold", "read_bw_cold_Bps"), ("cold_dropped", None)):
        run = r.get(key)
        if not run:
            continue
        line = (f"{key:<13} served by {run['served_by']:<5} ready {run['time_to_ready_s']:.2f} s  canary "
                f"{'same' if run['canary_identical'] else run['canary_identical']}  phases " +
                ", ".join(f"{k} {v:.2f}" for k, v in (run.get("phases") or {}).items()))
        if bw_key and s and r.get(bw_key):
            bw = r[bw_key]
            target = 1.5 * s["image_bytes"] / bw + 1
            ph = run.get("phases") or {}
            start = ph.get("start_to_ready", run["time_to_ready_s"]) - ph.get("wait_pids", 0)
            line += (f"\n{'':<13} read bw {bw / 1e9:.2f} GB/s -> target {target:.2f} s; restore to ready {start:.2f} s "
                     f"(after {ph.get('wait_pids', 0):.2f} s waiting for the old PID): {'met' if start <= target else 'MISSED'}")
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
