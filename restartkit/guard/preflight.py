"""The state dir is tested for writing before anything is touched: a restart that cannot write
the engine's PID, log or record must not stop a healthy engine first."""
from __future__ import annotations

import os
from pathlib import Path

from restartkit.errors import UsageError
from restartkit.guard.trust import check_trusted


KNOBS = {"state dir": "--state-dir / [service] state_dir", "snapshot images dir": "[criu] images_dir"}


def preflight_writable(directory: Path, what: str = "state dir") -> None:
    """Create `directory` if needed, check it is ours (restartkit.guard.trust) and prove a file
    can be written and removed there; a UsageError naming it otherwise (nothing touched yet)."""
    probe = directory / f".restartkit-write-test.{os.getpid()}"
    knob = KNOBS.get(what, what)
    check_trusted(directory, what, knob)
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        check_trusted(directory, what, knob)  # made by us now, or found: ours either way
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
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
                              f"or point {knob} elsewhere") from None
