"""Host facts: what this machine can do, gathered once per command.

Cheap and torch-free: `restartkit facts` must answer in well under a second.
"""
from __future__ import annotations

import dataclasses
import os
import platform
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from restartkit.guard.trust import binary_problem

DEFAULT_CRIU = "/opt/restartkit/criu/bin/criu"


@dataclass
class GPU:
    index: int
    name: str
    uuid: str
    memory_total_bytes: int
    memory_free_bytes: int


@dataclass
class CriuFacts:
    path: str | None = None
    source: str = ""  # policy | RESTARTKIT_CRIU | default prefix | PATH
    version: str | None = None
    check_ok: bool = False
    check_output: str = ""

    @property
    def version_tuple(self) -> tuple[int, ...]:
        if not self.version:
            return ()
        return tuple(int(x) for x in re.findall(r"\d+", self.version)[:3])


@dataclass
class HostFacts:
    arch: str
    kernel: str
    uid: int
    user: str
    passwordless_sudo: bool
    machine_id: str
    python: str
    cpu_count: int
    mem_total_bytes: int
    mem_available_bytes: int
    io_uring_disabled: int | None
    gpus: list[GPU] = field(default_factory=list)
    nvml_error: str | None = None
    driver_version: str | None = None
    criu: CriuFacts = field(default_factory=CriuFacts)
    state_dir: str = ""
    state_dir_free_bytes: int = 0

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    def to_dict(self) -> dict:
        return asdict(self)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _meminfo() -> tuple[int, int]:
    total = avail = 0
    for line in (_read("/proc/meminfo") or "").splitlines():
        k, _, v = line.partition(":")
        if k == "MemTotal":
            total = int(v.split()[0]) * 1024
        elif k == "MemAvailable":
            avail = int(v.split()[0]) * 1024
    return total, avail


def _sudo_ok() -> bool:
    if os.getuid() == 0:
        return True
    if not shutil.which("sudo"):
        return False
    try:
        return subprocess.run(["sudo", "-n", "true"], capture_output=True, timeout=5).returncode == 0
    except (subprocess.TimeoutExpired, OSError):
        return False


def gpus_from_nvml() -> tuple[list[GPU], str | None, str | None]:
    try:
        import pynvml
    except ImportError:
        return [], None, "nvidia-ml-py is not installed (no NVML)"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # no driver: a CPU host
        return [], None, f"NVML did not start: {e}"
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            out.append(GPU(i, name.decode() if isinstance(name, bytes) else name,
                           uuid.decode() if isinstance(uuid, bytes) else uuid, int(mem.total), int(mem.free)))
        return out, driver, None
    finally:
        pynvml.nvmlShutdown()


def find_criu(policy_path: str = "") -> tuple[str | None, str]:
    """CRIU is looked up in the policy, then RESTARTKIT_CRIU, then the
    prefix scripts/install-criu uses, then PATH."""
    candidates = [(policy_path, "policy"), (os.environ.get("RESTARTKIT_CRIU", ""), "RESTARTKIT_CRIU"),
                  (DEFAULT_CRIU, "default prefix"), (shutil.which("criu") or "", "PATH")]
    for path, source in candidates:
        if path and os.access(path, os.X_OK):
            return path, source
        if path and source in ("policy", "RESTARTKIT_CRIU"):
            return None, f"{source} names {path}, which is not an executable file"
    return None, "not found in RESTARTKIT_CRIU, /opt/restartkit/criu or PATH"


CRIU_FACTS_TTL_S = 60.0  # a long-lived process (supervise) asks CRIU again after this long, or when the binary changed
_criu_seen: dict[tuple, tuple[float, CriuFacts]] = {}


def criu_facts(policy_path: str = "", run_check: bool = True) -> CriuFacts:
    """What CRIU is and whether `criu check` passes.  Two subprocesses (65 ms on the CPU here, more on a
    GPU host): kept for CRIU_FACTS_TTL_S per binary (path, inode, size, mtime), so that supervise's
    crash restarts do not pay for them between noticing a crash and restarting."""
    path, source = find_criu(policy_path)
    try:
        st = os.stat(path) if path else None
    except OSError:
        st = None
    key = (policy_path, path, run_check, st and (st.st_ino, st.st_size, st.st_mtime_ns))
    hit = _criu_seen.get(key)
    if hit is not None and time.monotonic() - hit[0] < CRIU_FACTS_TTL_S:
        return dataclasses.replace(hit[1])
    facts = _criu_facts(path, source, run_check)
    _criu_seen.clear()
    _criu_seen[key] = (time.monotonic(), facts)
    return dataclasses.replace(facts)


def _criu_facts(path: str | None, source: str, run_check: bool) -> CriuFacts:
    facts = CriuFacts(path=path, source=source)
    if not path:
        return facts
    if source in ("policy", "RESTARTKIT_CRIU") and (problem := binary_problem(path)):
        # a policy file must not choose a binary that root runs (even for a dry run) unless it is root's or ours
        facts.check_output = f"not run: {problem}; install CRIU where only you or root can change it"
        return facts
    try:
        v = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
        m = re.search(r"Version:\s*(\S+)", v.stdout)
        facts.version = m.group(1) if m else (v.stdout.strip() or None)
        if run_check:
            c = subprocess.run([path, "check"], capture_output=True, text=True, timeout=30)
            facts.check_ok = c.returncode == 0
            facts.check_output = (c.stdout + c.stderr).strip()[-400:]
    except (subprocess.TimeoutExpired, OSError) as e:
        facts.check_output = f"{type(e).__name__}: {e}"
    return facts


def gather(state_dir: str | os.PathLike = "", criu_path: str = "", run_criu_check: bool = True) -> HostFacts:
    total, avail = _meminfo()
    gpus, driver, nvml_error = gpus_from_nvml()
    io_uring = _read("/proc/sys/kernel/io_uring_disabled")
    sd = Path(state_dir or os.path.expanduser("~/.local/state/restartkit"))
    probe = sd
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        import pwd
        user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        user = str(os.getuid())
    return HostFacts(
        arch=platform.machine(), kernel=platform.release(), uid=os.getuid(), user=user,
        passwordless_sudo=_sudo_ok(), machine_id=_read("/etc/machine-id") or "",
        python=platform.python_version(), cpu_count=os.cpu_count() or 1,
        mem_total_bytes=total, mem_available_bytes=avail,
        io_uring_disabled=int(io_uring) if io_uring and io_uring.isdigit() else None,
        gpus=gpus, nvml_error=nvml_error, driver_version=driver,
        criu=criu_facts(criu_path, run_criu_check), state_dir=str(sd),
        state_dir_free_bytes=shutil.disk_usage(probe).free,
    )
