"""One module per strategy, one registry.  `get_strategy` is a dict lookup."""
from __future__ import annotations

from restartkit.errors import UsageError
from restartkit.strategies.base import BaseStrategy, Facts, Outcome, ServiceFacts, Verdict  # noqa: F401

# Fastest first: the order `auto` tries when the policy gives none.
DEFAULT_ORDER = ("sleep", "ipc", "criu", "cold")


def _registry() -> dict[str, BaseStrategy]:
    from restartkit.strategies.cold import ColdStrategy
    from restartkit.strategies.criu import CriuStrategy
    from restartkit.strategies.ipc import IPCStrategy
    from restartkit.strategies.sleep import SleepStrategy

    return {
        "sleep": SleepStrategy(),
        "ipc": IPCStrategy(),
        "criu": CriuStrategy(),
        "cold": ColdStrategy(),
    }


def all_strategies() -> dict[str, BaseStrategy]:
    return _registry()


def get_strategy(name: str) -> BaseStrategy:
    reg = _registry()
    if name not in reg:
        raise UsageError(f"strategy {name!r} is not supported", hint=f"choose one of: auto, {', '.join(reg)}")
    return reg[name]
