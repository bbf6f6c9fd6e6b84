"""`standby arm|status|disarm`: the standby engine."""
from __future__ import annotations

import sys

import click

from restartkit.cli.common import emit, guarded, load, say, service_options


@click.group("standby")
def standby_group():
    """The standby engine: armed on the weight cache, promoted on a crash or a restart ([standby])."""


@standby_group.command("arm")
@service_options(wait=True)
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


@standby_group.command("status")
@service_options()
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


@standby_group.command("disarm")
@service_options(wait=True, json=False)
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
