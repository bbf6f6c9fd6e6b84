"""The `restartkit` command.  Thin: logic lives in the library, each command group in a module of its own
(restartkit/cli/*.py), put together here.  Nothing heavy (torch) is imported until a command needs it."""
from __future__ import annotations

import click

from restartkit import __version__
from restartkit.cli import (bench, host, models, restarting, sleeping, snapshot_upkeep, snapshots, standby, status,
                            supervising, weights)
from restartkit.cli.models import MODEL_PRESETS
from restartkit.contracts import STRATEGY_NAMES, STRATEGY_SUMMARIES

__all__ = ["main", "MODEL_PRESETS"]

HELP = ("Bring an LLM inference engine back fast after a restart, and prove which path it took.\n\n"
        "\b\nStrategies (auto tries them fastest first, by evidence):\n"
        + "\n".join(f"  {name:<9} {STRATEGY_SUMMARIES[name]}" for name in STRATEGY_NAMES)
        + "\n\n\b\nExamples:\n  restartkit demo\n  restartkit plan --policy llm.toml\n"
          "  restartkit restart --policy llm.toml --strategy auto")


@click.group(help=HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="restartkit")
def main():
    pass


for command in (host.facts_cmd, host.policy_group, restarting.plan_cmd, restarting.restart_cmd, restarting.start_cmd,
                restarting.stop_cmd, status.status_cmd, supervising.supervise_cmd, supervising.reload_cmd,
                status.history_cmd, weights.preload_cmd, weights.rollout_cmd, standby.standby_group,
                weights.weightcache_group, sleeping.sleep_cmd, sleeping.wake_cmd, snapshots.snapshot_group,
                models.model_group, models.engine_group, host.audit_cmd, bench.bench_cmd, bench.demo_cmd):
    main.add_command(command)
for command in (snapshot_upkeep.snapshot_test, snapshot_upkeep.snapshot_prune, snapshot_upkeep.snapshot_refresh):
    snapshots.snapshot_group.add_command(command)
