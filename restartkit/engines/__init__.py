"""Engine adapters, one module per engine, one registry: a name, the module and the class.  The
modules are imported only when their engine is asked for (the CLI starts fast)."""
from __future__ import annotations

import importlib

from restartkit.engines.base import EngineAdapter

ADAPTERS = {
    "reference": ("restartkit.engines.reference", "ReferenceAdapter"),
    "vllm": ("restartkit.engines.vllm", "VLLMAdapter"),
    "sglang": ("restartkit.engines.sglang", "SGLangAdapter"),
    "command": ("restartkit.engines.command", "CommandAdapter"),
}
ENGINE_NAMES = tuple(ADAPTERS)


def get_adapter(name: str) -> tuple[EngineAdapter | None, str | None]:
    """(adapter, None) or (None, why not)."""
    if name not in ADAPTERS:
        return None, f"engine {name!r} is not supported (choices: {', '.join(ENGINE_NAMES)})"
    module, cls = ADAPTERS[name]
    return getattr(importlib.import_module(module), cls)(), None
