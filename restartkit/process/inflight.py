"""How many requests an engine holds, kept where its supervisor can read it after the engine died: a crash
loses the requests in flight on the dead engine, and the record says how many (they are not hidden).

The engine writes its count into `inflight.PID` in the directory named by RESTARTKIT_INFLIGHT_DIR (the
service's state dir) at every request's start and end, one pwrite each; supervise reads it once the
engine is gone, and removes it.  Standard library only: the engine imports this at start-up."""
from __future__ import annotations

import os
from pathlib import Path

ENV = "RESTARTKIT_INFLIGHT_DIR"


class Counter:
    """The engine's side; a no-op when restartkit named no directory (or it cannot be written).  The file is
    opened for each write, never held: a CRIU snapshot of the engine must hold no file of the state dir."""

    def __init__(self):
        where = os.environ.get(ENV)
        self.path = os.path.join(where, f"inflight.{os.getpid()}") if where else None

    def set(self, n: int) -> None:
        if self.path is None:
            return
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            return
        try:
            os.pwrite(fd, b"%-12d" % n, 0)
        except OSError:
            pass
        finally:
            os.close(fd)


def at_death(state_dir: Path, pid: int) -> int | None:
    """The requests the engine `pid` held when it died (its file removed); None when it kept no count."""
    path = Path(state_dir) / f"inflight.{pid}"
    try:
        text = path.read_text()
    except OSError:
        return None
    _remove(path)
    try:
        return int(text.split()[0]) if text.strip() else 0
    except ValueError:
        return None


def sweep(state_dir: Path) -> None:
    """Remove the counts of engines that are gone (a restart without supervise reads none)."""
    for path in Path(state_dir).glob("inflight.*"):
        pid = path.suffix[1:]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _remove(path)


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:  # a state dir that turned read-only: the count is read, the file stays
        pass
