"""First-use costs of a forward pass, paid beside the rest of the start.

A process's first matmul of each shape, first attention and first of each
elementwise kernel load libraries and kernel modules (lazily, per kernel);
measured on an H200, that is most of a first 8b-shape forward (0.37 s against
0.03 s steady).  None of it depends on the weights.  So, on CUDA, a thread
runs a forward pass of a one-layer stand-in of the model (same shapes,
uninitialised memory, its own small KV cache) while the loader thread
configures, attaches or loads the weights and allocates the KV cache; torch
releases the GIL inside each operation, so both make progress.  The engine
joins the thread before its real warm-up.
"""
from __future__ import annotations

import dataclasses
import threading
import time

import torch


class _NoReduce:
    """The model's Parallel, but its reduce is local: the stand-in runs on
    one rank alone (the real ranks meet in the real warm-up)."""

    def __init__(self, par):
        self._par = par

    def __getattr__(self, name):
        return getattr(self._par, name)

    def reduce(self, x):
        return x


class Prewarm:
    def __init__(self, cfg, par, dtype: torch.dtype, quantization: str, device: torch.device, max_len: int):
        self.args = (cfg, par, dtype, quantization, device, max_len)
        self.seconds: float | None = None
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="prewarm", daemon=True)

    def start(self) -> "Prewarm":
        self.thread.start()
        return self

    def join(self) -> float:
        """Wait for it; returns the seconds waited here."""
        t0 = time.perf_counter()
        self.thread.join()
        return time.perf_counter() - t0

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            stand_in_forward(*self.args)
        except Exception as e:  # a failed prewarm costs time later, nothing else
            self.error = f"{type(e).__name__}: {e}"
        self.seconds = time.perf_counter() - t0


@torch.inference_mode()
def stand_in_forward(cfg, par, dtype, quantization, device, max_len) -> None:
    from restartkit.reference.handover import wait_for_previous_engine
    from restartkit.reference.weights import build_model
    if device.type == "cuda":
        torch.cuda.set_device(device)
    wait_for_previous_engine()  # its memory first: the stand-in allocates ~2 layers' worth plus the vocabulary
    one = dataclasses.replace(cfg, num_hidden_layers=1)
    model = build_model(one, par, dtype, quantization).to_empty(device=device)
    model.par = _NoReduce(par)
    for mod in model.modules():
        if hasattr(mod, "par"):
            mod.par = model.par
    model.allocate_kv_cache(max_len)
    prompt = torch.tensor([1, 2, 3, 4], device=device)
    int(torch.argmax(model(prompt, torch.arange(4, device=device))[-1].float().cpu()))
    int(torch.argmax(model(prompt[:1], torch.tensor([4], device=device))[0].float().cpu()))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    del model
