"""intent.json: what the command holding a service's lock is doing now (see restartkit.guard.lock),
read back by restartkit.commands.reconcile when that command died."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from restartkit.files import write_json_atomic
from restartkit.process.procfs import holder_alive, proc_start_ticks


class Intent:
    """intent.json: what the command holding the lock is doing now.  Written
    before each step that starts or changes an engine; removed when the
    command ends.  Found while holding the lock, it is a command that died."""

    def __init__(self, state_dir: Path):
        self.path = state_dir / "intent.json"
        self.data: dict = {}
        self.best_effort = False  # a stop on a full state dir goes on without it (it starts nothing to reconcile)

    def begin(self, command: str, **info) -> None:
        self.data = {"command": command, "pid": os.getpid(), "start_ticks": proc_start_ticks(os.getpid()),
                     "started_at": time.time(), "pids": [], **info}
        self._write()

    def update(self, **info) -> None:
        if not self.data:
            return
        pids = info.pop("pids", None)
        if pids:
            self.data["pids"] = sorted(set(self.data["pids"]) | set(pids))
        self.data.update(info)
        self._write()

    def clear(self) -> None:
        self.data = {}
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            if not self.best_effort:
                raise

    def _write(self) -> None:
        try:
            write_json_atomic(self.path, self.data, indent=None)
        except OSError:
            if not self.best_effort:
                raise

    def read_stale(self) -> dict | None:
        """The intent of a command that is gone (None when there is none, or its writer still runs)."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return None if holder_alive(data) and data.get("pid") != os.getpid() else data
