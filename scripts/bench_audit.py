#!/usr/bin/env python3
"""Time `restartkit audit` on a synthetic deploy repository of N files
(copies of the test fixture among plain files), the way a user runs it.

    python3 scripts/bench_audit.py [--files 3000]
"""
import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--files", type=int, default=3000)
    args = p.parse_args()
    fixture = ROOT / "tests" / "fixtures" / "deploy"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        n = 0
        while n < args.files:
            d = root / f"svc{n // 100:03d}"
            if not d.exists():
                shutil.copytree(fixture, d)
                n += sum(1 for f in d.rglob("*") if f.is_file())
            (d / f"deploy-{n}.yaml").write_text("kind: ConfigMap\ndata:\n  a: b\n" * 20)
            (d / f"run-{n}.sh").write_text("#!/bin/sh\necho starting\nexec ./server --port 8000\n" * 10)
            n += 2
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "restartkit.cli", "audit", str(root), "--json"],
                               capture_output=True, text=True, cwd=ROOT)
            runs.append(time.perf_counter() - t0)
        import json
        out = json.loads(r.stdout)
        print(f"{out['files_scanned']} files, {len(out['findings'])} findings; "
              f"whole command (process start included): best {min(runs):.3f} s, runs {', '.join(f'{x:.3f}' for x in runs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
