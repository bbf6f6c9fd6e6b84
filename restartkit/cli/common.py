"""What every command module shares: errors as one clear message, output, the service, the guard, and the
options most commands repeat."""
from __future__ import annotations

import errno
import functools
import json
import os
import sys

import click

from restartkit.errors import RestartkitError
from restartkit.options import json_option, policy_option, state_dir_option, state_root, wait_option
from restartkit.process.seam import Cut
from restartkit.record import render_record

COLOR = False if os.environ.get("NO_COLOR") else None  # https://no-color.org: any value turns colour off


def friendly(fn):
    """Our errors become one clear message and their exit code, no traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Cut as cut:  # a signal cut the command at a safe point (restartkit.process.seam)
            click.secho(f"error: {cut} at a safe point; what it had started was stopped", fg="red", err=True,
                        color=COLOR)
            click.echo("  -> the next restartkit command reconciles (`restartkit start` brings the service back)",
                       err=True)
            sys.exit(128 + cut.signum)
        except OSError as e:
            if e.errno != errno.ENAMETOOLONG:
                raise
            name = str(e.filename or "")
            click.secho(f"error: a path is too long for the filesystem ({len(os.fsencode(name))} bytes: "
                        f"{name[:60]}...)", fg="red", err=True, color=COLOR)
            click.echo("  -> a path holds at most 4095 bytes and each of its names 255: shorten it", err=True)
            sys.exit(2)
        except RestartkitError as e:
            click.secho(f"error: {e.message}", fg="red", err=True, color=COLOR)
            if e.hint:
                click.echo(f"  -> {e.hint}", err=True)
            tail = getattr(e, "log_tail", "")
            if tail:
                click.echo("  engine log (last lines):", err=True)
                click.echo("\n".join("    " + ln for ln in tail.splitlines()[-8:]), err=True)
            sys.exit(e.exit_code)
    return wrapper


def service_options(wait: bool = False, json: bool = True):
    """The options of a command on one service: --policy, --wait (`wait`), --json (`json`), --state-dir; and
    its errors made friendly.  Placed right under @click.command, so that --policy comes first in its help."""
    def decorate(fn):
        fn = state_dir_option(friendly(fn))
        if json:
            fn = json_option(fn)
        if wait:
            fn = wait_option(fn)
        return policy_option(fn)
    return decorate


def emit(data: dict, as_json: bool, text: str) -> None:
    click.echo(json.dumps(data, indent=2, default=str) if as_json else text)


def say(msg: str) -> None:
    click.echo(msg, err=True)


def quiet(_msg: str) -> None:
    """Progress under --json: stdout holds the JSON only, and stderr stays for errors."""


def progress_for(svc, as_json: bool):
    """What a command says as it works (stderr; nothing with --json), the engine's start included."""
    talk = quiet if as_json else say
    svc.engine.progress = talk
    return talk


def guarded(svc, command: str, wait_s: float = 0.0, **kw):
    """The lock, the preflight, reconciliation and the intent of a command that changes `svc`."""
    from restartkit.commands import reconcile
    return reconcile.guarded(svc, command, wait_s, say, **kw)


def load(policy_path: str, behind_front: bool | None = None):
    from restartkit.service import Service
    return Service.from_policy_file(policy_path, state_root(), behind_front=behind_front)


def restart_and_exit(policy_path, strategy: str, as_json: bool, command: str, wait_s: float, reason: str = "restart",
                     strict: bool = False, **options) -> None:
    """Run one restart, print its record, exit with the record's code."""
    from restartkit.restart import restart
    svc = load(policy_path)
    talk = progress_for(svc, as_json)
    try:
        with guarded(svc, command, wait_s):
            rec = restart(svc, strategy, reason, strict, say=talk, **options)
    except Cut as cut:  # cut at a safe point: its record says so, the exit code says by what
        if cut.record is None:
            raise
        emit(cut.record.to_dict(), as_json, render_record(cut.record.to_dict()))
        sys.exit(128 + cut.signum)
    emit(rec.to_dict(), as_json, render_record(rec.to_dict()))
    sys.exit(rec.exit_code)
