"""`plan`, `restart`, `start` and `stop`."""
from __future__ import annotations

import click

from restartkit.cli.common import emit, guarded, load, progress_for, restart_and_exit, say, service_options
from restartkit.options import reason_option, strategy_option


@click.command("plan")
@service_options()
@strategy_option
@reason_option
def plan_cmd(policy_path, strategy, reason, as_json):
    """Dry run: every strategy, eligible or not, with every reason.

    \b
    Examples:
      restartkit plan --policy llm.toml                       # what `restart` would do now, and why
      restartkit plan --policy llm.toml --reason crash --json # what supervise would do after a crash"""
    from restartkit.planner import render_plan
    from restartkit.restart import plan_for
    p, _facts = plan_for(load(policy_path), strategy, reason)
    emit(p.to_dict(), as_json, render_plan(p))


@click.command("restart")
@service_options(wait=True)
@strategy_option
@reason_option
@click.option("--strict", is_flag=True, help="Exit 3 when the service came back only through a recovery path.")
@click.option("--overlap/--no-overlap", default=None,
              help="ipc: prepare the new engine while the old one serves.  [default: [restart] overlap]")
@click.option("--measure-downtime", is_flag=True, help="Hammer the service during the restart; record the longest gap.")
def restart_cmd(policy_path, strategy, reason, strict, overlap, measure_downtime, wait_s, as_json):
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


@click.command("start")
@service_options(wait=True)
def start_cmd(policy_path, wait_s, as_json):
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


@click.command("stop")
@service_options(wait=True)
def stop_cmd(policy_path, wait_s, as_json):
    """Stop the service's engine: SIGTERM, wait, SIGKILL.  Under `restartkit supervise`, through the
    supervisor (which stops the engine and exits), so that the stop is not taken for a crash.

    \b
    Examples:
      restartkit stop --policy llm.toml
      restartkit stop --policy llm.toml --wait 30"""
    from restartkit.supervision.state import stop_supervisor
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
