"""`sleep` and `wake`: the sleep strategy by hand."""
from __future__ import annotations

import click

from restartkit.cli.common import emit, guarded, load, restart_and_exit, service_options


@click.command("sleep")
@service_options(wait=True)
@click.option("--level", type=click.IntRange(1, 2), default=None, help="Default: [sleep] level.")
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


@click.command("wake")
@service_options(wait=True)
def wake_cmd(policy_path, wait_s, as_json):
    """Wake a sleeping engine, prove it by the canary; on failure, recover with a cold start.

    \b
    Examples:
      restartkit wake --policy llm.toml"""
    restart_and_exit(policy_path, "sleep", as_json, "wake", wait_s)
