"""A real systemd, booted as PID 1 of a container (systemd-nspawn -b), for the tests of what operators deploy.

This machine's own PID 1 is not systemd, so the units restartkit writes are run where one is: a Debian root made by
scripts/booted-root (debootstrap, cached), copied per run, with restartkit installed into the copy the way an operator
installs it (a checkout under /opt, `RESTARTKIT_RUNTIME_ONLY=1 scripts/setup`), then booted with its own network
namespace (loopback only) and entered through nsenter into its PID 1's namespaces."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = "/opt/restartkit/src"  # where the operator's checkout lives in the container
RESTARTKIT = f"{SRC}/.venv/bin/restartkit"
PYTHON = f"{SRC}/.venv/bin/python"
CRIU_PREFIX = "/opt/restartkit/criu"  # scripts/install-criu's, patched for this absolute path: bound in as it is
# what pip needs to install torch and the rest offline-first, as on the host (where these exist)
PIP_BINDS = ("/opt/wheels", "/opt/pypi", "/opt/pypi-more", "/etc/ssl/certs")


def why_not() -> str | None:
    """Why this machine cannot boot the container (None: it can)."""
    if os.getuid() != 0:
        return "needs root (systemd-nspawn)"
    for tool in ("systemd-nspawn", "nsenter", "debootstrap"):
        if shutil.which(tool) is None:
            return f"no {tool} (scripts/install-tools installs systemd-container and debootstrap)"
    if os.environ.get("RESTARTKIT_SKIP_BOOTED"):
        return "RESTARTKIT_SKIP_BOOTED is set"
    return None


class Booted:
    """One booted container: `sh` runs a shell script inside it, as root, in every namespace of its PID 1."""

    def __init__(self):
        self.work = Path(tempfile.mkdtemp(prefix="restartkit-booted-", dir="/var/tmp"))
        self.root = self.work / "root"
        self.nspawn: subprocess.Popen | None = None
        self.pid1: int | None = None
        self.log = self.work / "nspawn.log"

    # ---- making it ----------------------------------------------------------------------
    def prepare(self) -> "Booted":
        base = subprocess.run([str(ROOT / "scripts" / "booted-root")], capture_output=True, text=True, timeout=900)
        if base.returncode != 0:
            raise RuntimeError(f"scripts/booted-root failed: {base.stderr[-2000:]}")
        subprocess.run(["cp", "-a", "--reflink=auto", base.stdout.strip().splitlines()[-1], str(self.root)],
                       check=True, timeout=600)
        self._copy_checkout()
        self._install()
        return self

    def _copy_checkout(self) -> None:
        """The working tree as git sees it (tracked and untracked-not-ignored files), as a clone would have it."""
        files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, check=True).stdout.split(b"\0")
        dest = self.root / SRC.lstrip("/")
        for rel in filter(None, files):
            src = ROOT / rel.decode()
            if src.is_file():
                (dest / rel.decode()).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel.decode())

    def _binds(self, paths) -> list[str]:
        return [f"--bind-ro={p}" for p in paths if os.path.exists(p)]

    def _install(self) -> None:
        """The operator's install, run in the container's root (not booted yet), with this machine's network."""
        pip_conf = [f"--bind-ro={p}:/etc/pip.conf" for p in (os.path.expanduser("~/.config/pip/pip.conf"),)
                    if os.path.exists(p)]
        env = ["--setenv=RESTARTKIT_RUNTIME_ONLY=1", "--setenv=RESTARTKIT_SKIP_VLLM=1",
               "--setenv=RESTARTKIT_SKIP_TOOLS=1", "--setenv=PIP_CERT=/etc/ssl/certs/ca-certificates.crt"]
        r = subprocess.run(["systemd-nspawn", "-q", "-D", str(self.root), "--register=no", "--keep-unit",
                            *self._binds(PIP_BINDS), *self._binds([CRIU_PREFIX]), *pip_conf, *env,
                            f"--chdir={SRC}", "bash", "scripts/setup"], capture_output=True, text=True, timeout=900)
        if r.returncode != 0 or not (self.root / RESTARTKIT.lstrip("/")).exists():
            raise RuntimeError(f"scripts/setup in the container failed ({r.returncode}): {r.stderr[-3000:]}")

    def boot(self, timeout: float = 120) -> "Booted":
        env = {**os.environ, "SYSTEMD_NSPAWN_API_VFS_WRITABLE": "1", "SYSTEMD_SECCOMP": "0"}  # what CRIU needs inside
        with open(self.log, "wb") as log:
            self.nspawn = subprocess.Popen(
                ["systemd-nspawn", "-q", "-b", "-D", str(self.root), "--register=no", "--keep-unit",
                 "--private-network", "--console=passive", "--capability=all",
                 f"--machine=rk{os.getpid()}", *self._binds([CRIU_PREFIX])],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.nspawn.poll() is not None:
                raise RuntimeError(f"systemd-nspawn exited {self.nspawn.returncode}: {self.log.read_text()[-2000:]}")
            self.pid1 = self.pid1 or self._find_pid1()
            if self.pid1:
                state = self.run(["systemctl", "is-system-running"], check=False).stdout.strip()
                if state in ("running", "degraded"):
                    return self
            time.sleep(0.5)
        raise RuntimeError(f"the container's systemd did not come up within {timeout:.0f} s")

    def _find_pid1(self) -> int | None:
        try:
            kids = Path(f"/proc/{self.nspawn.pid}/task/{self.nspawn.pid}/children").read_text().split()
        except OSError:
            return None
        for kid in map(int, kids):
            try:
                if Path(f"/proc/{kid}/comm").read_text().strip() == "systemd":
                    return kid
            except OSError:
                pass
        return None

    def close(self) -> None:
        if self.nspawn is not None and self.nspawn.poll() is None:
            if self.pid1:
                self.run(["systemctl", "poweroff", "--no-block"], check=False)
            try:
                self.nspawn.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.nspawn.pid, signal.SIGKILL)
                self.nspawn.wait(30)
        shutil.rmtree(self.work, ignore_errors=True)

    # ---- using it -----------------------------------------------------------------------
    def run(self, argv: list[str], check: bool = True, timeout: float = 300, user: str | None = None):
        cmd = ["nsenter", "-t", str(self.pid1), "-a", *(["setpriv", f"--reuid={user}", f"--regid={user}",
                                                         "--init-groups"] if user else []), *argv]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                                "HOME": "/root", "LANG": "C.UTF-8"})
        if check and r.returncode != 0:
            raise AssertionError(f"{argv} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        return r

    def sh(self, script: str, check: bool = True, timeout: float = 300):
        return self.run(["bash", "-ec", script], check=check, timeout=timeout)

    def show(self, unit: str, *props: str) -> dict:
        out = self.run(["systemctl", "show", unit, *(f"-p{p}" for p in props)]).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait(self, what, timeout: float = 120, every: float = 0.5):
        from tests.helpers import wait_for
        return wait_for(what, timeout, every)

    def write(self, path: str, text: str) -> None:
        p = self.root / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
