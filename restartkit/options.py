"""CLI options shared by several commands, declared once."""
from __future__ import annotations

import math
import os

import click

from restartkit.contracts import REASONS, STRATEGY_NAMES

STATE_DIR_ENV = "RESTARTKIT_STATE_DIR"  # the one variable restartkit's own commands read (besides click's options)


def _set_state_dir(ctx, param, value):
    if value:
        ctx.meta["restartkit.state_root"] = value
    return value


def state_root() -> str:
    """The root of state dirs for this command: --state-dir, else $RESTARTKIT_STATE_DIR (commands
    without the option honour it too), else systemd's $STATE_DIRECTORY (a unit's StateDirectory=, as
    `--install-unit --user` writes), else "" (the policy's own or the default)."""
    ctx = click.get_current_context(silent=True)
    return ((ctx.meta.get("restartkit.state_root") if ctx else None) or os.environ.get(STATE_DIR_ENV, "")
            or os.environ.get("STATE_DIRECTORY", "").split(":")[0])


class Seconds(click.ParamType):
    """A number of seconds from `low` to `high`: nan, infinities and negatives are not durations
    (click's FloatRange lets nan through: every comparison with it is false)."""
    name = "seconds"

    def __init__(self, low: float = 0.0, high: float = 7 * 86400):
        self.low, self.high = low, high

    def convert(self, value, param, ctx):
        try:
            v = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not math.isfinite(v) or not self.low <= v <= self.high:
            self.fail(f"{value!r} is not a number of seconds from {self.low:g} to {self.high:g} (7 days)", param, ctx)
        return v


policy_option = click.option(
    "--policy", "policy_path", envvar="RESTARTKIT_POLICY", required=True, show_envvar=True,
    type=click.Path(dir_okay=False), help="The service's policy file (TOML).")
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object (for scripts).")
state_dir_option = click.option(
    "--state-dir", envvar=STATE_DIR_ENV, show_envvar=True, expose_value=False, is_eager=True,
    callback=_set_state_dir, help="Where records, logs and PID files live.  [default: ~/.local/state/restartkit]")
wait_option = click.option(
    "--wait", "wait_s", type=Seconds(), default=0.0, envvar="RESTARTKIT_LOCK_WAIT", show_envvar=True,
    show_default=True, help="Seconds to wait for another restartkit command on this service to finish "
                            "(0: exit 75 at once, naming it).")
unit_dir_option = click.option(
    "--unit-dir", default="/etc/systemd/system", show_default=True, type=click.Path(file_okay=False),
    help="Where --install-unit/--install-timer writes (checked only then: a unit's own sandbox may make "
         "the default read-only).")
strategy_choice = click.Choice(["auto", *STRATEGY_NAMES])
strategy_option = click.option("--strategy", type=strategy_choice, default="auto", show_default=True,
                               help="How to bring the service back; auto picks the fastest eligible.")
reason_option = click.option(
    "--reason", type=click.Choice(list(REASONS)), default="restart",
    show_default=True, help="Why restart: decides which strategies can satisfy it (sleep applies no new code, flags or weights).")
