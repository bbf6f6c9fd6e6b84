"""`restartkit facts`, `policy check` and `audit`: the host, a policy file, a deploy repository."""
from __future__ import annotations

import sys

import click

from restartkit.cli.common import COLOR, emit, friendly
from restartkit.options import json_option, state_dir_option, state_root


@click.command("facts")
@json_option
@state_dir_option
@click.option("--criu-path", default="", help="CRIU binary to report on (default: the usual lookup).")
@friendly
def facts_cmd(as_json, criu_path):
    """What this host can do: arch, kernel, GPUs, CRIU, io_uring, memory, disk.

    \b
    Examples:
      restartkit facts
      restartkit facts --json | jq .criu"""
    from restartkit import facts
    f = facts.gather(state_root(), criu_path)
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


@click.group("policy")
def policy_group():
    """Policy files."""


@policy_group.command("check")
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
    from restartkit.policy.warnings import host_warnings, warnings
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


@click.command("audit")
@click.argument("path", type=click.Path())
@click.option("--engine", default="vllm", show_default=True)
@click.option("--from", "since", default=None, help="The version you run now.")
@click.option("--to", "until", default=None, help="The version you upgrade to.")
@json_option
@friendly
def audit_cmd(path, engine, since, until, as_json):
    """Find what an engine upgrade removed, renamed or gated in a deploy repository. Exit 1 when something needs action.

    \b
    Examples:
      restartkit audit ./deploy --from 0.30 --to 0.33"""
    from restartkit.audit import audit, render
    result = audit(path, engine, since, until)
    emit(result, as_json, render(result))
    sys.exit(1 if result["needs_action"] else 0)
