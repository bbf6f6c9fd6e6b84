"""The reference engine's log lines (stderr, which restartkit appends to the engine log)."""
from __future__ import annotations

import os
import sys


def log(msg: str) -> None:
    print(f"[engine {os.getpid()}] {msg}", file=sys.stderr, flush=True)
