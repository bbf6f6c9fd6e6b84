"""`restartkit reload`: a planned restart of a supervised service that returns when it is done.

systemd 252's ExecReload=kill -HUP returns at once, so `systemctl reload` said nothing of the restart
(Type=notify-reload, which waits, is systemd 253+).  This is the unit's ExecReload= instead: it sends
supervise the SIGHUP, then waits for the record of the restart that SIGHUP ran, and exits with its
outcome: 0 serving (through a recovery path too: it says so), 1 not serving or supervise gone."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from restartkit.errors import EXIT_NOT_SERVING, EXIT_SERVING, UsageError
from restartkit.process.procfs import exited
from restartkit.record import load_history

POLL_S = 0.1


def is_supervise(pid: int) -> bool:
    """`pid` runs `restartkit supervise` (a PID file or $MAINPID may be stale: never signal a stranger)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"supervise" in argv and any(b"restartkit" in a for a in argv)


def reload_record(state_dir: Path, sent_at: float) -> dict | None:
    """The record of the restart a SIGHUP sent at `sent_at` ran (None: not yet written)."""
    for rec in reversed(load_history(state_dir, 20).records):
        trigger = rec.get("trigger") or {}
        if trigger.get("what") == "SIGHUP" and (trigger.get("noticed_at") or 0) >= sent_at:
            return rec
    return None


def reload(state_dir: Path, pid: int, timeout_s: float, say) -> int:
    if not is_supervise(pid):
        raise UsageError(f"PID {pid} is not a running `restartkit supervise`",
                         hint="pass --pid with supervise's PID (a unit's ExecReload= passes $MAINPID)")
    sent_at = time.time()
    os.kill(pid, signal.SIGHUP)
    say(f"sent SIGHUP to supervise (PID {pid}); waiting for its planned restart (up to {timeout_s:.0f} s)")
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if rec := reload_record(state_dir, sent_at):
            how = rec.get("served_by") or "nothing"
            if rec.get("final_state") == "serving":
                say(f"reloaded: serving by {how}" + (" (a recovery path)" if rec.get("via_recovery") else "")
                    + f" after {rec.get('time_to_ready_s') or 0:.2f} s")
                return EXIT_SERVING
            say(f"the planned restart ended {rec.get('final_state')}; see `restartkit history`")
            return EXIT_NOT_SERVING
        if exited(pid):
            say(f"supervise (PID {pid}) exited before its planned restart was recorded")
            return EXIT_NOT_SERVING
        time.sleep(POLL_S)
    say(f"no record of the planned restart within {timeout_s:.0f} s; supervise goes on with it")
    return EXIT_NOT_SERVING
