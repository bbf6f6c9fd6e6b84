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
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import cli, engine_stats, restart, teardown, write_policy  # noqa: E402

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


def one_model(args, work: Path, out: Path, preset: str, port: int, compare: bool) -> dict:
    model = work / "models" / preset
    if not (model / "config.json").exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        cli("model", "create", "--preset", preset, "--out", model, "--device", args.device, timeout=1200)
        step(f"{preset}: checkpoint created")
    res: dict = {"preset": preset, "runs": {}}
    snapshots = work / "snapshots" / preset
    pol = write_policy(work, f"wl-{preset}", model, args.device, port, restart="stop_timeout_s = 60\n",
                       sections=f'[ipc]\nsocket_dir = "{work / "sockets"}"\nfallback = true\nstartup_timeout_s = 900\n'
                                f'[criu]\nimages_dir = "{snapshots}"\npid_wait_s = 30\n'
                                'restore_timeout_s = 120\n')
    pol.write_text(pol.read_text().replace("start_timeout_s = 600", f"start_timeout_s = {args.start_timeout}"))

    def runs(strategy: str) -> None:
        got = res["runs"].setdefault(strategy, [])
        for i in range(args.repeat):
            got.append(restart(pol, strategy))
            step(f"{preset}: {strategy} #{i + 1}: {got[-1]['served_by']} {got[-1]['time_to_ready_s']} s")
            if got[-1]["via_recovery"]:  # the failure is in the record: once is enough to read it
                break

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
        res["snapshots"] = [snapshot(pol)]
        step(f"{preset}: snapshot {res['snapshots'][-1]['kind']} {res['snapshots'][-1]['image_bytes'] / 1e9:.2f} GB")
        if args.test_restore:  # a copy restored beside the serving engine, on the same weight cache
            r = cli("snapshot", "test", "--policy", pol, "--json", check=False, timeout=400)
            res["test_restore"] = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {"error": r.stderr[-2000:]}
            step(f"{preset}: snapshot test: {res['test_restore'].get('ok')} {res['test_restore'].get('error', '')}")
        runs("criu+ipc")
        if compare:
            runs("ipc")
            restart(pol, "cold")  # the weights from disk: a full snapshot
            res["snapshots"].append(snapshot(pol))
            step(f"{preset}: snapshot {res['snapshots'][-1]['kind']} {res['snapshots'][-1]['image_bytes'] / 1e9:.2f} GB")
            runs("criu")
            runs("cold")
    except Exception as e:
        res["error"] = str(e)[-3000:]
    finally:
        keep_logs(pol, out, preset)
        teardown(pol)
        shutil.rmtree(snapshots, ignore_errors=True)  # the next model needs the disk
    return res


def snapshot(pol: Path) -> dict:
    t0 = time.monotonic()
    snap = json.loads(cli("snapshot", "create", "--policy", pol, "--json", timeout=400).stdout)
    out = {k: snap.get(k) for k in ("id", "kind", "image_bytes", "phases", "weights_released_bytes", "reattach", "gpu",
                                    "criu_via")}
    out["create_s"] = round(time.monotonic() - t0, 2)
    return out


def keep_logs(pol: Path, out: Path, preset: str) -> None:
    """The engine's and the weight cache's logs (their ends), for a failure read after the run."""
    state = pol.parent / "state" / pol.stem
    for name in ("engine.log", "weightcache.log"):
        f = state / name
        if f.exists():
            data = f.read_bytes()[-300_000:]
            (out / f"{preset}-{name}").write_bytes(data)


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
    p.add_argument("--test-restore", action="store_true", help="also `snapshot test` the weights-less snapshot")
    p.add_argument("--compare", default="8b-shape",
                   help="presets also restarted through ipc, criu (a full snapshot) and cold, side by side")
    args = p.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "models": []}
    for i, preset in enumerate(args.presets.split(",")):
        results["models"].append(one_model(args, work, out, preset, args.port + i, preset in args.compare.split(",")))
        (out / "criu_ipc_results.json").write_text(json.dumps(results, indent=2))
    print(verdict(results))
    return 0


def restore_to_ready(run: dict) -> float | None:
    ph = run.get("phases") or {}
    if run.get("time_to_ready_s") is None:
        return None
    return round(run["time_to_ready_s"] - ph.get("stop", 0) - ph.get("wait_pids", 0), 3)


def verdict(r: dict) -> str:
    lines = ["", "criu+ipc on one GPU: reference engine, weights-less snapshots, side by side"]
    medians = {}
    for m in r["models"]:
        lines.append(f"-- {m['preset']} (weights {(m.get('weight_bytes') or 0) / 1e9:.1f} GB)")
        if "error" in m:
            lines.append(f"ERROR: {m['error'][-1500:]}")
        for s in m.get("snapshots") or []:
            line = (f"snapshot {s['kind']}: image {s['image_bytes'] / 1e9:.2f} GB, created in {s['create_s']:.1f} s ("
                    + ", ".join(f"{k} {v:.2f}" for k, v in (s.get("phases") or {}).items()) + ")")
            if s["kind"] == "weightless":
                other = (m.get("gpu_used_bytes") or 0) - (m.get("kv_cache_bytes") or 0)
                limit = 1.1 * ((m.get("rss_bytes") or 0) + max(0, other))
                line += (f"; target <= 1.1 x (host {(m.get('rss_bytes') or 0) / 1e9:.2f} GB + device other than weights "
                         f"and KV {other / 1e9:.2f} GB) = {limit / 1e9:.2f} GB: "
                         f"{'met' if s['image_bytes'] <= limit else 'MISSED'}; "
                         f"under 3.5 GB: {'met' if s['image_bytes'] < 3.5e9 else 'MISSED'}")
            lines.append(line)
        if m.get("test_restore"):
            t = m["test_restore"]
            lines.append(f"snapshot test (a copy beside the serving engine): ok {t.get('ok')}, canary identical "
                         f"{t.get('canary_identical')}; " + (t.get("error") or ", ".join(
                             f"{k} {v:.2f}" for k, v in (t.get("phases") or {}).items())))
        lines.append(f"{'strategy':<10}{'clean':>6}{'median':>9}{'max':>8}{'restore->ready':>16}  canary  median phases")
        for name in ("criu+ipc", "ipc", "criu", "cold"):
            got = (m.get("runs") or {}).get(name)
            if not got:
                continue
            clean = [x for x in got if x["served_by"] == name and not x["via_recovery"]]
            canary = "same" if all(x["canary_identical"] for x in got) else "DIFF"
            if not clean:
                lines.append(f"{name:<10}{0:>6}  failed: {got[0].get('recovery_reason')}")
                continue
            tt = [x["time_to_ready_s"] for x in clean]
            rtr = [restore_to_ready(x) for x in clean]
            keys = sorted({k for x in clean for k in (x.get("phases") or {})})
            ph = {k: statistics.median((x.get("phases") or {}).get(k, 0.0) for x in clean) for k in keys}
            lines.append(f"{name:<10}{len(clean):>6}{statistics.median(tt):>8.2f}s{max(tt):>7.2f}s"
                         f"{statistics.median(rtr):>15.2f}s  {canary:<6}  " + ", ".join(f"{k} {v:.3f}" for k, v in ph.items()))
            if name == "criu+ipc":
                medians[m["preset"]] = statistics.median(tt)
            if name == "criu+ipc" and m["preset"] == "8b-shape":  # the target is the 8b-shape's
                lines.append(f"criu+ipc median time to ready {medians[m['preset']]:.2f} s: target <= 1.5 s "
                             f"{'met' if medians[m['preset']] <= 1.5 else 'MISSED'}")
            for x in got:
                if x["via_recovery"]:
                    lines.append(f"  {name} recovered by {x['served_by']}: {x.get('recovery_reason')}")
    if len(medians) >= 2:
        (a, ma), (b, mb) = list(medians.items())[:2]
        lines.append(f"size independence: {b} {mb:.2f} s vs {a} {ma:.2f} s (+{mb - ma:.2f} s; target <= +0.3 s: "
                     f"{'met' if mb - ma <= 0.3 else 'MISSED'})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
