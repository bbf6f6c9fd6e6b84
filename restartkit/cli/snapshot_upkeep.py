"""`snapshot test|prune|refresh`: keeping the snapshots good and current."""
from __future__ import annotations

import sys

import click

from restartkit.cli.common import emit, guarded, load, service_options
from restartkit.cli.snapshots import pick_snapshot, snapshot_context
from restartkit.options import unit_dir_option


@click.command("test")
@service_options(wait=True)
@click.argument("snapshot_id", required=False)
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
        svc, facts = snapshot_context(svc)
        store, snap = pick_snapshot(svc, snapshot_id)
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


@click.command("prune")
@service_options(wait=True, json=False)
@click.option("--keep", type=click.IntRange(min=1), default=None, help="Default: [criu] keep.")
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


@click.command("refresh")
@service_options(wait=True, json=False)
@click.option("--force", is_flag=True, help="Take a new snapshot even if the current one is fresh.")
@click.option("--install-timer", "timer", is_flag=True, help="Write a systemd .service/.timer pair and print the crontab line.")
@unit_dir_option
def snapshot_refresh(policy_path, force, timer, unit_dir, wait_s):
    """For cron or a systemd timer: a new snapshot when the current one is stale. Exit 75 when another refresh runs.

    The engine serves nothing while it is dumped (the line printed says how long).

    \b
    Examples:
      restartkit snapshot refresh --policy llm.toml            # only when stale, suspect or changed
      restartkit snapshot refresh --policy llm.toml --force
      restartkit snapshot refresh --policy llm.toml --install-timer   # [criu] refresh as a timer, and a cron line"""
    from restartkit.snapshot.refresh import install_timer, refresh
    if timer:
        svc = load(policy_path)
        files, cron = install_timer(svc, svc.policy.criu["refresh"], unit_dir)
        click.echo("wrote " + ", ".join(map(str, files)))
        click.echo(f"enable it: systemctl daemon-reload && systemctl enable --now {files[1].name}")
        click.echo(f"or, with cron (/etc/cron.d/restartkit): {cron}" if not cron.startswith("#") else cron[2:])
        return
    from restartkit.guard.lock import BusyError
    from restartkit.snapshot.ops import store_for
    svc = load(policy_path)
    try:
        with guarded(svc, "snapshot refresh", wait_s, extra_dirs=((store_for(svc).root, "snapshot images dir"),)):
            svc, facts = snapshot_context(svc)
            rc = refresh(svc, facts, force=force, say=click.echo)
    except BusyError as e:  # one line, for cron mail
        click.echo(f"{svc.policy.name}: {e.message}; nothing done")
        rc = e.exit_code
    sys.exit(rc)
