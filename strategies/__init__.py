"""One module per strategy, one registry, in the order of restartkit.contracts.STRATEGY_NAMES
(fastest first).  Only the restart flow looks strategies up."""
from __future__ import annotations

from restartkit.contracts import STRATEGY_NAMES
from restartkit.strategies.base import BaseStrategy


def all_strategies() -> dict[str, BaseStrategy]:
    from restartkit.strategies.cold import ColdStrategy
    from restartkit.strategies.criu import CriuStrategy
    from restartkit.strategies.criu_ipc import CriuIpcStrategy
    from restartkit.strategies.ipc import IPCStrategy
    from restartkit.strategies.sleep import SleepStrategy

    reg = {s.name: s for s in (SleepStrategy(), CriuIpcStrategy(), IPCStrategy(), CriuStrategy(), ColdStrategy())}
    assert tuple(reg) == STRATEGY_NAMES, "a strategy is missing from the registry or from STRATEGY_NAMES"
    return reg

