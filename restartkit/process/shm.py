"""Files an engine keeps in /dev/shm, and the ones a dead engine left there.

A multi-process engine shares memory between its processes through /dev/shm (vLLM's message queues,
about 420 MB on its CPU build; Python's semaphores).  Killed, it leaves them behind, and so does a
clean stop of vLLM: /dev/shm is memory, and every restart would leave more.  restartkit records the
files each engine holds once it is ready (engine.json's "shm": path and inode), and removes them when
that engine is gone: only those files, only while their inode is the recorded one (a name reused by
another file is not touched), and only when no process holds or maps them any more.

Only the standard library: the lifecycle imports this on every start.
"""
from __future__ import annotations

import os
import time

from restartkit.process.procfs import fd_targets, maps

SHM = "/dev/shm/"


def held_by(pids: list[int]) -> list[str]:
    """Files in /dev/shm the processes hold open or map, still linked."""
    found = set()
    for p in pids:
        found.update(t for t in fd_targets(p) if t.startswith(SHM))
        found.update(line.split(None, 5)[5].strip() for line in maps(p)
                     if len(line.split(None, 5)) == 6 and f" {SHM}" in line)
    return sorted(t for t in found if not t.endswith("(deleted)") and os.path.exists(t))


def describe(pids: list[int]) -> list[dict]:
    """What engine.json records: each file's path and inode."""
    out = []
    for path in held_by(pids):
        try:
            out.append({"path": path, "inode": os.stat(path).st_ino})
        except OSError:
            continue
    return out


def _holders(paths: set[str]) -> dict[str, set[int]]:
    """Which of `paths` some process still holds open or maps, and which processes."""
    used: dict[str, set[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        pid = int(d)
        for t in fd_targets(pid):
            if t in paths:
                used.setdefault(t, set()).add(pid)
        for line in maps(pid):
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].strip() in paths:
                used.setdefault(parts[5].strip(), set()).add(pid)
    return used


def _in_use(paths: set[str]) -> set[str]:
    """Which of `paths` some process still holds open or maps."""
    return set(_holders(paths))


def sweep(recorded: list[dict] | None, engine_pids: set[int] | frozenset = frozenset(), wait_s: float = 0.0) -> list[str]:
    """Remove the recorded files of an engine that is gone; returns the paths removed.  A file some process
    still holds or maps stays; for up to `wait_s` the sweep waits while those are among `engine_pids` (the
    stopped engine's own processes: a helper may still be exiting when its main process is reaped, as vLLM's
    engine core unmapping its queues last), never for another process."""
    candidates = {}
    for item in recorded or []:
        path = item.get("path") if isinstance(item, dict) else None
        if not isinstance(path, str) or not path.startswith(SHM) or "/" in path[len(SHM):]:
            continue  # only plain files directly in /dev/shm, whatever engine.json says
        try:
            if os.lstat(path).st_ino == item.get("inode"):
                candidates[path] = item["inode"]
        except OSError:
            continue
    if not candidates:
        return []
    deadline = time.monotonic() + wait_s
    held = _holders(set(candidates))
    while any(pids & engine_pids for pids in held.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
        held = _holders(set(candidates))
    removed = []
    for path in sorted(set(candidates) - set(held)):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    return removed
