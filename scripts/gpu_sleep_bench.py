#!/usr/bin/env python3
"""The sleep strategy on one GPU, end to end, through the real CLI.

    python3 scripts/gpu_sleep_bench.py --out DIR [--preset 8b-shape] [--model DIR]

For level 1 and level 2: the engine's own device memory (NVML, per process)
before, asleep and after; the wake's weight throughput (level 1, pinned host
memory to device) or time (level 2, from disk); the canary after the wake.
Target: level-1 wake at >= 45 GB/s.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import bench_setup, cli, write_policy  # noqa: E402


def main() -> int:
    args, out, work, model = bench_setup("/tmp/rk-sleep", 8600)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "runs": []}
    for level in (1, 2):
        pol = write_policy(work, f"ref-sleep-l{level}", model, args.device, args.port + level,
                           sections=f"[sleep]\nenabled = true\nlevel = {level}\n")
        try:
            cli("stop", "--policy", pol, check=False)
            cli("start", "--policy", pol)
            for _ in range(2):
                rec = json.loads(cli("restart", "--policy", pol, "--strategy", "sleep", "--json").stdout)
                a = rec["attempts"][-1]
                res["runs"].append({"level": level, "served_by": rec["served_by"], "via_recovery": rec["via_recovery"],
                                    "recovery_reason": rec["recovery_reason"], "time_to_ready_s": rec["time_to_ready_s"],
                                    "canary_identical": rec["proof"].get("canary_identical"),
                                    "phases": a.get("phases"), "proof": {k: v for k, v in (a.get("proof") or {}).items() if k != "canary"}})
        except Exception as e:
            res[f"error_l{level}"] = str(e)[-2000:]
        finally:
            cli("stop", "--policy", pol, check=False)
    (out / "sleep_results.json").write_text(json.dumps(res, indent=2))
    print(verdict(res))
    return 0


def verdict(res: dict) -> str:
    gb = lambda b: f"{b / 1e9:.2f}" if b is not None else "-"  # noqa: E731
    lines = ["", "sleep on one GPU (engine device memory per process, NVML)",
             f"{'level':<6}{'before GB':>10}{'asleep GB':>10}{'after GB':>9}{'sleep s':>8}{'wake s':>8}{'wake GB/s':>10}  canary  served by"]
    for r in res["runs"]:
        pr, ph = r["proof"], r["phases"] or {}
        w = pr.get("wake") or {}
        lines.append(f"{r['level']:<6}{gb(pr.get('memory_before')):>10}{gb(pr.get('memory_asleep')):>10}{gb(pr.get('memory_after')):>9}"
                     f"{ph.get('sleep', 0):>8.2f}{ph.get('wake', 0):>8.2f}{w.get('weights_GBps') or 0:>10.1f}  "
                     f"{'same' if r['canary_identical'] else r['canary_identical']!s:<6}  {r['served_by']}"
                     + (f" (recovered: {r['recovery_reason']})" if r["via_recovery"] else ""))
    l1 = [r["proof"].get("wake", {}).get("weights_GBps") for r in res["runs"] if r["level"] == 1 and not r["via_recovery"]]
    l1 = [x for x in l1 if x]
    if l1:
        lines.append(f"level-1 wake throughput: best {max(l1):.1f} GB/s; target >= 45 GB/s: {'met' if max(l1) >= 45 else 'MISSED'}")
    for k in ("error_l1", "error_l2"):
        if k in res:
            lines.append(f"{k}: {res[k][-800:]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
