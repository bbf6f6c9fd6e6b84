"""Engine adapters, one module per engine, one registry."""
from __future__ import annotations

from restartkit.engines.base import EngineAdapter


def get_adapter(name: str) -> tuple[EngineAdapter | None, str | None]:
    """(adapter, None) or (None, why not)."""
    if name == "reference":
        from restartkit.engines.reference import ReferenceAdapter
        return ReferenceAdapter(), None
    if name == "vllm":
        from restartkit.engines.vllm import VLLMAdapter
        return VLLMAdapter(), None
    if name == "sglang":
        from restartkit.engines.sglang import SGLangAdapter
        return SGLangAdapter(), None
    if name == "command":
        from restartkit.engines.command import CommandAdapter
        return CommandAdapter(), None
    return None, f"engine {name!r} is not supported (reference, vllm, sglang or command)"
