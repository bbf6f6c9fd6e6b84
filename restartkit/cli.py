"""The `restartkit` command.  Thin: logic lives in the library.  Nothing
heavy (torch) is imported until a command needs it."""
from __future__ import annotations

import errno
import functools
import json
import os
import sys

import click

from restartkit import __version__
from restartkit.errors import EXIT_NOT_SERVING, EXIT_SERVING, RestartkitError
from restartkit.process.seam import Cut
from restartkit.record import render_record
from restartkit.options import (Seconds, json_option, policy_option, reason_option, state_dir_option, state_root,
                                strategy_option, unit_dir_option, wait_option)
from restartkit.contracts import STRATEGY_NAMES, STRATEGY_SUMMARIES


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
    from restartkit.commands.reconcile import guarded as guard
    return guard(svc, command, wait_s, say, **kw)


def load(policy_path: str):
    from restartkit.service import Service
    return Service.from_policy_file(policy_path, state_root())


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="restartkit")
def main():
    """Bring an LLM inference engine back fast after a restart, and prove which path it took."""


main.help = (main.help + "\n\n\b\nStrategies (auto tries them fastest first, by evidence):\n"
             + "\n".join(f"  {name:<9} {STRATEGY_SUMMARIES[name]}" for name in STRATEGY_NAMES)
             + "\n\n\b\nExamples:\n  restartkit demo\n  restartkit plan --policy llm.toml\n"
               "  restartkit restart --policy llm.toml --strategy auto")


# ---- host and policy --------------------------------------------------------------

@main.command()
@json_option
@state_dir_option
@click.option("--criu-path", default="", help="CRIU binary to report on (default: the usual lookup).")
@friendly
def facts(as_json, criu_path):
    """What this host can do: arch, kernel, GPUs, CRIU, io_uring, memory, disk.

    \b
    Examples:
      restartkit facts
      restartkit facts --json | jq .criu"""
    from restartkit import facts as hf
    f = hf.gather(state_root(), criu_path)
    gpus = "; ".join(f"{g.index}: {g.name} {g.uuid} {g.memory_total_bytes / 2**30:.0f} GiB" for g in f.gpus) or f"none ({f.nvml_error})"
    c = f.criu
    text = "\n".join([
        f"arch            {f.arch}", f"kernel          {f.kernel}",
        f"user            {f.user} (uid {f.uid}; root: {f.is_root}; passwordless sudo: {f.passwordless_sudo})",
        f"gpus            {gpus}", f"driver          {f.driver_version or '-'}",
        f"io_uring        kernel.io_uring_disabled = {f.io_uring_disabled}",
        f"criu            {c.path or '-'} ({c.source}) version {c.version or '-'}; check: {'ok' if c.check_ok else 'FAILS: ' + (c.check_output.splitlines() or ['-'])[-1] if c.path else '-'}",
        f"memory          {f.mem_available_bytes / 2**30:.1f} GiB available of {f.mem_total_bytes / 2**30:.1f} GiB",
        f"state dir       {f.state_dir} ({f.state_dir_free_bytes / 2**30:.1f} GiB free)",
    ])
    emit(f.to_dict(), as_json, text)


@main.group()
def policy():
    """Policy files."""


@policy.command("check")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--skip-host", is_flag=True,
              help="Check the file only, not whether this host fits it (a policy written for another machine).")
@json_option
@friendly
def policy_check(file, skip_host, as_json):
    """Check a policy file; print it with every default filled in, and warn about every strategy it asks
    for that its other keys rule out (naming the key to change).  Then check this host as `start` will
    (the model directory, the device, CRIU where the policy lists it): exit 2 if start would refuse.

    \b
    Examples:
      restartkit policy check llm.toml
      restartkit policy check llm.toml --json | jq .service
      restartkit policy check gpu-node.toml --skip-host       # on a laptop, for a GPU node"""
    from restartkit.commands.combinations import host_warnings, warnings
    from restartkit.engines import get_adapter
    from restartkit.policy import load_policy
    from restartkit.process.lifecycle import unfit
    p = load_policy(file)
    found = warnings(p) + ([] if skip_host else host_warnings(p))
    for w in found:
        click.echo(f"warning: {w}", err=True)
    adapter, _ = get_adapter(p.service["engine"])
    errors = [] if skip_host else [{"error": problem, "fix": fix} for problem, fix in unfit(p, adapter)]
    for e in errors:
        click.secho(f"error: {e['error']}", fg="red", err=True, color=COLOR)
        click.echo(f"  -> {e['fix']}", err=True)
    emit({**p.to_dict(), "warnings": found, "errors": errors}, as_json,
         f"{file}: {'does not fit this host' if errors else 'ok'} (service {p.name}, engine "
         f"{p.service['engine']}, strategies {', '.join(p.strategies)})"
         + (f"; {len(errors)} error{'s' if len(errors) > 1 else ''} above: `restartkit start` would refuse it"
            if errors else "")
         + (f"; {len(found)} warning{'s' if len(found) > 1 else ''} above" if found else ""))
    if errors:
        sys.exit(2)


# ---- planning and restarting --------------------------------------------------------

@main.command()
@policy_option
@strategy_option
@reason_option
@json_option
@state_dir_option
@friendly
def plan(policy_path, strategy, reason, as_json):
    """Dry run: every strategy, eligible or not, with every reason.

    \b
    Examples:
      restartkit plan --policy llm.toml                       # what `restart` would do now, and why
      restartkit plan --policy llm.toml --reason crash --json # what supervise would do after a crash"""
    from restartkit.planner import render_plan
    from restartkit.restart import plan_for
    p, _facts = plan_for(load(policy_path), strategy, reason)
    emit(p.to_dict(), as_json, render_plan(p))


@main.command()
@policy_option
@strategy_option
@reason_option
@click.option("--strict", is_flag=True, help="Exit 3 when the service came back only through a recovery path.")
@click.option("--overlap/--no-overlap", default=None,
              help="ipc: prepare the new engine while the old one serves.  [default: [restart] overlap]")
@click.option("--measure-downtime", is_flag=True, help="Hammer the service during the restart; record the longest gap.")
@wait_option
@json_option
@state_dir_option
@friendly
def restart(policy_path, strategy, reason, strict, overlap, measure_downtime, wait_s, as_json):
    """Restart a service: plan, run the chosen strategy, prove it, recover on failure.

    A strategy named with --strategy that cannot run now (or an --overlap that does not apply) is refused
    before anything is touched: exit 2, every reason, and what would make it run.  --strict: exit 3 when
    the named strategy failed midway and only its recovery path served.  A SIGTERM or Ctrl-C ends it at its
    next safe point (what it started is stopped; the next command reconciles) and exits 128+N.

    \b
    Examples:
      restartkit restart --policy llm.toml                          # auto: the fastest eligible, proven
      restartkit restart --policy llm.toml --strategy ipc --strict  # exit 3 if only a cold start served
      restartkit restart --policy llm.toml --measure-downtime --json"""
    restart_and_exit(policy_path, strategy, as_json, "restart", wait_s, reason=reason, strict=strict, overlap=overlap,
                     measure_downtime=measure_downtime, refuse_ineligible=True)


def restart_and_exit(policy_path, strategy: str, as_json: bool, command: str, wait_s: float, reason: str = "restart",
                     strict: bool = False, **options) -> None:
    """Run one restart, print its record, exit with the record's code."""
    from restartkit.restart import restart as do_restart
    svc = load(policy_path)
    talk = progress_for(svc, as_json)
    try:
        with guarded(svc, command, wait_s):
            rec = do_restart(svc, strategy, reason, strict, say=talk, **options)
    except Cut as cut:  # cut at a safe point: its record says so, the exit code says by what
        if cut.record is None:
            raise
        emit(cut.record.to_dict(), as_json, render_record(cut.record.to_dict()))
        sys.exit(128 + cut.signum)
    emit(rec.to_dict(), as_json, render_record(rec.to_dict()))
    sys.exit(rec.exit_code)


@main.command()
@policy_option
@wait_option
@json_option
@state_dir_option
@friendly
def start(policy_path, wait_s, as_json):
    """Start the service's engine (a cold start) and wait until it answers.

    \b
    Examples:
      restartkit start --policy llm.toml
      restartkit start --policy llm.toml --wait 60 --json"""
    from restartkit.guard.deferred import cut_short
    svc = load(policy_path)
    progress_for(svc, as_json)
    with guarded(svc, "start", wait_s):
        if (proc := svc.current()) is not None:
            emit({"state": "running", "pid": proc.pid}, as_json, f"{svc.policy.name} already runs (PID {proc.pid})")
            return
        with cut_short(svc):  # a SIGTERM while it starts: the engine it started is stopped, the command exits
            started = svc.engine.start("cold")
            svc.canary()
    readiness = {"signalled": started.process.ready_signalled, "probes": started.process.probes}
    emit({"state": "serving", "pid": started.process.pid, "ready_s": started.ready_s, "phases": started.engine_phases,
          "readiness": readiness},
         as_json, f"{svc.policy.name} serving (PID {started.process.pid}) after {started.ready_s:.2f} s; log: {svc.engine.log_path}")


@main.command()
@policy_option
@wait_option
@json_option
@state_dir_option
@friendly
def stop(policy_path, wait_s, as_json):
    """Stop the service's engine: SIGTERM, wait, SIGKILL.  Under `restartkit supervise`, through the
    supervisor (which stops the engine and exits), so that the stop is not taken for a crash.

    \b
    Examples:
      restartkit stop --policy llm.toml
      restartkit stop --policy llm.toml --wait 30"""
    from restartkit.commands.supervise import stop_supervisor
    from restartkit.errors import EngineStartError
    svc = load(policy_path)
    r = svc.policy.restart
    try:
        sup = stop_supervisor(svc.state_dir, r["stop_timeout_s"] + 30, say)
    except RuntimeError as e:
        raise EngineStartError(str(e), hint="look at the supervisor's log (journalctl -u restartkit-...), or kill it") from None
    from restartkit.standby.armed import disarm
    with guarded(svc, "stop", wait_s, writes=False):  # what an operator reaches for on a full disk
        how = svc.engine.stop() if svc.current() is not None or sup is None else "stopped by its supervisor"
        if (sb := disarm(svc)) is not None:
            how += f"; its standby (PID {sb}) stopped"
    emit({"state": "stopped", "how": how, "supervisor": sup["pid"] if sup else None}, as_json, f"{svc.policy.name}: {how}")


@main.command()
@policy_option
@json_option
@state_dir_option
@friendly
def status(policy_path, as_json):
    """Is the engine running, and does it answer a real completion?  It only looks: it never starts or
    stops a process, so a probe or a monitoring script may call it.  What it finds that needs acting on (an
    interrupted restart, the engines it left) comes with the command that does it.  Exit 0: serving; 1: not.

    \b
    Examples:
      restartkit status --policy llm.toml
      restartkit status --policy llm.toml --json | jq .serving
      restartkit status --policy llm.toml >/dev/null || alert   # a probe: exit 0 only while it serves"""
    from restartkit.record import read_history
    svc = load(policy_path)
    proc = svc.current()
    ready = proc is not None and svc.is_ready()
    from restartkit.commands.supervise import read_state
    last = read_history(svc.state_dir, last=1)
    sup = read_state(svc.state_dir)
    from restartkit.standby.armed import state as standby_state
    sb = standby_state(svc)
    data = {"service": svc.policy.name, "running": proc is not None, "pid": proc.pid if proc else None,
            "serving": ready, "last_restart": last[0] if last else None, "state_dir": str(svc.state_dir),
            "supervisor": sup, "standby": sb}
    text = f"{svc.policy.name}: " + ("serving" if ready else "running, not answering" if proc else "not running")
    if proc:
        text += f" (PID {proc.pid})"
    if last:
        text += f"; last restart: {last[0]['final_state']}" + (f" by {last[0]['served_by']}" if last[0].get("served_by")
                                                             else "")
    if sup:
        import time as _time
        text += (f"\nsupervised by PID {sup['pid']} (up {_time.time() - sup['started_at']:.0f} s; "
                 f"{sup['failures_in_interval']} failure(s) in the last {sup['interval_s']:.0f} s")
        if sup.get("restarts"):
            r = sup["restarts"][-1]
            text += (f"; last restart ({r['reason']}): {r['final_state']}"
                     + (f" by {r['served_by']} in {r['time_to_ready_s']} s" if r.get("served_by") else "")
                     + (f", {r['noticed_to_serving_s']} s after it was noticed"
                        if r.get("noticed_to_serving_s") is not None else ""))
        text += ")"
    if sb:
        text += f"\nstandby: PID {sb['pid']}, {sb['state']}" + (
            f" ({sb['rss_bytes'] / 1e6:.0f} MB resident)" if sb.get("rss_bytes") else "")
    data["interrupted"] = _interrupted(svc)
    if (cut := data["interrupted"]) is not None:
        left = ", ".join(f"PID {p}" for p in cut["engines_left"]) or "no engine"
        text += (f"\ninterrupted: `restartkit {cut['command']}` (PID {cut['pid']}) ended halfway and left {left}; "
                 "the next command that may act finishes it (adopts what answers, stops the rest, starts it cold "
                 "where it was to serve)")
    if not ready or cut is not None:
        data["next"] = _bring_back(svc, proc, sup, cut)
        text += f"\nnext: {data['next']}"
    emit(data, as_json, text)
    sys.exit(EXIT_SERVING if ready else EXIT_NOT_SERVING)


def _interrupted(svc) -> dict | None:
    """A command that died holding the service (its intent left behind), and the engines it left: read only."""
    from restartkit.commands.reconcile import candidates
    from restartkit.guard.intent import Intent
    stale = Intent(svc.state_dir).read_stale()
    if stale is None:
        return None
    return {"command": stale.get("command"), "pid": stale.get("pid"), "started_at": stale.get("started_at"),
            "engines_left": candidates(svc, stale)}


def _bring_back(svc, proc, sup, cut: dict | None = None) -> str:
    """The command that brings a service that does not serve back, or finishes an interrupted one (status
    says it; it runs nothing itself)."""
    policy = svc.policy.path
    if sup and sup.get("pid") and _alive(sup["pid"]):
        return f"supervise (PID {sup['pid']}) brings it back by itself"
    if cut is not None:
        return (f"restartkit start --policy {policy} (finishes the interrupted `restartkit {cut['command']}`"
                + (", then finds it running)" if proc is not None else ")"))
    if proc is not None:
        return f"restartkit restart --policy {policy} (it runs but does not answer)"
    return (f"restartkit start --policy {policy}, or restartkit supervise --policy {policy} to keep it serving "
            "across crashes")


def _alive(pid: int) -> bool:
    from restartkit.process.procfs import exited
    return not exited(pid)


@main.command()
@policy_option
@click.option("--install-unit", is_flag=True, help="Write a systemd unit (Type=notify) that runs this, and exit.")
@unit_dir_option
@click.option("--watchdog-sec", type=click.IntRange(min=0, max=86400), default=0, show_default=True,
              help="With --install-unit: WatchdogSec= of the unit (0: none).")
@click.option("--user", "unit_user", default=None, metavar="NAME",
              help="With --install-unit: User= of the unit (policies without CRIU; the state root is pinned).")
@state_dir_option
@friendly
def supervise(policy_path, install_unit, unit_dir, watchdog_sec, unit_user):
    """Run the engine in the foreground and bring it back on a crash or a hang (auto, reason crash).

    SIGTERM/SIGINT end a start or restart at its next safe point, stop the engine and exit 0; SIGHUP
    restarts it (reason restart).  Too many failures within [supervise] start_limit_interval_s: the
    engine is left stopped and this exits 1.

    \b
    Examples:
      restartkit supervise --policy llm.toml
      restartkit preload --policy llm.toml --install-unit        # the weight cache's unit first
      restartkit supervise --policy llm.toml --install-unit --watchdog-sec 60
      systemctl daemon-reload && systemctl enable --now restartkit-wc-llm restartkit-llm.socket restartkit-llm"""
    from restartkit.commands.supervise import Supervisor
    from restartkit.systemd.units import supervise_units
    svc = load(policy_path)
    if install_unit:
        sock, path = supervise_units(svc, unit_dir, watchdog_sec, unit_user)
        click.echo(f"wrote {sock}\nwrote {path}")
        click.echo(f"enable them: systemctl daemon-reload && systemctl enable --now {sock.name} {path.name}")
        click.echo(f"({sock.name} holds port {svc.policy.service['port']}: it stays open across every engine "
                   "restart and a restart of supervise itself)")
        if unit_user:
            from restartkit.systemd.units import state_root_for
            root = state_root_for(svc, unit_user)
            click.echo(f"run restartkit for this service as {unit_user}, on its state root (sudo -u {unit_user} "
                       f"restartkit status --state-dir {root} --policy {svc.policy.path})")
        return
    svc.engine.progress = say
    sys.exit(Supervisor(svc, say=say).run())


@main.command()
@policy_option
@click.option("--pid", type=click.IntRange(min=1), required=True, help="supervise's PID (a unit passes $MAINPID).")
@click.option("--timeout", "timeout_s", type=Seconds(1), default=None,
              help="Seconds to wait for the restart's record.  [default: the policy's stop and start timeouts + 60]")
@state_dir_option
@friendly
def reload(policy_path, pid, timeout_s):
    """A planned restart of a supervised service (SIGHUP) that returns when it is done, with its outcome.

    The unit's ExecReload=, so that `systemctl reload` waits for the restart and shows how it ended.

    \b
    Examples:
      restartkit reload --policy llm.toml --pid "$(systemctl show -p MainPID --value restartkit-llm)"
      systemctl reload restartkit-llm     # runs the line above"""
    from restartkit.commands.reload import reload as run_reload
    svc = load(policy_path)
    r = svc.policy.restart
    sys.exit(run_reload(svc.state_dir, pid, timeout_s or r["stop_timeout_s"] + r["start_timeout_s"] + 60, say))


@main.command()
@policy_option
@click.option("--last", type=click.IntRange(min=0), default=10, show_default=True, help="0: all.")
@json_option
@state_dir_option
@friendly
def history(policy_path, last, as_json):
    """The last restart records of a service.

    \b
    Examples:
      restartkit history --policy llm.toml
      restartkit history --policy llm.toml --last 0 --json"""
    from restartkit.record import load_history
    svc = load(policy_path)
    got = load_history(svc.state_dir, last)
    text = "\n".join(render_record(r) for r in got.records) or "no restarts recorded"
    if note := got.note():
        text += f"\n({note})"
    emit({"records": got.records, "skipped": got.skipped, "problem": got.problem}, as_json, text)


# ---- the weight cache ------------------------------------------------------------------

@main.command()
@click.option("--policy", "policy_path", envvar="RESTARTKIT_POLICY", type=click.Path(dir_okay=False), default=None,
              help="Take the layout from a policy; flags below override it.")
@click.option("--model", default=None)
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), default=None)
@click.option("--data-parallel-size", type=click.IntRange(min=1), default=None)
@click.option("--data-parallel-start-rank", type=click.IntRange(min=0), default=None)
@click.option("--enable-expert-parallel", is_flag=True, default=None)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None)
@click.option("--quantization", type=click.Choice(["none", "int8"]), default=None)
@click.option("--nnodes", type=click.IntRange(min=1), default=None)
@click.option("--node-rank", type=click.IntRange(min=0), default=None)
@click.option("--master-addr", default=None)
@click.option("--weight-cache-master-port", type=click.IntRange(1, 65535), default=None)
@click.option("--draft-model", default=None)
@click.option("--health-port", type=click.IntRange(0, 65535), default=None)
@click.option("--health-host", default=None, help="Default 127.0.0.1: never exposed unless you say so.")
@click.option("--socket-dir", default=None)
@click.option("--startup-timeout", type=Seconds(0.1), default=None,
              help="Seconds for every local rank to be ready.")
@click.option("--detach", is_flag=True, help="Run the launcher in the background; return once every rank is ready.")
@click.option("--wait-ready", is_flag=True, help="Start nothing: wait until a running weight cache is ready.")
@click.option("--install-unit", is_flag=True, help="Write a systemd unit for the weight cache (before the engine's), and exit.")
@unit_dir_option
@click.option("--user", "unit_user", default=None, metavar="NAME", help="With --install-unit: User= of the unit.")
@state_dir_option
@friendly
def preload(policy_path, detach, wait_ready, install_unit, unit_dir, unit_user, **flags):
    """Start the weight-cache daemons (one per local device) and keep them running.

    \b
    Examples:
      restartkit preload --policy llm.toml                 # foreground (a unit's, a container's)
      restartkit preload --policy llm.toml --detach        # returns once every rank holds the weights
      restartkit preload --policy llm.toml --install-unit  # restartkit-wc-llm.service, before restartkit-llm"""
    if install_unit:
        from restartkit.systemd.units import weight_cache_unit
        from restartkit.errors import UsageError
        if not policy_path:
            raise UsageError("--install-unit needs --policy: the unit runs the weight cache of a service")
        path = weight_cache_unit(load(policy_path), unit_dir, unit_user)
        click.echo(f"wrote {path}")
        click.echo(f"enable it: systemctl daemon-reload && systemctl enable --now {path.name}; then install "
                   "the engine's unit (supervise --install-unit), which orders itself after this one")
        return
    from restartkit.weightcache.prelaunch import preload_command
    sys.exit(preload_command(policy_path, flags, detach=detach, wait_ready=wait_ready, say=click.echo,
                             state_root=state_root()))


@main.command()
@policy_option
@wait_option
@json_option
@state_dir_option
@friendly
def rollout(policy_path, wait_s, as_json):
    """Put a service on its weight cache: cache first, then an ipc restart with fallback off, then the policy's own.

    \b
    Examples:
      restartkit rollout --policy llm.toml
      restartkit rollout --policy llm.toml --json"""
    from restartkit.commands.rollout import rollout as do_rollout
    svc = load(policy_path)
    with guarded(svc, "rollout", wait_s):
        recs = do_rollout(svc, say)
    emit({"records": [r.to_dict() for r in recs]}, as_json, "\n".join(render_record(r.to_dict()) for r in recs))
    last = recs[-1]
    sys.exit(last.exit_code if len(recs) == 2 else max(last.exit_code, 1))


@main.group()
def standby():
    """The standby engine: armed on the weight cache, promoted on a crash or a restart ([standby])."""


@standby.command("arm")
@policy_option
@wait_option
@json_option
@state_dir_option
@friendly
def standby_arm(policy_path, wait_s, as_json):
    """Start a standby engine (a standby already armed is replaced) and wait until it is prepared.

    \b
    Examples:
      restartkit standby arm --policy llm.toml"""
    from restartkit.standby.armed import arm_prepared
    svc = load(policy_path)
    with guarded(svc, "standby arm", wait_s):
        st = arm_prepared(svc, say)
    emit(st, as_json, f"{svc.policy.name}: standby PID {st['pid']} armed in {st.get('prepare_s')} s "
                      f"({(st.get('rss_bytes') or 0) / 1e6:.0f} MB resident; not listening on the service's port)")


@standby.command("status")
@policy_option
@json_option
@state_dir_option
@friendly
def standby_status(policy_path, as_json):
    """The standby engine, if one is armed: PID, state, memory, and whether it can be promoted (exit 0 only then).

    \b
    Examples:
      restartkit standby status --policy llm.toml --json"""
    from restartkit.standby.armed import frozen, stale, state
    svc = load(policy_path)
    st = state(svc)
    if st is not None and st["state"] == "prepared":
        st["why_not_promotable"] = frozen(st) or stale(svc, st)
        st["promotable"] = st["why_not_promotable"] is None
    text = "no standby" if st is None else f"standby PID {st['pid']}: {st['state']}" + (
        f" (cannot be promoted: {st['why_not_promotable']})" if st.get("why_not_promotable") else "")
    emit(st or {}, as_json, text)
    sys.exit(0 if st and st.get("promotable") else 1)


@standby.command("disarm")
@policy_option
@wait_option
@state_dir_option
@friendly
def standby_disarm(policy_path, wait_s):
    """Stop the standby engine.

    \b
    Examples:
      restartkit standby disarm --policy llm.toml"""
    from restartkit.standby.armed import disarm
    svc = load(policy_path)
    with guarded(svc, "standby disarm", wait_s):
        pid = disarm(svc)
    click.echo("no standby" if pid is None else f"standby PID {pid} stopped")


@main.group()
def weightcache():
    """Ask or tell the weight-cache daemons of a service."""


@weightcache.command("status")
@policy_option
@json_option
@state_dir_option
@friendly
def weightcache_status(policy_path, as_json):
    """Each rank's daemon: state, fingerprint, bytes, attached engines.

    \b
    Examples:
      restartkit weightcache status --policy llm.toml
      restartkit weightcache status --policy llm.toml --json"""
    from restartkit.weightcache.client import daemon_stats
    stats = daemon_stats(load(policy_path).policy)
    text = "\n".join(f"{d['device_uuid']}{' (draft)' if d.get('draft') else ''}: {d.get('state')}"
                     + (f", {d.get('tensors')} tensors, {d.get('nbytes', 0) / 1e9:.3f} GB, attached {d.get('attached')}"
                        if d.get("state") == "ready" else f" ({d['error']})" if d.get("error") else "") for d in stats)
    emit({"daemons": stats}, as_json, text)
    sys.exit(EXIT_SERVING if all(d.get("state") == "ready" for d in stats) else EXIT_NOT_SERVING)


@weightcache.command("release")
@policy_option
@click.option("--force", is_flag=True, help="Release even while zero_copy engines map the weights.")
@click.option("--stop", "stop_daemons", is_flag=True, help="Stop the daemons instead of only freeing their memory.")
@json_option
@state_dir_option
@friendly
def weightcache_release(policy_path, force, stop_daemons, as_json):
    """Free the daemons' memory (or stop them); refused while zero_copy engines are attached.

    \b
    Examples:
      restartkit weightcache release --policy llm.toml
      restartkit weightcache release --policy llm.toml --stop"""
    from restartkit.weightcache.client import send_all
    replies = send_all(load(policy_path).policy, "stop" if stop_daemons else "release", force)
    emit({"replies": replies}, as_json, "\n".join(f"{r['device_uuid']}: {'ok' if r.get('ok') else r.get('message') or r.get('error')}" for r in replies))
    sys.exit(EXIT_SERVING if all(r.get("ok") for r in replies) else EXIT_NOT_SERVING)


# ---- sleep mode ----------------------------------------------------------------------

@main.command("sleep")
@policy_option
@click.option("--level", type=click.IntRange(1, 2), default=None, help="Default: [sleep] level.")
@wait_option
@json_option
@state_dir_option
@friendly
def sleep_cmd(policy_path, level, wait_s, as_json):
    """Put the engine to sleep: park (1) or drop (2) its weights, free its KV cache.

    \b
    Examples:
      restartkit sleep --policy llm.toml --level 1
      restartkit sleep --policy llm.toml --level 2 --json"""
    svc = load(policy_path)
    with guarded(svc, "sleep", wait_s):
        cycle = _sleep(svc, level)
    p = cycle.proof
    data = {**p["sleep_answer"], **{k: v for k, v in p.items() if k != "sleep_answer"}, "is_sleeping": True}
    freed = p.get("freed_bytes") or 0
    emit(data, as_json, f"{svc.policy.name} asleep at level {cycle.level}; the engine freed {freed / 1e6:.1f} MB "
         f"({'device memory' if cycle.device == 'cuda' else 'resident memory'})")


def _sleep(svc, level):
    from restartkit.errors import EngineStartError, StrategyError
    from restartkit.engines.sleepcycle import Cycle, SleepCycleError
    proc = svc.current()
    if proc is None:
        raise EngineStartError(f"{svc.policy.name} is not running", hint=f"restartkit start --policy {svc.policy.path}")
    state = svc.adapter.sleep_state(svc.policy, proc.pid)
    if not state.get("enabled"):
        raise StrategyError(f"{svc.policy.name} cannot sleep: {state.get('why')}")
    if state.get("asleep"):
        raise StrategyError(f"{svc.policy.name} is already asleep", hint=f"restartkit wake --policy {svc.policy.path}")
    cycle = Cycle(svc, proc.pid, level or svc.policy.sleep["level"])
    try:
        cycle.sleep()
    except SleepCycleError as e:
        raise StrategyError(e.message, hint=f"the engine may be half asleep: restartkit wake --policy {svc.policy.path} "
                                            "wakes it (or recovers with a cold start)") from None
    return cycle


@main.command("wake")
@policy_option
@wait_option
@json_option
@state_dir_option
@friendly
def wake_cmd(policy_path, wait_s, as_json):
    """Wake a sleeping engine, prove it by the canary; on failure, recover with a cold start.

    \b
    Examples:
      restartkit wake --policy llm.toml"""
    restart_and_exit(policy_path, "sleep", as_json, "wake", wait_s)


# ---- snapshots -----------------------------------------------------------------------

@main.group()
def snapshot():
    """CRIU snapshots of a running engine (the criu strategy)."""


def _snapshot_context(policy_path_or_service):
    from restartkit.restart import gather_facts
    svc = load(policy_path_or_service) if isinstance(policy_path_or_service, str) else policy_path_or_service
    return svc, gather_facts(svc, "restart")


def _require_snapshot_prereqs(svc, facts):
    from restartkit.errors import StrategyError
    from restartkit.restart import snapshot_problems
    if reasons := snapshot_problems(facts, svc.policy):
        raise StrategyError("a snapshot cannot be taken here: " + "; ".join(reasons))


@snapshot.command("create")
@policy_option
@click.option("--stop", "stop_engine", is_flag=True, help="Let the engine die with the dump (default: it keeps running).")
@wait_option
@json_option
@state_dir_option
@friendly
def snapshot_create(policy_path, stop_engine, wait_s, as_json):
    """Snapshot the running engine (KV cache dropped first, put back after).

    \b
    Examples:
      restartkit snapshot create --policy llm.toml
      restartkit snapshot create --policy llm.toml --json   # its size, how long the engine was paused"""
    from restartkit.snapshot.ops import create, snapshot_metrics, store_for
    svc = load(policy_path)
    with guarded(svc, "snapshot create", wait_s, extra_dirs=((store_for(svc).root, "snapshot images dir"),)):
        svc, facts = _snapshot_context(svc)
        _require_snapshot_prereqs(svc, facts)
        snap = create(svc, facts, leave_running=not stop_engine, progress=say)
        snapshot_metrics(svc)
    emit({"id": snap.id, "path": str(snap.path), **snap.manifest}, as_json,
         f"snapshot {snap.id} ({snap.manifest['image_bytes'] / 1e6:.1f} MB"
         + (", without the weights: restores through criu+ipc" if snap.manifest.get("kind") == "weightless" else "")
         + ") is current; engine " + ("stopped" if stop_engine else "still serving"))


@snapshot.command("restore")
@policy_option
@wait_option
@json_option
@state_dir_option
@friendly
def snapshot_restore(policy_path, wait_s, as_json):
    """Restore the current snapshot as the engine: criu (criu+ipc for a weights-less one), with its recovery path.

    \b
    Examples:
      restartkit snapshot restore --policy llm.toml"""
    from restartkit.snapshot.ops import store_for
    cur = store_for(load(policy_path)).current()
    strategy = "criu+ipc" if cur is not None and cur.manifest.get("kind") == "weightless" else "criu"
    # strict: a restore that only a recovery (a cold start) served exits 3, not 0
    restart_and_exit(policy_path, strategy, as_json, "snapshot restore", wait_s, strict=True)


@snapshot.command("list")
@policy_option
@json_option
@state_dir_option
@friendly
def snapshot_list(policy_path, as_json):
    """Snapshots on disk, newest last; * marks current.

    \b
    Examples:
      restartkit snapshot list --policy llm.toml
      restartkit snapshot list --policy llm.toml --json"""
    from restartkit.snapshot.ops import store_for
    store = store_for(load(policy_path))
    cur = store.current()
    snaps = store.list()
    rows = [{"id": s.id, "kind": s.manifest.get("kind") or "full",
             "current": cur is not None and s.id == cur.id,
             "age_h": round(s.age_s / 3600, 2) if not s.damaged and not s.suspect else None,
             "image_bytes": s.manifest.get("image_bytes"), "suspect": s.suspect,
             "tested": (s.manifest.get("tested") or {}).get("ok"), "damaged": s.damaged} for s in snaps]
    text = "\n".join(f"{'*' if r['current'] else ' '} {r['id']}  {r['kind']:<10} {r['age_h'] if r['age_h'] is not None else '?':>6} h  "
                     f"{(r['image_bytes'] or 0) / 1e6:>8.1f} MB"
                     + {True: "  test-restored", False: "  test restore failed", None: ""}[r["tested"]]
                     + (f"  SUSPECT: {r['suspect']['reason']}" if r["suspect"] else "")
                     + (f"  DAMAGED (kept for inspection): {r['damaged']}" if r["damaged"] else "")
                     for r in rows) or "no snapshots"
    emit({"snapshots": rows, "dir": str(store.root)}, as_json, text)


def _pick_snapshot(svc, snapshot_id: str | None):
    """(store, the snapshot named, or the current one); a usage error naming the store when there is none."""
    from restartkit.errors import UsageError
    from restartkit.snapshot.ops import store_for
    store = store_for(svc)
    snap = store.get(snapshot_id) if snapshot_id else store.current()
    if snap is None:
        raise UsageError(f"no snapshot {snapshot_id or '(current)'} in {store.root}", hint="restartkit snapshot list")
    if snap.damaged:
        raise UsageError(f"snapshot {snap.id} is damaged: {snap.damaged}", hint=f"it is kept for inspection in "
                         f"{snap.path}; take a new one with `restartkit snapshot create`, remove it when done")
    return store, snap


@snapshot.command("inspect")
@policy_option
@click.argument("snapshot_id", required=False)
@json_option
@state_dir_option
@friendly
def snapshot_inspect(policy_path, snapshot_id, as_json):
    """A snapshot's manifest, and how its identity compares with this host.

    \b
    Examples:
      restartkit snapshot inspect --policy llm.toml 20261204T020000Z"""
    from restartkit.snapshot.ops import host_identity, mismatches
    svc, facts = _snapshot_context(policy_path)
    snap = _pick_snapshot(svc, snapshot_id)[1]
    miss = mismatches(snap.manifest["identity"], host_identity(svc, facts))
    data = {"id": snap.id, "path": str(snap.path), "mismatches": miss, **snap.manifest}
    kind = snap.manifest.get("kind") or "full"
    emit(data, as_json, f"{snap.id} ({kind}{': restores through criu+ipc' if kind == 'weightless' else ''}): "
         f"{snap.manifest['image_bytes'] / 1e6:.1f} MB, {snap.age_s / 3600:.1f} h old, "
         + ("matches this host" if not miss else "does NOT match: " + "; ".join(miss))
         + (f"; SUSPECT: {snap.suspect['reason']}" if snap.suspect else ""))


@snapshot.command("test")
@policy_option
@click.argument("snapshot_id", required=False)
@wait_option
@json_option
@state_dir_option
@friendly
def snapshot_test(policy_path, snapshot_id, wait_s, as_json):
    """Restore a copy of a snapshot (default: current) beside the serving engine, in namespaces of its
    own, and check its canary; the engine is not touched. A snapshot that fails is marked suspect;
    one that passes is cleared of an earlier mark.

    \b
    Examples:
      restartkit snapshot test --policy llm.toml
      restartkit snapshot test --policy llm.toml 20261204T020000Z"""
    from restartkit.snapshot.trial import test_restore
    from restartkit.snapshot.ops import snapshot_metrics
    svc = load(policy_path)
    with guarded(svc, "snapshot test", wait_s):
        svc, facts = _snapshot_context(svc)
        store, snap = _pick_snapshot(svc, snapshot_id)
        result = test_restore(svc, facts, snap, say=lambda m: None if as_json else click.echo(m))
        if not result["ok"]:
            store.mark_suspect(snap, f"test restore failed: {result.get('error')}")
        else:
            store.clear_suspect(snap)
        snapshot_metrics(svc)
    phases = result.get("phases") or {}
    emit({"id": snap.id, **result}, as_json,
         f"{snap.id}: restored beside the engine in {result['wall_s']:.2f} s (restore {phases.get('criu_restore', 0):.2f} s), "
         "canary identical; the copy is gone" if result["ok"] else
         f"{snap.id}: test restore FAILED: {result.get('error')}; marked suspect (CRIU's log: "
         f"{snap.path / 'test-restore.log'}, the copy's own: {snap.path / 'test-restore-engine.log'})")
    sys.exit(0 if result["ok"] else 1)


@snapshot.command("prune")
@policy_option
@click.option("--keep", type=click.IntRange(min=1), default=None, help="Default: [criu] keep.")
@wait_option
@state_dir_option
@friendly
def snapshot_prune(policy_path, keep, wait_s):
    """Remove all but the newest N snapshots (never the current one).

    \b
    Examples:
      restartkit snapshot prune --policy llm.toml --keep 2"""
    from restartkit.snapshot.ops import snapshot_metrics, store_for
    svc = load(policy_path)
    with guarded(svc, "snapshot prune", wait_s):
        removed = store_for(svc).prune(keep or svc.policy.criu["keep"])
        snapshot_metrics(svc)
    click.echo(f"removed {len(removed)}: {', '.join(removed)}" if removed else "nothing to remove")


@snapshot.command("refresh")
@policy_option
@click.option("--force", is_flag=True, help="Take a new snapshot even if the current one is fresh.")
@click.option("--install-timer", is_flag=True, help="Write a systemd .service/.timer pair and print the crontab line.")
@unit_dir_option
@wait_option
@state_dir_option
@friendly
def snapshot_refresh(policy_path, force, install_timer, unit_dir, wait_s):
    """For cron or a systemd timer: a new snapshot when the current one is stale. Exit 75 when another refresh runs.

    The engine serves nothing while it is dumped (the line printed says how long).

    \b
    Examples:
      restartkit snapshot refresh --policy llm.toml            # only when stale, suspect or changed
      restartkit snapshot refresh --policy llm.toml --force
      restartkit snapshot refresh --policy llm.toml --install-timer   # [criu] refresh as a timer, and a cron line"""
    from restartkit.snapshot.refresh import install_timer as install, refresh
    if install_timer:
        svc = load(policy_path)
        files, cron = install(svc, svc.policy.criu["refresh"], unit_dir)
        click.echo("wrote " + ", ".join(map(str, files)))
        click.echo(f"enable it: systemctl daemon-reload && systemctl enable --now {files[1].name}")
        click.echo(f"or, with cron (/etc/cron.d/restartkit): {cron}" if not cron.startswith("#") else cron[2:])
        return
    from restartkit.guard.lock import BusyError
    from restartkit.snapshot.ops import store_for
    svc = load(policy_path)
    try:
        with guarded(svc, "snapshot refresh", wait_s, extra_dirs=((store_for(svc).root, "snapshot images dir"),)):
            svc, facts = _snapshot_context(svc)
            rc = refresh(svc, facts, force=force, say=click.echo)
    except BusyError as e:  # one line, for cron mail
        click.echo(f"{svc.policy.name}: {e.message}; nothing done")
        rc = e.exit_code
    sys.exit(rc)


# ---- models and the reference engine -------------------------------------------------

# reference.checkpoint's PRESETS, named here without importing torch (tests/test_architecture.py checks)
MODEL_PRESETS = ["tiny", "tiny-moe", "small", "1b", "8b-shape", "14b-shape", "24b-shape"]

@main.group()
def model():
    """Reference checkpoints (Hugging Face Llama layout)."""


@model.command("create")
@click.option("--preset", type=click.Choice(MODEL_PRESETS), default="tiny", show_default=True)
@click.option("--out", required=True, type=click.Path(file_okay=False))
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where to generate the random weights (cuda is much faster for 8b-shape).")
@friendly
def model_create(preset, out, seed, dtype, device):
    """Write deterministic seeded random weights for a preset.

    \b
    Examples:
      restartkit model create --out ./m
      restartkit model create --preset 8b-shape --dtype bfloat16 --device cuda --out /srv/models/8b"""
    import os
    from restartkit.errors import UsageError
    from restartkit.reference.model.checkpoint import write_checkpoint
    parent = os.path.dirname(os.path.abspath(os.path.expanduser(out)))
    try:
        os.makedirs(parent, exist_ok=True)  # as `mkdir -p` would
    except OSError as e:
        raise UsageError(f"--out {out}: cannot make its parent directory {parent}: {e.strerror or e}",
                         hint="pick an --out under a directory you can write") from None
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: this host has no usable CUDA device", hint="use --device cpu")
    path = write_checkpoint(out, preset, seed=seed, dtype=dtype, device=device, progress=say)
    click.echo(str(path))


@main.group()
def engine():
    """The reference engine."""


@engine.command("serve", add_help_option=False,
                context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def engine_serve(ctx):
    """Serve a checkpoint: restartkit engine serve --model DIR [--port N] [--device cpu|cuda] ...

    Every option is the reference server's own: restartkit engine serve --help lists them.

    \b
    Examples:
      restartkit engine serve --model ./m --port 8000
      restartkit engine serve --help     # every option"""
    from restartkit.reference.serving.server import main as serve_main
    sys.exit(serve_main(ctx.args))


# ---- audit -------------------------------------------------------------------------

@main.command()
@click.argument("path", type=click.Path())
@click.option("--engine", default="vllm", show_default=True)
@click.option("--from", "since", default=None, help="The version you run now.")
@click.option("--to", "until", default=None, help="The version you upgrade to.")
@json_option
@friendly
def audit(path, engine, since, until, as_json):
    """Find what an engine upgrade removed, renamed or gated in a deploy repository. Exit 1 when something needs action.

    \b
    Examples:
      restartkit audit ./deploy --from 0.30 --to 0.33"""
    from restartkit.audit import audit as run_audit, render
    result = run_audit(path, engine, since, until)
    emit(result, as_json, render(result))
    sys.exit(1 if result["needs_action"] else 0)


# ---- bench and demo --------------------------------------------------------------------

@main.command()
@policy_option
@click.option("--strategies", default="cold", show_default=True, help="Comma-separated strategies to compare.")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Write bench.json (and bench.png with matplotlib) here.")
@click.option("--clients", type=click.IntRange(min=0, max=256), default=0, show_default=True,
              help="Clients sending greedy completions throughout (no retries): what each strategy costs them.")
@wait_option
@json_option
@state_dir_option
@friendly
def bench(policy_path, strategies, repeat, out, clients, wait_s, as_json):
    """Restart the same service with each strategy N times; compare time to ready.

    \b
    Examples:
      restartkit bench --policy llm.toml --strategies cold,ipc,criu --repeat 3 --out bench/
      restartkit bench --policy llm.toml --strategies standby,cold --clients 4   # what clients see meanwhile"""
    from restartkit.commands.bench import render_bench, run_bench
    from restartkit.errors import UsageError
    from restartkit.contracts import STRATEGY_NAMES as STRATEGIES
    names = [s.strip() for s in strategies.split(",") if s.strip()]
    if not names or (bad := [n for n in names if n not in STRATEGIES]):
        raise UsageError(f"--strategies {strategies!r}: " + (f"unknown strategy {bad[0]!r}" if names else "names none"),
                         hint=f"choose from: {', '.join(STRATEGIES)} (comma-separated)")
    svc = load(policy_path)
    with guarded(svc, "bench", wait_s, defer_signals=False):
        result = run_bench(svc, names, repeat, out, say=say, clients=clients)
    emit(result, as_json, render_bench(result))


@main.command()
@click.option("--workdir", default="~/.cache/restartkit/demo", show_default=True, type=click.Path(file_okay=False))
@click.option("--repeat", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8199, show_default=True,
              help="The demo engine's port (another one when this is taken).")
@friendly
def demo(workdir, repeat, port):
    """The main job on the embedded reference model, end to end on this machine.

    \b
    Examples:
      restartkit demo
      restartkit demo --workdir /tmp/rk-demo --repeat 3"""
    from restartkit.commands.demo import run_demo
    sys.exit(run_demo(workdir, repeat, say=click.echo, state_root=state_root(), port=port))


if __name__ == "__main__":
    main()
