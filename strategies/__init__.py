"""One module per strategy, one registry, in the order of restartkit.contracts.STRATEGY_NAMES
(fastest first).  Only the restart flow looks strategies up.  Strategies hold no state: the
registry is built once per process (per command; a `supervise` reuses it for every restart)."""
from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Mapping

from restartkit.contracts import STRATEGY_NAMES
from restartkit.errors import UsageError
from restartkit.strategies.base import BaseStrategy


@functools.cache
def all_strategies() -> Mapping[str, BaseStrategy]:
    from restartkit.strategies.cold import ColdStrategy
    from restartkit.strategies.criu import CriuStrategy
    from restartkit.strategies.criu_ipc import CriuIpcStrategy
    from restartkit.strategies.ipc import IPCStrategy
    from restartkit.strategies.sleep import SleepStrategy
    from restartkit.strategies.standby import StandbyStrategy

    reg = {s.name: s for s in (SleepStrategy(), StandbyStrategy(), CriuIpcStrategy(), IPCStrategy(), CriuStrategy(),
                               ColdStrategy())}
    assert tuple(reg) == STRATEGY_NAMES, "a strategy is missing from the registry or from STRATEGY_NAMES"
    return MappingProxyType(reg)


def get_strategy(name: str) -> BaseStrategy:
    """The strategy called `name`, or a UsageError naming the choices."""
    try:
        return all_strategies()[name]
    except KeyError:
        raise UsageError(f"strategy {name!r} is not supported (choices: {', '.join(STRATEGY_NAMES)})",
                         hint="name one of them, or 'auto'") from None
