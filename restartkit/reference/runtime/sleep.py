"""Sleep mode for the reference engine: park the weights, drop the KV cache,
and wake up again in the same process.

Level 1: the weights are copied into one host arena (pinned memory on a
side stream on CUDA; on the CPU a memfd that is then unmapped, so the pages
leave the process's resident set) and the device copies are freed.  On CUDA
the pinned arena is allocated once, in the background as sleep mode starts
(pinning 16 GB takes seconds: outside any restart's window), and kept: every
sleep after copies into it, every wake out of it.
Level 2: the weights are dropped; waking re-reads them from where they came
from at start (the weight cache when it was attached, else the disk).
The KV cache (and the decode graph, which points into it) is dropped at
either level, and the allocator's cached blocks are released.
"""
from __future__ import annotations

import mmap
import os
import threading
import time

import torch

from restartkit.weightcache.arena import plan_layout, view_of


class SleepError(RuntimeError):
    pass


class Sleeper:
    def __init__(self, engine, pin_ahead: bool = True):
        self.engine = engine
        self.level = 0
        self.parked = None  # level 1: (host arena tensor or memfd, manifest, nbytes)
        self.last: dict = {}
        self._pinned: torch.Tensor | None = None  # CUDA: the pinned host arena, allocated once and kept
        self._pinning: threading.Thread | None = None
        if pin_ahead and engine.device.type == "cuda" and engine.model is not None:
            total = plan_layout([(n, p.dtype, tuple(p.shape)) for n, p in engine.model.named_parameters()])[1]
            self._pinning = threading.Thread(target=self._pin, args=(total,), name="sleep-pin", daemon=True)
            self._pinning.start()

    def _pin(self, total: int) -> None:
        t0 = time.perf_counter()
        self._pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        self.pinned_s = round(time.perf_counter() - t0, 4)

    def _arena(self, total: int) -> tuple[torch.Tensor, bool]:
        """The pinned arena for `total` bytes (waiting for the one allocated ahead); whether it was there."""
        if self._pinning is not None:
            self._pinning.join()
            self._pinning = None
        there = self._pinned is not None and self._pinned.numel() >= total
        if not there:
            self._pinned = None
            self._pin(total)
        return self._pinned[:total], there

    @property
    def asleep(self) -> bool:
        return self.level > 0

    def sleep(self, level: int) -> dict:
        eng = self.engine
        if level not in (1, 2):
            raise SleepError(f"level must be 1 or 2, not {level}")
        if self.asleep:
            raise SleepError(f"already asleep at level {self.level}")
        if eng.load_info.get("source") == "ipc" and eng.load_info.get("mode") == "zero_copy":
            raise SleepError("the weights are mapped zero_copy from the weight cache; they are not this engine's to park")
        t0 = time.perf_counter()
        kv = eng._drop_kv_locked()
        params = [(n, p) for n, p in eng.model.named_parameters()]
        nbytes = sum(p.numel() * p.element_size() for _, p in params)
        if level == 1:
            self.parked = self._park(params)
        for name, p in params:
            _set(eng.model, name, torch.empty(p.shape, dtype=p.dtype, device="meta"))
        eng.model.tie()  # a tied output projection goes with the embedding
        del params, p  # the last references: without this nothing is freed below
        if eng.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        self.level = level
        self.last = {"level": level, "weight_bytes": nbytes, "kv_cache_bytes": kv, "sleep_s": round(time.perf_counter() - t0, 4)}
        if level == 1 and eng.device.type == "cuda":
            self.last["pinned_arena"] = "kept" if self.last_reused else "allocated now"
        return self.last

    def _park(self, params):
        eng = self.engine
        manifest, total = plan_layout([(n, p.dtype, tuple(p.shape)) for n, p in params])
        if eng.device.type == "cuda":
            host, self.last_reused = self._arena(total)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for e, (_, p) in zip(manifest, params):
                    view_of(host, e).copy_(p, non_blocking=True)
            stream.synchronize()
            return ("pinned", host, manifest, total)
        fd = os.memfd_create("restartkit-parked-weights", os.MFD_CLOEXEC)
        os.ftruncate(fd, total)
        with mmap.mmap(fd, total, mmap.MAP_SHARED) as mm:
            host = torch.frombuffer(mm, dtype=torch.uint8, count=total)
            for e, (_, p) in zip(manifest, params):
                view_of(host, e).copy_(p)
            del host
        return ("memfd", fd, manifest, total)  # unmapped: out of this process's resident set

    def wake(self, weights: bool = True, kv_cache: bool = True) -> dict:
        eng = self.engine
        info: dict = {}
        if weights and self.asleep:
            t0 = time.perf_counter()
            if self.level == 1:
                info["bytes"] = self._unpark()
                info["source"] = "host"
            else:
                eng.reload_weights()
                info["source"] = eng.load_info.get("source")
            if eng.device.type == "cuda":
                torch.cuda.synchronize()
            info["weights_s"] = round(time.perf_counter() - t0, 4)
            if info.get("bytes"):
                info["weights_GBps"] = round(info["bytes"] / info["weights_s"] / 1e9, 2)
            info["level"] = self.level
            self.level = 0
        if kv_cache and not self.asleep:
            t0 = time.perf_counter()
            eng._restore_kv_locked()
            info["kv_cache_s"] = round(time.perf_counter() - t0, 4)
        self.last = {**self.last, "wake": info}
        return info

    def _unpark(self) -> int:
        eng = self.engine
        kind, src, manifest, total = self.parked
        if kind == "pinned":  # a tensor each, as a load makes them: one block would be freed only whole, and
            for e in manifest:  # a single weight still referenced at the next sleep (a graph's) would keep it all
                host = view_of(src, e)
                dev = torch.empty_like(host, device=eng.device)  # may raise: out of memory
                dev.copy_(host, non_blocking=True)
                _set(eng.model, e["name"], dev)
            eng.model.tie()
            self.parked = None
            return total
        dev = torch.empty(total, dtype=torch.uint8, device=eng.device)  # the CPU: one block, from the memfd
        with mmap.mmap(src, total, mmap.MAP_SHARED) as mm:
            host = torch.frombuffer(mm, dtype=torch.uint8, count=total)
            dev.copy_(host)
            del host
        os.close(src)
        for e in manifest:
            _set(eng.model, e["name"], view_of(dev, e))
        eng.model.tie()
        self.parked = None
        return total


def _set(model, name: str, tensor: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(mod_name), attr, torch.nn.Parameter(tensor, requires_grad=False))
