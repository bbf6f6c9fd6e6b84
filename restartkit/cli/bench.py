"""`bench` and `demo`."""
from __future__ import annotations

import sys

import click

from restartkit.cli.common import emit, friendly, guarded, load, say, service_options
from restartkit.options import state_root


@click.command("bench")
@service_options(wait=True)
@click.option("--strategies", default="cold", show_default=True, help="Comma-separated strategies to compare.")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Write bench.json (and bench.png with matplotlib) here.")
@click.option("--clients", type=click.IntRange(min=0, max=256), default=0, show_default=True,
              help="Clients sending greedy completions throughout (no retries): what each strategy costs them.")
def bench_cmd(policy_path, strategies, repeat, out, clients, wait_s, as_json):
    """Restart the same service with each strategy N times; compare time to ready.

    \b
    Examples:
      restartkit bench --policy llm.toml --strategies cold,ipc,criu --repeat 3 --out bench/
      restartkit bench --policy llm.toml --strategies standby,cold --clients 4   # what clients see meanwhile"""
    from restartkit.commands.bench import render_bench, run_bench
    from restartkit.errors import UsageError
    from restartkit.contracts import STRATEGY_NAMES
    names = [s.strip() for s in strategies.split(",") if s.strip()]
    if not names or (bad := [n for n in names if n not in STRATEGY_NAMES]):
        raise UsageError(f"--strategies {strategies!r}: " + (f"unknown strategy {bad[0]!r}" if names else "names none"),
                         hint=f"choose from: {', '.join(STRATEGY_NAMES)} (comma-separated)")
    svc = load(policy_path)
    with guarded(svc, "bench", wait_s, defer_signals=False):
        result = run_bench(svc, names, repeat, out, say=say, clients=clients)
    emit(result, as_json, render_bench(result))


@click.command("demo")
@click.option("--workdir", default="~/.cache/restartkit/demo", show_default=True, type=click.Path(file_okay=False))
@click.option("--repeat", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8199, show_default=True,
              help="The demo engine's port (another one when this is taken).")
@friendly
def demo_cmd(workdir, repeat, port):
    """The main job on the embedded reference model, end to end on this machine.

    \b
    Examples:
      restartkit demo
      restartkit demo --workdir /tmp/rk-demo --repeat 3"""
    from restartkit.commands.demo import run_demo
    sys.exit(run_demo(workdir, repeat, say=click.echo, state_root=state_root(), port=port))
