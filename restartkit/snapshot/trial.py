"""Test restores: a snapshot restored for real, beside the engine it was taken from.

CRIU restores a tree under its old PIDs and its listening socket on its old
port, both still held by the serving engine.  So the copy is restored in new
PID, network and mount namespaces (`unshare --pid --net --mount --fork
--kill-child`): its PIDs and port are free there, /dev/shm is a private tmpfs
(the saved shared-memory files are put back there, never over the serving
engine's), and its log goes to a file of its own (CRIU's --inherit-fd replaces
the engine log).  This module's main() runs as PID 1 of those namespaces:
loopback up, restore, KV cache back, readiness, the canary, one JSON line on
stdout, exit, and the kernel kills what is left in the namespace.

CPU snapshots only (tested with the reference engine and vLLM's CPU build): a
GPU copy would need a second engine's device memory and the CUDA checkpoint API
on PIDs of another PID namespace (not built).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from restartkit.errors import StrategyError

TEST_LOG = "test-restore.log"  # CRIU's log of the test restore, in the image directory
ENGINE_LOG = "test-restore-engine.log"  # what the restored copy wrote, in the image directory


def why_not(manifest: dict | None, binary: str, host: str = "127.0.0.1") -> str | None:
    """Why a test restore cannot run here (None: it can); with a snapshot's manifest, of that snapshot."""
    if manifest and manifest.get("gpu") and manifest.get("kind") != "weightless":
        return ("test restores of full GPU snapshots are not built (the copy would need a second copy of the "
                "weights in device memory); weights-less snapshots can be tested")
    if os.geteuid() != 0:
        return "a test restore needs root (new PID, network and mount namespaces, and CRIU itself)"
    if not shutil.which("unshare"):
        return "unshare (util-linux) is not installed: it makes the namespaces the copy is restored in"
    if not binary:
        return "CRIU is not installed"
    if host not in ("", "0.0.0.0", "::", "127.0.0.1", "localhost"):
        return (f"the engine listens on {host}, an address the copy's own network namespace does not have "
                "(test restores need [service] host on loopback or all addresses)")
    return None


def test_restore(service, facts, snap, say=lambda _m: None) -> dict:
    """Restore a copy of `snap` beside the serving engine and compare its canary with the one
    taken at dump time.  Returns {"ok", "canary_identical", "tokens", "phases", "error"};
    records the result in the snapshot's manifest ("tested").  Never touches the serving engine."""
    from restartkit.snapshot.ops import host_identity, image_damage, mismatches, store_for
    binary = facts.host.criu.path
    if problem := why_not(snap.manifest, binary, service.policy.service["host"]):
        raise StrategyError(problem)
    if miss := mismatches(snap.manifest["identity"], host_identity(service, facts)):
        raise StrategyError(f"snapshot {snap.id} does not match this host: " + "; ".join(miss))
    if damaged := image_damage(snap):
        raise StrategyError(f"snapshot {snap.id}'s images are damaged: " + "; ".join(damaged))
    pol = service.policy
    deadline = pol.criu["restore_timeout_s"] + pol.restart["start_timeout_s"] + 60
    argv = ["unshare", "--pid", "--net", "--mount", "--fork", "--kill-child", "--mount-proc",
            sys.executable, "-m", "restartkit.snapshot.trial", "--policy", str(pol.path), "--images", str(snap.path),
            "--criu", binary, "--engine-log", str(service.engine.log_path), "--timeout", str(pol.criu["restore_timeout_s"]),
            "--state-root", pol.state_root]
    say(f"restoring a copy of {snap.id} in its own namespaces (the engine keeps serving)")
    t0 = time.monotonic()
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=deadline + 30)
    except subprocess.TimeoutExpired:  # --kill-child: the namespace, and the copy in it, died with unshare
        r = None
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")] if r is not None else []
    if r is not None and not lines:  # not the snapshot's fault: nothing is marked
        raise StrategyError(f"the test restore could not run (exit {r.returncode}): {r.stderr.strip()[-500:]}",
                            hint="it needs root, unshare (util-linux) and a kernel that allows new namespaces")
    result = json.loads(lines[-1]) if lines else {
        "ok": False, "error": f"the test restore did not finish within {deadline + 30:.0f} s"}
    if result.get("setup"):
        raise StrategyError(f"the test restore could not set up its namespaces: {result.get('error')}")
    result["wall_s"] = round(time.monotonic() - t0, 3)
    want = snap.manifest["canary"]["tokens"]
    if result.get("ok"):
        result["canary_identical"] = result.get("tokens") == want
        if not result["canary_identical"]:
            result["ok"] = False
            result["error"] = f"the restored copy's canary differs from the one taken at dump time: {result.get('tokens')} vs {want}"
    result["at"] = time.time()
    snap.manifest["tested"] = {k: v for k, v in result.items() if k != "tokens"}
    store_for(service).save(snap)
    return result


# ---- inside the namespaces ---------------------------------------------------------------------
def _loopback_up() -> None:
    """`ip link set lo up`, without needing iproute2."""
    import fcntl
    import socket
    import struct
    SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sh14x", b"lo", 0))
        flags = struct.unpack("16sh14x", ifr)[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh14x", b"lo", flags | IFF_UP))


def _private_shm() -> None:
    """A tmpfs of our own on /dev/shm (this mount namespace only)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, b"mode=1777") != 0:
        raise OSError(ctypes.get_errno(), "mount tmpfs on /dev/shm")


def _inside(args) -> dict:
    from restartkit.service import Service
    from restartkit.snapshot.criu import Criu, put_back_shm
    images = Path(args.images)
    phases: dict[str, float] = {}
    try:  # failing here says nothing about the snapshot
        service = Service.from_policy_file(args.policy, args.state_root)
        adapter, pol = service.adapter, service.policy
        _loopback_up()
        _private_shm()
        put_back_shm(images)
        log_fd = os.open(images / ENGINE_LOG, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except Exception as e:
        return {"ok": False, "setup": True, "error": getattr(e, "message", None) or f"{type(e).__name__}: {e}"}
    # the copy's stdout and stderr: our file in place of the engine log it had at dump time
    inherit = ["--inherit-fd", f"fd[{log_fd}]:{args.engine_log.lstrip('/')}"]
    t = time.monotonic()
    pid = Criu(args.criu, use_rpc=False).restore(images, args.timeout, [], log_name=TEST_LOG,
                                                 pidfile_name="test-restored.pid", extra=inherit, pass_fds=(log_fd,))
    phases["criu_restore"] = round(time.monotonic() - t, 3)
    manifest = json.loads((images / "manifest.json").read_text())
    if manifest.get("gpu"):  # the driver puts the copy's device memory back (its context, no weights)
        from restartkit.snapshot.ops import device_restore
        phases["cuda_restore"] = device_restore(pid)
    t = time.monotonic()
    # a weights-less copy maps the weights from the serving engine's weight cache (a second user
    # of the same arena: no second copy of the weights), then gets its own KV cache
    weightless = manifest.get("kind") == "weightless"
    from restartkit.snapshot.restore import admin_base
    base = admin_base(manifest)  # it gave up supervise's held socket for its dump: the copy answers there alone
    adapter.after_resume(pol, weights=weightless, base=base)
    phases["reattach_weights" if weightless else "kv_cache_restore"] = round(time.monotonic() - t, 3)
    t = time.monotonic()
    last: list[Exception] = []

    def answers() -> bool:
        try:
            if not adapter.completion(pol, "ready?", 1, base=base).get("choices"):
                raise RuntimeError("completion answered without choices")
            return True
        except Exception as e:
            last[:] = [e]
            return False
    if not service.seam.wait_until(answers, pol.restart["start_timeout_s"]):
        raise StrategyError(f"the restored copy did not answer within {pol.restart['start_timeout_s']:.0f} s: {last[0]}")
    phases["ready"] = round(time.monotonic() - t, 3)
    t = time.monotonic()
    tokens = adapter.canary(pol, base=base)
    phases["canary"] = round(time.monotonic() - t, 3)
    return {"ok": True, "tokens": tokens, "phases": phases}


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m restartkit.snapshot.trial", description="run by test_restore only")
    p.add_argument("--policy", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--criu", required=True)
    p.add_argument("--engine-log", required=True)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--state-root", default="")
    args = p.parse_args(argv)
    if os.getpid() != 1:
        print(json.dumps({"ok": False, "error": "not PID 1 of new namespaces: run through test_restore()"}))
        return 2
    try:
        out = _inside(args)
    except Exception as e:
        out = {"ok": False, "error": getattr(e, "message", None) or f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
