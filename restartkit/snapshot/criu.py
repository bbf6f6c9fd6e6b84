"""Driving CRIU: pycriu's RPC (criu swrk) when pycriu imports, else the CLI.

Options a server needs: its listening TCP sockets (dumped by default),
established connections, external unix sockets, file locks, link remap
(its /dev/shm/link_remap.* hard links are saved with the image, since the
files they keep alive do not outlive the engine's own clean-up);
shell-job only when the engine shares our session (restartkit starts
engines in their own session, so it is normally off).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from restartkit.process import keeper
from restartkit.process.lifecycle import ours
from restartkit.process.procfs import kill_tree, now_ticks, proc_start_ticks, proc_state
from restartkit.process.seam import Seam, safe_point
from restartkit.errors import StrategyError
from restartkit.files import log_tail

PYCRIU_DIRS = ["/opt/restartkit/criu/python"]
# Deleted files a process still maps (shared-memory segments, semaphores) are
# saved into the image; CRIU's default limit of 1 MB is too small for engines.
GHOST_LIMIT, GHOST_LIMIT_BYTES = "1024M", 1 << 30
# Established client connections (a service under load) are locked while dumped: through nftables
# where this CRIU and kernel support it (its library comes with scripts/install-criu); CRIU's default,
# iptables, needs the iptables binary, which hosts often lack.
NETWORK_LOCKS_RPC = {"iptables": 1, "nftables": 2}
_network_lock: dict[str, str] = {}


def network_lock(binary: str) -> str:
    """'nftables' when `criu check` says it can lock the network with it, else 'iptables'."""
    if binary not in _network_lock:
        try:
            r = subprocess.run([binary, "check", "--feature", "network_lock_nftables"], capture_output=True,
                               timeout=20, start_new_session=True)
            _network_lock[binary] = "nftables" if r.returncode == 0 else "iptables"
        except (OSError, subprocess.TimeoutExpired):
            _network_lock[binary] = "iptables"
    return _network_lock[binary]


class CriuError(StrategyError):
    def __init__(self, message: str, log_tail: str = "", external: bool = False):
        super().__init__(message, hint="the CRIU log tail is in the record" if log_tail else None)
        self.log_tail = log_tail
        self.external = external  # someone else stopped or killed what CRIU restored: not the images' fault


EXIT_FILE = "restored.exit"  # how the restored engine ended, written by its keeper (restored_exit)


def restored_exit(images: Path, wait_s: float = 1.0) -> int | None:
    """How the engine restored from `images` ended (exit code, or minus the signal), None when it
    has not ended (or its keeper could not say within `wait_s`)."""
    got: list[int] = []

    def written() -> bool:
        try:
            got.append(int((images / EXIT_FILE).read_text()))
            return True
        except (OSError, ValueError):
            return False
    Seam().wait_until(written, wait_s)
    return got[0] if got else None


INTERFERED_S = 1.0  # a restored process stopped, or the restored root gone, this long while CRIU still runs


def interference(pids: list[int], since_ticks: int, seen: set[int]) -> str | None:
    """What someone else did to the tree CRIU is restoring (a restored process stopped by a signal,
    the restored root dead or a zombie), or None.  Only processes this restore created count;
    `seen` keeps those seen restored, so that a root gone since is known to have died."""
    for i, p in enumerate(pids):
        ticks = proc_start_ticks(p)
        if ticks is None or ticks < since_ticks:
            if i == 0 and ticks is None and p in seen:
                return f"the restored process {p} exited while CRIU was restoring it"
            continue
        seen.add(p)
        state = proc_state(p)
        if state == "T":
            return f"the restored process {p} was stopped by a signal while CRIU was restoring it"
        if state in ("Z", "X") and i == 0:
            return f"the restored process {p} was killed while CRIU was restoring it"
    return None


def _pycriu():
    for d in PYCRIU_DIRS + [str(Path(os.environ.get("RESTARTKIT_CRIU", "/x")).parent.parent / "python")]:
        if os.path.isdir(d) and d not in sys.path:
            sys.path.append(d)
    try:
        import pycriu  # noqa: F401
        return pycriu
    except Exception:  # missing, or a protobuf it cannot work with
        return None


class Criu:
    def __init__(self, binary: str, shell_job: bool = False, use_rpc: bool = True):
        self.binary, self.shell_job = binary, shell_job
        self.pycriu = _pycriu() if use_rpc else None

    @property
    def via(self) -> str:
        return "pycriu RPC" if self.pycriu else "CLI"

    def dump(self, pid: int, images: Path, leave_running: bool, shm_files: list[str] = ()) -> None:
        """Dump the tree.  CRIU keeps only the path of a linked file, so
        shared-memory files the tree has open (/dev/shm) are copied into the
        images by a post-dump action script, while the tree is still frozen."""
        log = images / "dump.log"
        self.last_via = "pycriu RPC" if self.pycriu and not shm_files else "CLI"
        if self.pycriu and not shm_files:
            return self._rpc("dump", images, log, pid=pid, leave_running=leave_running)
        # --skip-in-flight: connections still in the listen queue (a client under load) are left
        # out of the image instead of failing the dump; those clients see their connection cut
        args = ["dump", "--tree", str(pid), "--skip-in-flight"] + (["--leave-running"] if leave_running else [])
        if shm_files:
            args += ["--action-script", str(_shm_script(images, shm_files))]
        self._cli(args, images, log)

    def restore(self, images: Path, timeout_s: float, pids: list[int], log_name: str = "restore.log",
                pidfile_name: str = "restored.pid", extra: list[str] = (), pass_fds: tuple[int, ...] = (),
                note_pids=lambda _pids: None) -> int:
        """Always through the CLI, under a deadline: a damaged image can make
        CRIU's restorer spin forever (seen with 4.2.1 on truncated pages).
        Watched like a start: a restored process stopped or killed by someone else while CRIU
        runs is noticed within seconds (CriuError, external: not the images' fault).  Either
        way, CRIU and what it restored under `pids` (only what this restore created) are killed.
        `note_pids` is told of CRIU's keeper and CRIU before anything waits on them (the intent:
        a restartkit killed meanwhile leaves them to the next command).
        `extra` and `pass_fds`: more flags, and the descriptors they name (--inherit-fd)."""
        log = images / log_name
        pidfile = images / pidfile_name
        pidfile.unlink(missing_ok=True)
        (images / EXIT_FILE).unlink(missing_ok=True)
        cmd = [self.binary, "restore", "--restore-detached", "--pidfile", str(pidfile), *extra, "-D", str(images),
               "-o", log.name, *self._common()]
        out = images / (log_name + ".out")
        # under a keeper that adopts the restored tree when CRIU leaves it (a child subreaper): the
        # restored engine's PID is free the moment it exits, for the restore after this one
        since = now_ticks()
        try:
            with open(out, "wb") as f:
                keeper_proc, criu_pid, ctl = keeper.start(subprocess.Popen, "restore", cmd, stdin=subprocess.DEVNULL,
                                                          stdout=f, stderr=f, close_fds=True, pass_fds=pass_fds,
                                                          status_file=str(images / EXIT_FILE))
        except OSError as e:
            raise CriuError(f"could not run {self.binary}: {e}") from None
        note_pids([keeper_proc.pid, criu_pid])
        try:
            reply, why = self._watch(ctl, pids, since, timeout_s)
        finally:
            ctl.close()
        if why is not None or reply is None or "exit" not in reply:
            kill_tree(keeper_proc.pid)  # CRIU, and what it half-restored under the keeper
            _kill([p for p in pids if ours(p, since)])  # what it restored and left to the keeper already
            if why is None and reply is None and ctl.closed:
                why = (f"CRIU's keeper (PID {keeper_proc.pid}) went away before CRIU was done (killed by someone "
                       "else?)")
            if why is not None:
                raise CriuError(f"{why}; CRIU and what it restored were killed", log_tail(log), external=True)
            raise CriuError(f"criu restore did not finish within {timeout_s:.0f} s; it and the half-restored "
                            "processes were killed", log_tail(log))
        if reply["exit"] != 0:
            why = _logged_error(log) or _logged_error(out)
            raise CriuError(f"criu restore failed (exit {reply['exit']})" + (f": {why}" if why else ""),
                            log_tail(log) or log_tail(out))
        return int(pidfile.read_text().strip())

    @staticmethod
    def _watch(ctl, pids: list[int], since: int, timeout_s: float) -> tuple[dict | None, str | None]:
        """CRIU's exit message from its keeper, or why the restore was given up on."""
        seam = Seam()
        deadline = seam.clock() + timeout_s
        suspicious: dict[str, float] = {}
        seen: set[int] = set()
        while True:
            safe_point()  # a cut restore: CRIU's keeper and what it restored are in the intent, killed by the cut
            reply = ctl.read(min(0.25, max(0.0, deadline - seam.clock())))
            if reply is not None or ctl.closed or seam.clock() >= deadline:
                return reply, None
            why = interference(pids, since, seen)
            if why is None:
                suspicious.clear()
            elif seam.clock() - suspicious.setdefault(why, seam.clock()) >= INTERFERED_S:
                return None, why

    def _common(self) -> list[str]:
        flags = ["--tcp-established", "--ext-unix-sk", "--file-locks", "--link-remap", "--ghost-limit", GHOST_LIMIT,
                 "--network-lock", network_lock(self.binary), "-v4"]
        return flags + (["--shell-job"] if self.shell_job else [])

    def _cli(self, args: list[str], images: Path, log: Path, timeout_s: float = 3600, pids: list[int] = (),
             pass_fds: tuple[int, ...] = ()) -> None:
        cmd = [self.binary, *args, "-D", str(images), "-o", log.name, *self._common()]
        try:
            # its own session: a signal to restartkit's process group (Ctrl-C, `kill %1`) must not
            # kill CRIU halfway through a restore; restartkit finishes the step, then exits
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, pass_fds=pass_fds,
                               start_new_session=True)
        except OSError as e:
            raise CriuError(f"could not run {self.binary}: {e}") from None
        except subprocess.TimeoutExpired:
            _kill(pids)
            raise CriuError(f"criu {args[0]} did not finish within {timeout_s:.0f} s; it and the half-restored "
                            "processes were killed", log_tail(log)) from None
        if r.returncode != 0:
            why = _full_disk(log, images) or (f": {e}" if (e := _logged_error(log) or first_error(r.stderr)) else "")
            raise CriuError(f"criu {args[0]} failed (exit {r.returncode}){why}",
                            log_tail(log) or r.stderr[-2000:])

    def _rpc(self, op: str, images: Path, log: Path, pid: int | None = None, leave_running: bool = False) -> int | None:
        pycriu = self.pycriu
        c = pycriu.criu()
        c.use_binary(self.binary)
        fd = os.open(images, os.O_DIRECTORY)
        try:
            c.opts.images_dir_fd = fd
            c.opts.log_file = log.name
            c.opts.log_level = 4
            c.opts.tcp_established = True
            c.opts.network_lock = NETWORK_LOCKS_RPC[network_lock(self.binary)]
            c.opts.ext_unix_sk = True
            c.opts.file_locks = True
            c.opts.link_remap = True
            c.opts.ghost_limit = GHOST_LIMIT_BYTES
            c.opts.shell_job = self.shell_job
            if op == "dump":
                c.opts.pid = pid
                c.opts.leave_running = leave_running
                c.opts.tcp_skip_in_flight = True
                c.dump()
                return None
            resp = c.restore()
            return int(resp.pid)
        except pycriu.CRIUException as e:
            raise CriuError(f"criu {op} (RPC) failed: {_why(e, log, images)}", log_tail(log)) from None
        finally:
            os.close(fd)


def _full_disk(log: Path, images: Path) -> str:
    """'; the disk of IMAGES is full' when CRIU's log says so (its own message is 'Error(0): Unknown')."""
    try:
        full = "No space left on device" in log.read_text(errors="replace") or "(28)" in log.read_text(errors="replace")
    except OSError:
        full = False
    if not full:
        import shutil
        try:
            full = shutil.disk_usage(images).free < 16 << 20
        except OSError:
            pass
    return (f": no space left on the disk of {images} (ENOSPC): free space there or set [criu] images_dir "
            "elsewhere") if full else ""


def _why(e, log: Path, images: Path) -> str:
    return (_full_disk(log, images) or f": {_logged_error(log) or e}").lstrip(": ")


ERROR_LINE = re.compile(r"\bError \([^)]*\):\s*(.+)")


def first_error(output: str) -> str | None:
    """CRIU's own first error line, without its source location ("sys/kernel/ns_last_pid sysctl is
    inaccessible: Read-only file system"), or None.  Its last line ("Does not look good.") and its RPC
    answer ("Error(0): Unknown") say nothing an operator can act on."""
    for line in output.splitlines():
        if m := ERROR_LINE.search(line):
            return m.group(1).strip()
    return None


def _logged_error(log: Path) -> str | None:
    try:
        return first_error(log.read_text(errors="replace"))
    except OSError:
        return None


def _kill(pids) -> None:
    import signal
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


SHM_DIR = "shm"


def _shm_script(images: Path, files: list[str]) -> Path:
    import shlex
    script = images / "save-shm.sh"
    quoted = " ".join(shlex.quote(f) for f in files)
    script.write_text(
        "#!/bin/sh\n"
        '[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\n'
        f"mkdir -p {shlex.quote(str(images / SHM_DIR))} && cp -p {quoted} {shlex.quote(str(images / SHM_DIR))}/\n"
        f"for f in /dev/shm/link_remap.*; do [ -e \"$f\" ] && cp -p \"$f\" {shlex.quote(str(images / SHM_DIR))}/; done; exit 0\n")
    script.chmod(0o700)
    return script


def put_back_shm(images: Path) -> list[str]:
    """Before a restore: the saved shared-memory files back where the tree expects them."""
    import shutil
    saved = images / SHM_DIR
    out = []
    if saved.is_dir():
        for f in saved.iterdir():
            shutil.copy2(f, Path("/dev/shm") / f.name)
            out.append(f.name)
    return out
