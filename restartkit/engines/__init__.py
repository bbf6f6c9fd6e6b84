"""Engine adapters, one module per engine, one registry."""
from __future__ import annotations

from restartkit.engines.base import EngineAdapter

NOT_BUILT = {"command": "the generic command adapter is not built yet"}


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
    return None, NOT_BUILT.get(name, f"engine {name!r} is not supported")
