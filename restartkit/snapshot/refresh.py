"""`restartkit snapshot refresh`: for cron or a systemd timer.

One lock per service (a second refresh exits at once, cleanly); skip when
the current snapshot matches today's identity and is younger than max_age;
otherwise create a new one beside it (the engine keeps running), verify it,
switch `current`, keep N.  One line of output, fit for cron mail.
"""
from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_BUSY = 0, 1, 75  # 75: EX_TEMPFAIL, "try again later"


def refresh(service, facts, force: bool = False, say=print) -> int:
    """Returns the exit code; every run but a busy one updates snapshot.prom (the last refresh's outcome)."""
    from restartkit.snapshot.ops import snapshot_metrics
    rc = _refresh(service, facts, force, say)
    if rc != EXIT_BUSY:
        snapshot_metrics(service, "ok" if rc == EXIT_OK else "failed")
    return rc


def _refresh(service, facts, force: bool, say) -> int:
    # long: the refresh's steps under its own lock, each ending in the same metrics and exit code
    from restartkit.snapshot.ops import create, host_identity, mismatches, store_for
    store = store_for(service)
    store.ensure()
    lock_path = store.root / ".refresh.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        say(f"{service.policy.name}: another refresh is running (lock {lock_path}); nothing done")
        os.close(fd)
        return EXIT_BUSY
    try:
        cur = store.current()
        max_age = service.policy.criu["max_age_h"] * 3600
        if cur and cur.damaged:
            say(f"{service.policy.name}: snapshot {cur.id} is damaged ({cur.damaged}); it is kept for inspection "
                "and a new one is taken")
        if cur and not cur.damaged and not force and not cur.suspect and cur.age_s < max_age:
            miss = mismatches(cur.manifest["identity"], host_identity(service, facts))
            if not miss:
                say(f"{service.policy.name}: snapshot {cur.id} is current ({cur.age_s / 3600:.1f} h old); nothing to do")
                return EXIT_OK
            why = f"identity changed ({miss[0]})"
        else:
            why = "forced" if force else ("no snapshot" if not cur else "damaged" if cur.damaged else
                                          ("suspect" if cur.suspect else "too old"))
        criu = facts.host.criu
        if not criu.path or not criu.check_ok:  # a dump would only fail later, with less to say ("Error(0): Unknown")
            from restartkit.snapshot.criu import first_error
            said = first_error(criu.check_output or "") or (criu.check_output or criu.source or "not installed")
            say(f"{service.policy.name}: no snapshot taken ({why}): `criu check` fails: {said.strip().splitlines()[-1]}; "
                "`restartkit plan` says what to do")
            return EXIT_FAILED
        t0 = time.monotonic()
        from restartkit.snapshot.trial import test_restore, why_not

        def cannot_test(manifest) -> bool:
            problem = why_not(manifest, facts.host.criu.path, service.policy.service["host"])
            if problem:
                say(f"{service.policy.name}: note: no test restore ({problem}); inspected only")
            return bool(problem)
        test = service.policy.criu["test_restore"] and not cannot_test(None)
        # a snapshot that is to be test-restored becomes current only once it has passed
        snap = create(service, facts, leave_running=True, make_current=not test)
        verify(snap)
        tested = ""
        if test and cannot_test(snap.manifest):  # e.g. a GPU snapshot
            store.make_current(snap)
        elif test:
            try:
                result = test_restore(service, facts, snap)
            except Exception as e:  # it could not run at all: that says nothing about the snapshot
                result = {"ok": False, "error": getattr(e, "message", None) or str(e), "not_run": True}
            if not result["ok"]:
                reason = f"test restore failed: {result.get('error')}"
                if not result.get("not_run"):
                    store.mark_suspect(snap, reason)
                say(f"{service.policy.name}: new snapshot {snap.id} not made current: {reason}; "
                    f"the previous snapshot stays current")
                return EXIT_FAILED
            store.make_current(snap)
            tested = f", test-restored in {result['wall_s']:.1f} s with an identical canary"
        removed = store.prune(service.policy.criu["keep"])
        say(f"{service.policy.name}: new snapshot {snap.id} ({why}; {snap.manifest['image_bytes'] / 1e6:.0f} MB "
            f"in {time.monotonic() - t0:.1f} s{tested}; the engine served nothing for "
            f"{snap.manifest.get('freeze_s', 0):.2f} s); pruned {len(removed)}")
        return EXIT_OK
    except Exception as e:
        say(f"{service.policy.name}: refresh failed: {e}; the previous snapshot stays current")
        return EXIT_FAILED
    finally:
        os.close(fd)


def verify(snap) -> None:
    """A snapshot is usable when its core images are there and not empty."""
    files = {p.name for p in snap.path.iterdir()}
    for needed in ("inventory.img", "pstree.img"):
        if needed not in files:
            raise RuntimeError(f"snapshot {snap.id} lacks {needed}")
    if not any(n.startswith("pages-") for n in files):
        raise RuntimeError(f"snapshot {snap.id} holds no memory pages")


def install_timer(service, schedule: str, unit_dir: str = "/etc/systemd/system") -> tuple[list[Path], str]:
    """Write restartkit-refresh-<service>.service/.timer; return them and the crontab line for the same
    schedule (or, starting with '#', why cron cannot run it).  A schedule systemd refuses writes nothing."""
    from restartkit.policy.schedule import ScheduleError, check, period_s, to_cron
    from restartkit.systemd.units import cron_command, environment, exec_line, unit_dir as checked_unit_dir
    from restartkit.errors import UsageError
    if refused := check(schedule):
        raise UsageError(f"[criu] refresh: {refused}; no unit was written",
                         hint=f"fix it in {service.policy.path} (say 'daily', 'Mon..Fri 02:00', '*-*-* 04:30:00')")
    policy = os.path.abspath(service.policy.path)
    start = exec_line(["snapshot", "refresh", "--policy", policy])
    name = f"restartkit-refresh-{service.policy.name}"
    engine_unit = f"restartkit-{service.policy.name}.service"
    d = checked_unit_dir(unit_dir)
    svc = d / f"{name}.service"
    tmr = d / f"{name}.timer"
    svc.write_text(f"""[Unit]
Description=restartkit: refresh the CRIU snapshot of {service.policy.name}
# after the engine's own unit (supervise --install-unit) when both start at once, at boot say
After={engine_unit} network-online.target

[Service]
Type=oneshot
{environment(service)}ExecStart={start}
SuccessExitStatus=75
""")
    period = period_s(schedule)
    delay = "15min" if period is None or period >= 9000 else f"{int(period // 10)}s"
    tmr.write_text(f"""[Unit]
Description=restartkit: refresh the CRIU snapshot of {service.policy.name} ({schedule})

[Timer]
OnCalendar={schedule}
Persistent=true
AccuracySec=1s
# hosts on one schedule spread their dumps: up to 15 min, or a tenth of a shorter period
RandomizedDelaySec={delay}

[Install]
WantedBy=timers.target
""")
    try:
        cron = f"{to_cron(schedule)} root {cron_command(['snapshot', 'refresh', '--policy', policy])}"
    except ScheduleError as e:
        cron = f"# cron cannot run [criu] refresh = {schedule!r}: {e}; use the timer, or a schedule cron can express"
    return [svc, tmr], cron
