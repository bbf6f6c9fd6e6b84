"""Strategies whose execute step is not built yet.  Their `check` still runs
the prerequisites that are known, so `plan` shows every wall a host hits, and
says plainly that the strategy itself does not exist yet."""
from __future__ import annotations

from restartkit.strategies.base import BaseStrategy


class UnbuiltStrategy(BaseStrategy):
    built = False

    def __init__(self, name: str, prerequisites=()):
        self.name = name
        self.prerequisites = list(prerequisites)
