"""Prerequisites of the criu strategy: each a predicate with a reason a person can act on."""
from __future__ import annotations

from restartkit.strategies.base import Facts

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
        last = c.check_output.splitlines()[-1] if c.check_output else "no output"
        return f"`{c.path} check` fails on this kernel ({last}); scripts/install-criu installs a CRIU that passes"
    return None


def io_uring_off(facts: Facts, policy) -> str | None:
    v = facts.host.io_uring_disabled
    if v is None or v == 2:
        return None
    return (f"kernel.io_uring_disabled is {v}: an engine that opened an io_uring cannot be dumped; "
            "run `sysctl -w kernel.io_uring_disabled=2` before the engine starts")


def revision_pinned(facts: Facts, policy) -> str | None:
    svc = policy.service
    if svc["revision"] or svc["engine"] == "reference":
        return None  # the reference engine's checkpoint is local and fingerprinted
    return "a snapshot is tied to exact weights: pin service.revision to a 40-character commit id"


PREREQUISITES = [linux_x86_64, root_or_sudo, single_device, criu_usable, io_uring_off, revision_pinned]
