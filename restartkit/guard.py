"""Guards around every command that changes a service.

- The state dir is tested for writing before anything is touched: a
  restart that cannot write the engine's PID, log or record must not stop
  a healthy engine first.
- One command at a time per service: a lock in the state dir, held for the
  whole command; the second waits (`--wait`) or exits 75 naming the holder.
- What a restart is about to do is written down first (intent.json), so
  that a restartkit killed halfway leaves enough for the next command to
  adopt what it started or to stop it (see restartkit.reconcile).
- SIGTERM, SIGHUP and SIGINT during the work only enqueue: the work runs
  to its next safe point (every phase has a deadline), then we exit.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import time
from pathlib import Path
from typing import Callable, Iterator

from restartkit.errors import RestartkitError, UsageError
from restartkit.supervise import proc_start_ticks

EXIT_BUSY = 75  # EX_TEMPFAIL: try again later
DEFERRED_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class BusyError(RestartkitError):
    exit_code = EXIT_BUSY


class Interrupted(RestartkitError):
    """A deferred signal stopped work that can be rolled back (a snapshot not yet dumped)."""

    def __init__(self, signum: int, what: str):
        super().__init__(f"interrupted by {signal.Signals(signum).name}: {what}")
        self.exit_code = 128 + signum


def check_interrupted(service, what: str) -> None:
    """At a point where the work can still be undone: stop if a termination signal came."""
    got = getattr(service, "interrupts", None)
    if got:
        raise Interrupted(got[0], what)


def preflight_writable(directory: Path, what: str = "state dir") -> None:
    """Create `directory` if needed and prove a file can be written and
    removed there; a UsageError naming it otherwise (nothing touched yet)."""
    probe = directory / f".restartkit-write-test.{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"x" * 4096)  # a full disk refuses data, not always the inode
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as e:
        raise UsageError(f"the {what} {directory} is not writable ({e.strerror or e}); nothing was touched",
                         hint="restartkit writes the engine's PID, log and restart records there before it "
                              "touches the engine: make it writable (read-only mount? `chattr -i`? disk full?) "
                              "or point --state-dir / [service] state_dir elsewhere") from None


def lock_holder(state_dir: Path) -> dict | None:
    """Who holds the service's lock now ({} when unknown), or None when it is free."""
    try:
        fd = os.open(state_dir / "lock", os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return _read_holder(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def service_lock(state_dir: Path, service: str, command: str, wait_s: float = 0.0,
                 say: Callable[[str], None] = lambda _m: None) -> Iterator[None]:
    """Hold the service's lock for the block.  The lock file says who holds it."""
    path = state_dir / "lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + max(0.0, wait_s)
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _read_holder(fd)
                who = f"PID {holder.get('pid', '?')} runs `restartkit {holder.get('command', '?')}`"
                if time.monotonic() >= deadline:
                    raise BusyError(f"busy: {who} on {service}" + (f" (waited {wait_s:.0f} s)" if wait_s else ""),
                                    hint="try again when it is done, or pass --wait SECONDS") from None
                if not told:
                    say(f"{service}: {who}; waiting up to {wait_s:.0f} s for it")
                    told = True
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "start_ticks": proc_start_ticks(os.getpid()),
                                  "command": command, "since": time.time()}).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}


@contextlib.contextmanager
def deferred_signals(say: Callable[[str], None], what: str) -> Iterator[list[int]]:
    """Termination signals during the block are noted, not acted on: the block
    finishes (each of its phases has a deadline) and the caller exits after."""
    got: list[int] = []

    def note(signum, _frame):
        if not got:
            say(f"restartkit: {signal.Signals(signum).name} received: finishing {what} first "
                "(every phase has a deadline), then exiting")
        got.append(signum)
    old = {s: signal.signal(s, note) for s in DEFERRED_SIGNALS}
    try:
        yield got
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def guarded(service, command: str, wait_s: float = 0.0, say: Callable[[str], None] = lambda _m: None,
            extra_dirs: tuple[tuple[Path, str], ...] = (), defer_signals: bool = True) -> Iterator[list[int]]:
    """Everything a command that changes a service does first: the state dir (and
    `extra_dirs`) proven writable, the service's lock, signals deferred, an
    interrupted command before it reconciled, and its own intent begun.
    Yields the list of deferred signals received (empty: none)."""
    from restartkit.reconcile import reconcile
    preflight_writable(service.state_dir)
    for directory, what in extra_dirs:
        preflight_writable(directory, what)
    with service_lock(service.state_dir, service.policy.name, command, wait_s, say):
        with (deferred_signals(say, f"`restartkit {command}`") if defer_signals else contextlib.nullcontext([])) as got:
            reconcile(service, say, recover=command != "stop")
            service.intent.begin(command, was_serving=service.current() is not None)
            service.interrupts = got
            try:
                yield got
            finally:
                service.intent.clear()
