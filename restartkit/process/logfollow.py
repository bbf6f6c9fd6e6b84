"""The engine's log, followed into supervise's stderr under systemd, so that `journalctl -u` shows the
engine's own lines beside supervise's (they stay in engine.log too: `restartkit` reads its tail into
errors).  On only where stderr is the journal ($JOURNAL_STREAM): on a terminal they would interleave
with supervise's progress."""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

POLL_S = 0.25
CHUNK = 1 << 16


def wanted(env=os.environ) -> bool:
    return bool(env.get("JOURNAL_STREAM"))


class LogFollower:
    """A thread that copies what is appended to `path` (a new file at the same path too: a start after a
    rotation) to `out`, line by line, each prefixed `prefix`; it starts at the file's end, so an old
    engine's lines are not replayed."""

    def __init__(self, path: Path, prefix: str = "engine: ", out=None):
        self.path, self.prefix, self.out = path, prefix, out or sys.stderr
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-log", daemon=True)
        self._ino, self._pos, self._partial = None, 0, b""
        self._seek_end()

    def start(self) -> "LogFollower":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._copy()  # the last lines the engine wrote before it stopped

    def _seek_end(self) -> None:
        try:
            st = os.stat(self.path)
            self._ino, self._pos = st.st_ino, st.st_size
        except OSError:
            self._ino, self._pos = None, 0

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self._copy()

    def _copy(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return
        try:
            st = os.fstat(fd)
            if st.st_ino != self._ino or st.st_size < self._pos:  # replaced or truncated: from its start
                self._ino, self._pos, self._partial = st.st_ino, 0, b""
            while data := os.pread(fd, CHUNK, self._pos):
                self._pos += len(data)
                *lines, self._partial = (self._partial + data).split(b"\n")
                for line in lines:
                    self._write(line)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _write(self, line: bytes) -> None:
        try:
            self.out.write(self.prefix + line.decode(errors="replace").rstrip("\r") + "\n")
            self.out.flush()
        except (OSError, ValueError):  # stderr closed: nothing to tell
            pass
