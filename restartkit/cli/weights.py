"""`preload`, `rollout` and `weightcache`: the weight cache of the ipc strategy."""
from __future__ import annotations

import sys

import click

from restartkit.cli.common import emit, friendly, guarded, load, say, service_options
from restartkit.errors import EXIT_NOT_SERVING, EXIT_SERVING
from restartkit.options import Seconds, state_dir_option, state_root, unit_dir_option
from restartkit.record import render_record


@click.command("preload")
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
def preload_cmd(policy_path, detach, wait_ready, install_unit, unit_dir, unit_user, **flags):
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
    from restartkit.commands.preload import preload_command
    sys.exit(preload_command(policy_path, flags, detach=detach, wait_ready=wait_ready, say=click.echo,
                             state_root=state_root()))


@click.command("rollout")
@service_options(wait=True)
def rollout_cmd(policy_path, wait_s, as_json):
    """Put a service on its weight cache: cache first, then an ipc restart with fallback off, then the policy's own.

    \b
    Examples:
      restartkit rollout --policy llm.toml
      restartkit rollout --policy llm.toml --json"""
    from restartkit.commands.rollout import rollout
    svc = load(policy_path)
    with guarded(svc, "rollout", wait_s):
        recs = rollout(svc, say)
    emit({"records": [r.to_dict() for r in recs]}, as_json, "\n".join(render_record(r.to_dict()) for r in recs))
    last = recs[-1]
    sys.exit(last.exit_code if len(recs) == 2 else max(last.exit_code, 1))


@click.group("weightcache")
def weightcache_group():
    """Ask or tell the weight-cache daemons of a service."""


@weightcache_group.command("status")
@service_options()
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


@weightcache_group.command("release")
@service_options()
@click.option("--force", is_flag=True, help="Release even while zero_copy engines map the weights.")
@click.option("--stop", "stop_daemons", is_flag=True, help="Stop the daemons instead of only freeing their memory.")
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
