"""Prerequisites of the criu strategy: each a predicate with a reason a person can act on."""
from __future__ import annotations

from restartkit.contracts import Facts

MIN_CRIU = (4, 0)


def linux_x86_64(facts: Facts, policy) -> str | None:
    if facts.host.arch != "x86_64":
        return f"CRIU snapshots are supported on x86-64 only; this host is {facts.host.arch}"
    return None


def root_or_sudo(facts: Facts, policy) -> str | None:
    if facts.host.is_root or facts.host.passwordless_sudo:
        return None
    return f"CRIU needs root: run as root or give {facts.host.user} passwordless sudo"


def single_device(facts: Facts, policy) -> str | None:
    svc = policy.service
    sizes = {k: svc[k] for k in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size") if svc[k] != 1}
    if sizes:
        desc = ", ".join(f"{k} = {v}" for k, v in sizes.items())
        return f"CRIU snapshots need one process on one device (TP1, no DP/PP); the policy sets {desc}"
    return None


def criu_usable(facts: Facts, policy) -> str | None:
    c = facts.host.criu
    if not c.path:
        return f"CRIU is not installed ({c.source}); scripts/install-criu installs CRIU 4.2.1 into /opt/restartkit/criu"
    if c.version_tuple and c.version_tuple[:2] < MIN_CRIU:
        return (f"CRIU {c.version} at {c.path} is too old: 4.0 or newer is needed; "
                "scripts/install-criu installs 4.2.1 beside it")
    if not c.check_ok:
        lines = [ln.strip() for ln in (c.check_output or "").splitlines() if ln.strip()]
        if cap := next((ln for ln in lines if "CAP_" in ln), None):  # CRIU names it first, then a setcap line
            return (f"`{c.path} check` fails: {cap.rstrip(': ')}; run it as root with that capability, or "
                    f"`setcap cap_checkpoint_restore+eip {c.path}` (the CRIU binary), or in a container add "
                    "CHECKPOINT_RESTORE and SYS_ADMIN to its securityContext capabilities "
                    "(docs/kubernetes-criu.yaml)")
        from restartkit.snapshot.criu import first_error
        said = first_error(c.check_output or "") or (lines[-1] if lines else "no output")
        if "sysctl" in said and "Read-only file system" in said:
            return (f"`{c.path} check` fails: {said}; CRIU needs a writable /proc/sys: run it on the host, or in a "
                    "container that mounts /proc/sys read-write (systemd-nspawn: SYSTEMD_NSPAWN_API_VFS_WRITABLE=1; "
                    "Docker/Kubernetes: a privileged container)")
        return f"`{c.path} check` fails: {said}; scripts/install-criu installs a CRIU that passes on this kernel"
    return None


IO_URING_ENGINES = ("vllm", "sglang")  # engines known to open an io_uring when the kernel allows it


def io_uring_off(facts: Facts, policy) -> str | None:
    held = facts.of("criu").get("io_uring_pids")
    if held:
        return (f"the engine's process tree holds an io_uring (PID {held[0]}), which CRIU cannot dump; "
                "set `sysctl -w kernel.io_uring_disabled=2` and restart the engine cold before snapshotting")
    v = facts.host.io_uring_disabled
    if v in (None, 2) or policy.service["engine"] not in IO_URING_ENGINES:
        return None
    return (f"kernel.io_uring_disabled is {v} and {policy.service['engine']} opens an io_uring when it can: "
            "run `sysctl -w kernel.io_uring_disabled=2` before the engine starts")


def not_ipc_attached(facts: Facts, policy) -> str | None:
    """A snapshot never holds the weight cache's memory: an engine that maps it is snapshotted
    without its weights (re-attached after the restore: criu+ipc) where its adapter can, or not at all."""
    c = facts.of("criu")
    if not c.get("ipc_attached"):
        return None
    if policy.criu["weights"] == "include":
        return ("the engine maps its weights from a weight-cache daemon and [criu] weights = 'include': CRIU (and "
                "the driver) cannot checkpoint that shared memory; set weights = 'auto' to snapshot it without them")
    if not c.get("weightless_ok"):
        return (f"the engine maps its weights from a weight-cache daemon, and the {policy.service['engine']} adapter "
                "cannot release them before a dump: CRIU (and the driver) cannot checkpoint that shared memory")
    return None


def disk_room(facts: Facts, policy) -> str | None:
    need = facts.of("criu").get("estimated_image_bytes") or 0
    if need and facts.host.state_dir_free_bytes < need:
        return f"{need / 1e9:.1f} GB are needed for the image and {facts.host.state_dir_free_bytes / 1e9:.1f} GB are free"
    return None


def gpu_checkpoint_api(facts: Facts, policy) -> str | None:
    if policy.service["device"] != "cuda":
        return None
    if len(facts.host.gpus) == 0:
        return f"no GPU found through NVML ({facts.host.nvml_error})"
    major = int((facts.host.driver_version or "0").split(".")[0])
    if major < 550:
        return f"driver {facts.host.driver_version} has no CUDA checkpoint API: R550 or newer is needed"
    return None


def _snapshot_usable(c: dict, policy) -> str | None:
    if c.get("error"):
        return f"could not read the snapshot store: {c['error']}"
    if c.get("store_problem"):
        return (f"{c['store_problem']}: its snapshots are not used; remove it or `chown` it to yourself and "
                "`chmod 700` it, or set [criu] images_dir")
    if not c.get("current"):
        return f"no snapshot yet: take one with `restartkit snapshot create --policy {policy.path}`"
    if c.get("damaged"):
        return (f"snapshot {c['current']} is damaged ({c['damaged']}); it is kept for inspection in "
                f"{c['images_dir']}: take a new one with `restartkit snapshot create --policy {policy.path}`")
    if c.get("suspect"):
        return f"snapshot {c['current']} is marked suspect ({c['suspect']['reason']}); refresh it: restartkit snapshot refresh"
    if c.get("mismatches"):
        return f"snapshot {c['current']} was taken for another host or engine: " + "; ".join(c["mismatches"])
    return None


def snapshot_ready(facts: Facts, policy) -> str | None:
    c = facts.of("criu")
    if problem := _snapshot_usable(c, policy):
        return problem
    if c.get("kind") == "weightless":
        return (f"snapshot {c['current']} holds no weights (taken while the engine mapped them from the weight "
                "cache): it restores through criu+ipc")
    return None


def weightless_snapshot_ready(facts: Facts, policy) -> str | None:
    c = facts.of("criu")
    if problem := _snapshot_usable(c, policy):
        return problem
    if c.get("kind") != "weightless":
        return (f"snapshot {c['current']} holds the weights (taken while the engine loaded them from disk): it "
                "restores through criu; a weights-less one is taken of an engine that maps its weights from the "
                f"weight cache (`restartkit restart --strategy ipc`, then `restartkit snapshot create --policy {policy.path}`)")
    return None


def weight_cache_matches_snapshot(facts: Facts, policy) -> str | None:
    """Every rank's daemon serves exactly the weights the snapshot's engine was attached to."""
    from restartkit.weightcache.fingerprint import describe, differences
    c, ipc = facts.of("criu"), facts.of("ipc")
    want = c.get("weight_cache") or []
    if c.get("kind") != "weightless" or not want:
        return None
    if ipc.get("error"):
        return f"could not ask the weight-cache daemons: {ipc['error']}"
    daemons = ipc.get("daemons") or []
    if not daemons or any(d.get("state") != "ready" for d in daemons[:len(want)]):
        which = next((d for d in daemons if d.get("state") != "ready"), None)
        state = f"{which['device_uuid']} is {which.get('state')}" if which else "no daemon information"
        return (f"the weights-less snapshot {c['current']} needs its weight cache running ({state}): "
                f"`restartkit preload --policy {policy.path}`")
    diffs = [f"{d['device_uuid']}: {describe(x)}" for d, w in zip(daemons, want)
             if (x := differences(d.get("fingerprint") or {}, w))]
    if diffs:
        return (f"the weight cache holds other weights than snapshot {c['current']} was attached to: "
                + " | ".join(diffs))
    return None


def model_is_local(model: str) -> bool:
    """A checkpoint on this host (a directory or a single file), not a hub id (gathered: a stat)."""
    import os
    return os.path.exists(os.path.expanduser(model))


def revision_pinned(facts: Facts, policy) -> str | None:
    svc = policy.service
    if svc["revision"] or facts.of("criu").get("model_local"):
        return None  # a local checkpoint (directory or single file) is pinned in the snapshot's identity
    if svc["model"].startswith(("/", "./", "../", "~")):  # a path that is not there: not a hub id either
        return None  # the model's own check names it (model directory ... does not exist)
    return (f"a snapshot is tied to exact weights: {svc['model']} is a hub id, so pin [service] revision "
            "to a 40-character commit id")


def socket_fits_snapshot(facts: Facts, policy) -> str | None:
    """A snapshot of an engine that served on the held socket gave it up before its dump and takes it back
    from supervise after the restore (restartkit.reference.serving.detach); one of an engine with its own socket
    would be re-bound by CRIU on the port supervise holds."""
    held, c = facts.service.held_socket, facts.of("criu")
    if "current" not in c:
        return None  # snapshot_ready says why
    if held is not None and not c.get("on_held_socket"):
        return (f"snapshot {c['current']} was taken of an engine with its own socket, and the service's socket "
                f"{held['address']} is now held by `restartkit supervise`: CRIU would re-bind the port it holds; "
                f"take a new snapshot under supervise (restartkit snapshot create --policy {policy.path})")
    if held is None and c.get("on_held_socket"):
        return (f"snapshot {c['current']} was taken under `restartkit supervise` (its engine gave up the held socket "
                "for the dump and takes it back from supervise after the restore), and no supervise holds the "
                "socket now: restore it under supervise, or take a new snapshot without it")
    return None


SNAPSHOT_PREREQUISITES = [linux_x86_64, root_or_sudo, single_device, criu_usable, io_uring_off, revision_pinned,
                          not_ipc_attached, gpu_checkpoint_api, disk_room]
# restoring a full snapshot does not care how the engine it replaces got its weights
PREREQUISITES = [p for p in SNAPSHOT_PREREQUISITES if p is not not_ipc_attached] + [snapshot_ready, socket_fits_snapshot]
WEIGHTLESS_PREREQUISITES = [linux_x86_64, root_or_sudo, single_device, criu_usable, io_uring_off, revision_pinned,
                            gpu_checkpoint_api, weightless_snapshot_ready, weight_cache_matches_snapshot,
                            socket_fits_snapshot]
