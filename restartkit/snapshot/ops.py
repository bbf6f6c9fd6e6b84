"""Create snapshots of a service's engine (restore: restartkit/snapshot/restore.py), and what both share.

create: canary -> drop the KV cache -> (GPU: lock + checkpoint through the
driver) -> CRIU dump -> either leave the engine running (driver restore +
unlock, KV cache back: a refresh of a live service) or let it die (a
restart).  Whatever fails, the engine is put back and `current` is untouched.

"""
from __future__ import annotations

import hashlib
import os
import platform
import signal
import time
from importlib import metadata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from restartkit import __version__, http
from restartkit.errors import StrategyError, UsageError
from restartkit.guard.deferred import check_interrupted
from restartkit.snapshot.criu import Criu
from restartkit.snapshot.seal import seal
from restartkit.snapshot.cudackpt import CudaCheckpoint, uses_cuda
from restartkit.snapshot.store import Snapshot, SnapshotStore, dir_bytes
from restartkit.process.shm import held_by
from restartkit.process.procfs import environ_and_argv, fd_targets, maps, tree_pids
from restartkit.weightcache.fingerprint import local_checkpoint_identity

ENV_PREFIXES = ("CUDA_", "NCCL_", "TORCH_", "PYTORCH_", "VLLM_", "SGLANG_", "OMP_", "MKL_")


def store_for(service) -> SnapshotStore:
    d = service.policy.criu["images_dir"]
    return SnapshotStore(Path(os.path.expanduser(d)) if d else service.state_dir / "snapshots")


def snapshot_metrics(service, refresh: str | None = None) -> None:
    """Rewrite the service's snapshot.prom; a metrics file that cannot be written never fails the work."""
    from restartkit.record import textfile, write_snapshot_metrics
    try:
        write_snapshot_metrics(service.state_dir, service.policy.name, store_for(service), refresh,
                               textfile(service.policy, "snapshot"))
    except OSError:
        pass


def env_hash(env: dict) -> str:
    relevant = sorted((k, v) for k, v in env.items() if k.startswith(ENV_PREFIXES))
    return hashlib.sha256(repr(relevant).encode()).hexdigest()[:16]


def identity(service, facts) -> dict:
    """What must be the same on the host for a snapshot to be restorable."""
    s = service.policy.service
    spec = service.adapter.launch(service.policy)
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    gpu = facts.host.gpus[0] if facts.host.gpus and s["device"] == "cuda" else None
    return {
        "restartkit": __version__, "engine": s["engine"], "engine_version": service.adapter.version(),
        "python": platform.python_version(), "torch": torch_version, "kernel": facts.host.kernel,
        "machine_id": facts.host.machine_id, "criu": facts.host.criu.version, "driver": facts.host.driver_version,
        "gpu_name": gpu.name if gpu else None, "gpu_uuid": gpu.uuid if gpu else None,
        "model": s["model"], "revision": s["revision"],
        "checkpoint": local_checkpoint_identity(s["model"]),
        "engine_argv": spec.argv[1:], "env": env_hash({**os.environ, **spec.env}),
    }


def host_identity(service, facts) -> dict:
    """This host's identity as the criu strategy gathered it (computed once per command:
    it reads the checkpoint's digest), or computed now for facts gathered without it."""
    return facts.of("criu").get("identity") or identity(service, facts)


def mismatches(snapshot_identity: dict, host_identity: dict) -> list[str]:
    return [f"{k}: snapshot {snapshot_identity.get(k)!r}, host {host_identity.get(k)!r}"
            for k in sorted(set(snapshot_identity) | set(host_identity))
            if snapshot_identity.get(k) != host_identity.get(k)]


REATTACH_TIMEOUT_S = 60.0  # a restored weights-less engine re-attaching its weights (and its KV cache)
ARENA = "memfd:restartkit-arena"  # the weight cache's shared memory on the CPU (an fd or a mapping of it)


def arena_holders(pids: list[int]) -> list[int]:
    """Processes of the tree that hold or map a weight-cache arena."""
    out = []
    for pid in pids:
        if any(ARENA in line for line in maps(pid)) or any(ARENA in t for t in fd_targets(pid)):
            out.append(pid)
    return out


def dump_blockers(pids: list[int], weightless: bool = False) -> list[str]:
    """Descriptors CRIU cannot dump, named with the fix.  A weights-less snapshot releases the
    weight-cache arena before the dump (checked again then), so it is not a blocker here."""
    out = []
    for pid in pids:
        for target in fd_targets(pid):
            if "io_uring" in target:
                out.append(f"PID {pid} holds an io_uring ({target}): set kernel.io_uring_disabled=2 before the engine starts")
            elif target.startswith("/dev/infiniband"):
                out.append(f"PID {pid} holds {target}: RDMA devices cannot be checkpointed")
    if not weightless:
        out += [f"PID {p} maps a weight-cache arena: an ipc-attached engine is snapshotted without its weights "
                "([criu] weights = 'auto' or 'exclude'), never with them" for p in arena_holders(pids)]
    return out


def snapshot_kind(service, facts) -> str:
    """"weightless" (the weights stay in the weight cache and are re-attached after the restore:
    the criu+ipc strategy) when the engine maps them from the cache, else "full"; [criu] weights
    = include | exclude forces one kind."""
    want = service.policy.criu["weights"]
    if want == "include":
        return "full"
    if want == "exclude":
        return "weightless"
    c = facts.of("criu")
    return "weightless" if c.get("ipc_attached") or c.get("reattachable") else "full"


def create(service, facts, leave_running: bool = True, progress: Callable[[str], None] = lambda _m: None,
           make_current: bool = True) -> Snapshot:
    """preflight (nothing touched) -> canary -> dump (the engine put back whatever fails) -> manifest."""
    proc = service.current()
    if proc is None or not service.is_ready():
        raise StrategyError(f"{service.policy.name} is not serving", hint=f"start it first: restartkit start --policy {service.policy.path}")
    pids = tree_pids(proc.pid)
    kind = snapshot_kind(service, facts)
    _preflight(service, facts, proc.pid, pids, kind == "weightless", progress)
    progress("taking the canary")
    canary = service.canary()
    ident = host_identity(service, facts)
    store = store_for(service)
    images = store.new_dir()
    service.intent.update(images=str(images))  # a create killed halfway leaves it: the next command removes it
    crit = Criu(facts.host.criu.path)
    held = bool((facts.service.stats or {}).get("held_socket"))  # it gives that up for the dump (detach.py)
    dump = _dump(service, crit, proc.pid, pids, images, kind == "weightless", leave_running, progress, held)
    if not leave_running:
        service.engine.pidfile.unlink(missing_ok=True)
    manifest = _manifest(service, facts, kind, proc.pid, pids, ident, canary, crit, dump, images, leave_running)
    manifest["seal"] = seal(manifest, images)
    private_files(images)
    snap = store.commit(images, manifest, make_current)
    store.prune(service.policy.criu["keep"])
    progress(f"snapshot {snap.id}: {manifest['image_bytes'] / 1e6:.1f} MB in {dump.phases['criu_dump']:.2f} s; "
             f"the engine served nothing for {dump.freeze_s:.2f} s (its dump)")
    return snap


def _preflight(service, facts, pid: int, pids: list[int], weightless: bool, progress) -> None:
    """Every reason the engine cannot be snapshotted, before anything is touched."""
    if weightless and (problem := service.adapter.weightless_problem(service.policy)):
        raise UsageError(f"{problem}, so a snapshot without the weights cannot be taken",
                         hint="start the engine without the weight cache, or set [criu] weights = 'include'")
    if weightless and not (facts.of("criu").get("ipc_attached") or facts.of("criu").get("reattachable")):
        raise StrategyError("[criu] weights = 'exclude', but the engine loaded its weights from disk: there is no "
                            "weight cache to re-attach them from after a restore",
                            hint=f"restart it through the weight cache first (restartkit restart --policy "
                                 f"{service.policy.path} --strategy ipc), or set [criu] weights = 'auto'")
    if blockers := dump_blockers(pids, weightless):
        raise StrategyError("the engine cannot be dumped: " + "; ".join(blockers))
    if secrets := secret_names(pid):
        what = ", ".join(secrets)
        if service.policy.criu["refuse_secrets"]:
            raise UsageError(f"the engine's environment or arguments carry {what}: a snapshot image would hold it in clear",
                             hint="start the engine without it, or set [criu] refuse_secrets = false to snapshot anyway")
        progress(f"warning: the engine's environment or arguments carry {what}; the snapshot image holds it "
                 "(files 0600 in a 0700 directory; [criu] refuse_secrets = true refuses instead)")


@dataclass
class _Dumped:
    gpu: bool
    phases: dict[str, float] = field(default_factory=dict)
    freeze_s: float = 0.0  # the engine served nothing from the release of its KV cache until it was put back
    shrunk: dict = field(default_factory=dict)  # what the engine freed before the dump
    reattached: dict = field(default_factory=dict)  # what it said when it took its weights back (left running)
    admin_port: int | None = None  # on a held socket: the private port it served admin calls on meanwhile


def _dump(service, crit: Criu, pid: int, pids: list[int], images: Path, weightless: bool, leave_running: bool,
          progress, held: bool = False) -> _Dumped:
    """KV cache (and weights: weights-less) released, device memory to the host, CRIU dump, and the
    engine put back when it stays running.  Whatever fails, the engine is put back and the images go.
    The command's guard defers SIGTERM/SIGHUP/SIGINT until the engine is put back; a SIGKILL leaves
    the intent saying the KV cache was dropped, and the next command gives it back.  `held`: the
    engine serves on supervise's held socket, which it gives up first (clients wait in its queue)."""
    # long: each step of the dump in order, and the one rollback that undoes whichever of them ran
    adapter, pol = service.adapter, service.policy
    out = _Dumped(gpu=any(uses_cuda(p) for p in pids))
    cuda = CudaCheckpoint() if out.gpu else None
    checkpointed = kv_dropped = dumped = False
    base = None
    try:
        check_interrupted(service, "the snapshot was not taken; the engine keeps serving")
        t = frozen = time.monotonic()
        if held:
            service.intent.update(detached={"pid": pid})
            try:
                base = adapter.detach_listener(pol)
            except http.HTTPFailure as e:
                if e.status != 409:
                    raise
                service.intent.update(detached=None)  # it gave nothing up
                # e.g. a standby promoted after a crash: it serves on supervise's socket but cannot give it up
                raise UsageError(f"PID {pid} cannot give up supervise's held socket for a dump ({e.message}); "
                                 "no snapshot was taken and it keeps serving",
                                 hint="restart it once under supervise (systemctl reload, or restartkit restart "
                                      "--strategy cold), then take the snapshot") from None
            out.admin_port = int(base.rsplit(":", 1)[1])
            service.intent.update(detached={"pid": pid, "admin_port": out.admin_port})
            out.phases["detach_listener"] = round(time.monotonic() - t, 3)
        service.intent.update(kv_dropped="weights" if weightless else True)
        out.shrunk = adapter.before_snapshot(pol, weights=weightless, base=base)
        kv_dropped = True
        out.phases["release_weights" if weightless else "drop_kv_cache"] = round(time.monotonic() - t, 3)
        if weightless and (held := arena_holders(pids)):
            raise StrategyError(f"PID {held[0]} still maps the weight-cache arena after releasing its weights: "
                                "the snapshot would hold them", hint="report this: the engine kept a reference")
        if cuda:
            progress("moving device memory to the host (CUDA checkpoint API)")
            t = time.monotonic()
            for p in cuda_pids(pids):
                cuda.lock(p)
                cuda.checkpoint(p)
            checkpointed = True
            out.phases["cuda_checkpoint"] = round(time.monotonic() - t, 3)
        check_interrupted(service, "the snapshot was not taken; the engine keeps serving")
        progress(f"dumping PID {pid} ({len(pids)} processes) with CRIU into {images}")
        t = time.monotonic()
        crit.dump(pid, images, leave_running=leave_running, shm_files=held_by(pids))
        dumped = True
        out.phases["criu_dump"] = round(time.monotonic() - t, 3)
        out.freeze_s = round(time.monotonic() - frozen, 3)  # the engine is gone after it, unless put back
    except BaseException:
        if not dumped or leave_running:
            _put_back(service, pids, cuda if checkpointed else None, kv_dropped, weightless, base, pid)
        _discard(images, service)
        raise
    if leave_running:
        t = time.monotonic()
        try:
            out.reattached = _put_back(service, pids, cuda if checkpointed else None, kv_dropped, weightless, base,
                                       pid)
        except Exception as e:
            _discard(images, service)
            raise StrategyError(f"the engine did not come back after the dump: {e}",
                                hint=f"check it with `restartkit status --policy {service.policy.path}`; "
                                     "the previous snapshot stays current") from None
        out.phases["resume"] = round(time.monotonic() - t, 3)
        out.freeze_s = round(time.monotonic() - frozen, 3)
    return out


def _manifest(service, facts, kind: str, pid: int, pids: list[int], ident: dict, canary, crit: Criu,
              dump: _Dumped, images: Path, leave_running: bool) -> dict:
    manifest = {
        "kind": kind, "created_at": time.time(), "service": service.policy.name, "pid": pid, "tree_pids": pids,
        "gpu": dump.gpu, "identity": ident,
        "canary": {"prompts": service.policy.restart["canary_prompts"], "tokens": canary},
        "criu_via": crit.last_via, "phases": dump.phases,
        "kv_cache_freed_bytes": dump.shrunk.get("kv_cache_freed_bytes", 0), "image_bytes": dir_bytes(images),
        "left_running": leave_running, "files": image_sizes(images), "freeze_s": dump.freeze_s,
        "listener": {"held": dump.admin_port is not None, "admin_port": dump.admin_port},
    }
    if kind == "weightless":
        # what the restore re-attaches: the weight cache's fingerprint for each rank, as the engine asked for it
        manifest["weight_cache"] = weight_cache_fingerprints(facts)
        manifest["weights_released_bytes"] = dump.shrunk.get("weights_released_bytes", 0)
        if leave_running:
            manifest["reattach"] = {k: dump.reattached.get(k) for k in ("ipc", "mode", "attach_s", "reattach_s")}
    return manifest


SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")


def secret_names(pid: int) -> list[str]:
    """Environment variables and flags of the running engine whose names say they hold a secret."""
    got = environ_and_argv(pid)
    if got is None:
        return []
    environ, argv = got
    names = sorted({e.split(b"=", 1)[0].decode(errors="replace") for e in environ
                    if b"=" in e and e.split(b"=", 1)[1] and any(w in e.split(b"=", 1)[0].decode(errors="replace").upper()
                                                                 for w in SECRET_WORDS)})
    names += [a.split("=", 1)[0] for a in argv
              if a.startswith("--") and any(w in a.lower() for w in ("api-key", "token", "secret", "password"))]
    return names


def private_files(images: Path) -> None:
    """A CRIU image holds the process's memory (keys in its environment included): owner only."""
    for p in images.rglob("*"):
        try:
            os.chmod(p, 0o700 if p.is_dir() else 0o600)
        except OSError:
            pass


def _discard(images: Path, service) -> None:
    """A failed create leaves no image behind, but keeps its CRIU log for the post-mortem."""
    import shutil
    log = images / "dump.log"
    if log.exists():
        service.ensure_state_dir()
        shutil.copy2(log, service.state_dir / "last-failed-dump.log")
    shutil.rmtree(images, ignore_errors=True)


def cuda_pids(pids: list[int]) -> list[int]:
    return [p for p in pids if uses_cuda(p)]


def device_restore(pid: int) -> float:
    """After CRIU restored the tree of `pid`: the driver puts each CUDA process's device memory back
    and lets it run again; returns the seconds it took."""
    t = time.monotonic()
    _devices_back(CudaCheckpoint(), tree_pids(pid))
    return round(time.monotonic() - t, 3)


def _devices_back(cuda: CudaCheckpoint, pids: list[int]) -> None:
    for p in cuda_pids(pids):
        cuda.restore(p)
        cuda.unlock(p)


def _put_back(service, pids: list[int], cuda: CudaCheckpoint | None, kv_dropped: bool, weights: bool = False,
              base: str | None = None, pid: int | None = None) -> dict:
    """The engine as it was before the dump: device memory back, weights re-attached, KV cache back, and
    (`base`: it gave up the held socket, serving admin calls there) the held socket taken back."""
    if cuda is not None:
        _devices_back(cuda, pids)
    out = {}
    if kv_dropped:
        out = service.adapter.after_resume(service.policy, weights=weights, base=base)
        service.intent.update(kv_dropped=False)
    if base is not None:
        take_back_listener(service, pid)
    return out


def take_back_listener(service, pid: int, timeout_s: float = 10.0) -> float:
    """SIGUSR2: the engine takes the held socket back from supervise's broker (restartkit.reference.serving.detach);
    returns once it serves on it again, with the seconds that took."""
    t = time.monotonic()
    os.kill(pid, signal.SIGUSR2)
    if not service.seam.wait_until(lambda: _serves_public(service), timeout_s):
        raise StrategyError(f"PID {pid} did not take the held socket back within {timeout_s:.0f} s",
                            hint="is `restartkit supervise` still running? its broker hands the socket over")
    service.intent.update(detached=None)
    return round(time.monotonic() - t, 3)


def _serves_public(service) -> bool:
    try:
        return bool(service.adapter.stats(service.policy, timeout=2.0).get("held_socket"))
    except Exception:
        return False


def weight_cache_fingerprints(facts) -> list[dict]:
    """The fingerprints the engine asks the weight cache for, one per rank (ipc's gathered facts)."""
    return list(facts.of("ipc").get("expected") or [])


def image_sizes(images: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in images.iterdir() if p.suffix == ".img"}


def image_damage(snap: Snapshot) -> list[str]:
    """Image files missing or not the size they were written with (cheap: no reading)."""
    now = image_sizes(snap.path) if snap.path.is_dir() else {}
    out = []
    for name, size in (snap.manifest.get("files") or {}).items():
        if name not in now:
            out.append(f"{name} is missing")
        elif now[name] != size:
            out.append(f"{name} is {now[name]} bytes, written as {size}")
    return out


__all__ = ["create", "identity", "mismatches", "store_for"]
