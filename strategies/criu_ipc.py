"""criu+ipc: restore a snapshot of the initialized engine that holds neither its weights nor
its KV cache, then re-attach the weights from the weight cache (one handle) and allocate
the KV cache.  No interpreter start, no `import torch`, no device initialization, no weight
copy: the image is the engine's own host memory (and, on a GPU, its context and workspaces).

Proof: the CRIU restore, an ipc hit on re-attach (a missing or different weight cache is an
error naming the field, never a silent load from disk) and the canary.  A weight cache that
is gone or different sends the restart to recovery with the snapshot kept and not suspect:
the fault is not the snapshot's.
"""
from __future__ import annotations

from restartkit.contracts import Facts, Outcome
from restartkit.strategies.base import adapter_available, model_loadable
from restartkit.strategies.criu import CriuStrategy
from restartkit.strategies.criu_checks import WEIGHTLESS_PREREQUISITES


class CriuIpcStrategy(CriuStrategy):
    name = "criu+ipc"
    prerequisites = [adapter_available, model_loadable, *WEIGHTLESS_PREREQUISITES]

    def gather(self, service, facts: Facts) -> dict:
        return {}  # the snapshot's facts are criu's, the weight cache's are ipc's: gathered once, there

    def prove(self, out: Outcome, load: dict) -> None:
        out.proof.update(path=out.proof["path"] + " (weights-less) + weights re-attached from the weight cache",
                         ipc=load.get("ipc"), mode=load.get("mode"), attach_s=load.get("attach_s"),
                         reattach_s=load.get("reattach_s"))
        if load.get("ipc") != "hit":
            out.ok = False
            out.error = (f"the restored engine's weights did not come from the weight cache: {load.get('ipc')}"
                         f"({load.get('fallback_field') or load.get('fallback_reason')})")
