"""`supervise` and `reload`: a service kept serving across crashes, and its planned restart."""
from __future__ import annotations

import sys

import click

from restartkit.cli.common import load, say, service_options
from restartkit.options import Seconds, unit_dir_option


@click.command("supervise")
@service_options(json=False)
@click.option("--install-unit", is_flag=True, help="Write a systemd unit (Type=notify) that runs this, and exit.")
@unit_dir_option
@click.option("--watchdog-sec", type=click.IntRange(min=0, max=86400), default=0, show_default=True,
              help="With --install-unit: WatchdogSec= of the unit (0: none).")
@click.option("--user", "unit_user", default=None, metavar="NAME",
              help="With --install-unit: User= of the unit (policies without CRIU; the state root is pinned).")
def supervise_cmd(policy_path, install_unit, unit_dir, watchdog_sec, unit_user):
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
    svc = load(policy_path, behind_front=False)
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
    svc = load(policy_path, behind_front=svc.policy.front["enabled"])  # its engines behind its front
    svc.engine.progress = say
    sys.exit(Supervisor(svc, say=say).run())


@click.command("reload")
@service_options(json=False)
@click.option("--pid", type=click.IntRange(min=1), required=True, help="supervise's PID (a unit passes $MAINPID).")
@click.option("--timeout", "timeout_s", type=Seconds(1), default=None,
              help="Seconds to wait for the restart's record.  [default: the policy's stop and start timeouts + 60]")
def reload_cmd(policy_path, pid, timeout_s):
    """A planned restart of a supervised service (SIGHUP) that returns when it is done, with its outcome.

    The unit's ExecReload=, so that `systemctl reload` waits for the restart and shows how it ended.

    \b
    Examples:
      restartkit reload --policy llm.toml --pid "$(systemctl show -p MainPID --value restartkit-llm)"
      systemctl reload restartkit-llm     # runs the line above"""
    from restartkit.commands.reload import reload
    svc = load(policy_path)
    r = svc.policy.restart
    sys.exit(reload(svc.state_dir, pid, timeout_s or r["stop_timeout_s"] + r["start_timeout_s"] + 60, say))
