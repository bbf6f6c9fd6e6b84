"""restartkit inside vLLM: a plugin, a load format and a worker extension.  Imported in vLLM's own
processes only (the API server, the engine core, the workers); nothing of vLLM is patched.

- `register()` is the `vllm.general_plugins` entry point.  It acts only in engines restartkit starts
  (RESTARTKIT_VLLM_PLUGIN=1 in their environment): it registers the load format `restartkit_cache`.
- The load format takes the weights from restartkit's weight cache (a daemon per device holding the
  checkpoint's tensors as stored: `dtype = "checkpoint"`): it maps the daemon's arena (a memfd on the
  CPU, a CUDA IPC handle on a GPU), feeds the tensors to the model's own `load_weights` (vLLM fuses
  qkv/gate_up and shards for tensor parallelism there: a copy), and unmaps it.  vLLM then processes
  the weights as after a disk load (on the CPU: oneDNN repacks the linear layers, a second copy).
  No mapping or descriptor of the cache is left once the load returns.
- The worker extension (`--worker-extension-cls restartkit.engines.vllm_ext.Worker`) releases the
  weights and the KV cache before a weights-less dump and loads them from the cache again after the
  restore (vLLM's own in-place reload: the layers are rebuilt in their checkpoint format, loaded,
  processed again, and copied back into the tensors the engine holds).
"""
from __future__ import annotations

import ctypes
import json
import os
import time
from contextlib import contextmanager

LOAD_FORMAT = "restartkit_cache"
ENV = "RESTARTKIT_VLLM_PLUGIN"
EXTENSION = "restartkit.engines.vllm_ext.Worker"
# what the worker loaded from, and how: its extension answers it (the launcher's /admin/stats)
LOAD_INFO: dict = {}


def register() -> None:
    """The `vllm.general_plugins` entry point: vLLM calls it in each of its processes."""
    if os.environ.get(ENV) != "1":
        return  # a vLLM restartkit did not start: leave it exactly as it is
    from restartkit.engines.vllm_seams import resolve
    resolve("register_model_loader")(LOAD_FORMAT)(_loader_class())


def _rank(vllm_config) -> dict:
    from restartkit.engines.vllm_seams import resolve
    get_tensor_model_parallel_rank = resolve("get_tensor_model_parallel_rank")
    par = vllm_config.parallel_config
    try:
        tp_rank = get_tensor_model_parallel_rank()
    except (AssertionError, RuntimeError):
        tp_rank = 0
    return {"tp_size": par.tensor_parallel_size, "tp_rank": tp_rank, "dp_size": par.data_parallel_size,
            "dp_rank": par.data_parallel_rank, "expert_parallel": bool(par.enable_expert_parallel)}


def _device_uuid(device_type: str, global_rank: int) -> str:
    from restartkit.weightcache.daemon import device_uuid
    if device_type == "cuda":
        import torch
        return device_uuid(f"cuda:{torch.cuda.current_device()}", global_rank)
    return device_uuid("cpu", global_rank)


@contextmanager
def cache_tensors(extra: dict, vllm_config, device_type: str):
    """(name, tensor) views of this rank's weight-cache arena, mapped for the `with` block only;
    raises IPCUnavailable (restartkit.weightcache.loader) when the cache cannot serve this engine."""
    from restartkit.weightcache import protocol
    from restartkit.weightcache.arena import open_cuda, open_memfd, views
    from restartkit.weightcache.fingerprint import CHECKPOINT, fingerprint
    from restartkit.weightcache.loader import IPCConfig, _attach_waiting
    cfg = IPCConfig.parse(extra.get("cache") or {})
    ident, rank = extra.get("identity") or {}, _rank(vllm_config)
    global_rank = rank["dp_rank"] * rank["tp_size"] + rank["tp_rank"]
    uuid = _device_uuid(device_type, global_rank)
    fp = fingerprint(vllm_config.model_config.model, **rank, dtype=CHECKPOINT, checkpoint=ident.get("checkpoint"),
                     quantization=ident.get("quantization", "none"), revision=ident.get("revision", ""))
    path = protocol.socket_path(uuid, False, cfg.socket_dir)
    hello = {"protocol": protocol.PROTOCOL_VERSION, "device_uuid": uuid, "fingerprint": fp}
    got = _attach_waiting(path, hello, IPCConfig(**{**cfg.__dict__, "mode": "copy"}), extra.get("absent_timeout_s"))
    if "reply" not in got:
        raise got["error"]
    reply, fds = got["reply"]
    handle, mm = reply["handle"], None
    try:
        if handle["kind"] == "memfd":
            data, mm = open_memfd(fds[0], handle["nbytes"], writable=False)
        else:
            data = open_cuda(handle)
        protocol._close(fds)
        fds = []
        yield views(data, reply["manifest"]), {"socket": str(path), "nbytes": handle["nbytes"], "device_uuid": uuid}
    finally:
        protocol._close(fds)
        data = None  # noqa: F841  (the views die with the caller's references)
        import gc
        gc.collect()
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # a view still alive: the mapping goes with it
        elif device_type == "cuda":
            import torch
            torch.cuda.synchronize()
            torch.cuda.ipc_collect()  # the CUDA IPC handle: closed once no storage holds it (a checkpoint
            # by the driver with it open would copy the imported memory into the image, and fail to restore)
        try:
            protocol.request(path, {"op": "detach"}, timeout=5.0, connect_timeout=cfg.connect_timeout_s)
        except Exception:
            pass


def load_from_cache(model, vllm_config, extra: dict, device_type: str, load) -> dict:
    """Map the cache, run `load(model, iterator)` over its tensors, unmap; the load's record."""
    t0 = time.perf_counter()
    with cache_tensors(extra, vllm_config, device_type) as (named, where):
        t1 = time.perf_counter()
        load(model, iter(named))
        copied = sum(t.numel() * t.element_size() for _, t in named)
        del named
    return {"source": "ipc", "ipc": "hit", "mode": "copy", "reattachable": True, "copied_bytes": copied,
            "attach_s": round(t1 - t0, 4), "load_s": round(time.perf_counter() - t1, 4), **where}


def _loader_class():
    import dataclasses

    from restartkit.engines.vllm_seams import resolve
    BaseModelLoader, DefaultModelLoader = resolve("BaseModelLoader"), resolve("DefaultModelLoader")  # noqa: N806

    class CacheLoader(BaseModelLoader):
        """`--load-format restartkit_cache`: the weights from restartkit's weight cache, or from disk
        when the cache cannot serve (fallback on), saying why."""

        def __init__(self, load_config):
            super().__init__(load_config)
            self.extra = dict(load_config.model_loader_extra_config or {})
            self.disk = DefaultModelLoader(dataclasses.replace(load_config, load_format="auto",
                                                               model_loader_extra_config={}))

        def download_model(self, model_config) -> None:
            self.disk.download_model(model_config)

        def load_weights(self, model, model_config) -> None:
            from restartkit.weightcache.loader import IPCConfig, IPCUnavailable
            vllm_config = resolve("get_current_vllm_config")()
            device = vllm_config.device_config.device_type
            try:
                info = load_from_cache(model, vllm_config, self.extra, device, lambda m, it: m.load_weights(it))
            except IPCUnavailable as e:
                if not IPCConfig.parse(self.extra.get("cache") or {}).fallback:
                    raise RuntimeError(f"restartkit_cache: {e.reason} (fallback is off)") from None
                print(f"restartkit: Weight cache unusable ({e.reason}); falling back to disk loading", flush=True)
                self.disk.load_weights(model, model_config)
                LOAD_INFO.clear()
                LOAD_INFO.update(source="disk", ipc="fallback", fallback_reason=e.reason, fallback_field=e.field)
                return
            LOAD_INFO.clear()
            LOAD_INFO.update(info)
            print(f"restartkit: Mapped {len(list(model.parameters()))} tensors from the weight cache daemon (copy mode); "
                  f"{info['copied_bytes']} bytes copied into vLLM's parameters in {info['load_s']:.3f} s", flush=True)

    return CacheLoader


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _storages(tensors) -> dict:
    """Distinct storages of `tensors`, by address: (storage, its bytes)."""
    out = {}
    for t in tensors:
        if t is None or t.is_meta:
            continue
        s = t.untyped_storage()
        if s.nbytes():
            out.setdefault(s.data_ptr(), (s, s.nbytes()))
    return out


class Worker:
    """Methods vLLM adds to each of its workers (`--worker-extension-cls`); restartkit's launcher
    calls them through the engine client's collective_rpc, never over HTTP."""

    def rk_load_info(self) -> dict:
        return dict(LOAD_INFO)

    def rk_release(self) -> dict:
        """Free the weights and the KV cache (their storages shrink to nothing; the tensors stay, so
        every reference the engine keeps to them stays valid) and drop the CPU GEMM's packed copies."""
        import gc
        runner = self.model_runner
        if runner.device.type == "cuda" and not runner.vllm_config.model_config.enforce_eager:
            # the storages come back at other addresses: CUDA graphs captured on the old ones would read garbage
            raise RuntimeError("a GPU vLLM releases its weights only with --enforce-eager (no CUDA graphs): add it "
                               "to [service] engine_args, or take whole-process snapshots ([criu] weights = 'include')")
        model = runner.model
        params = _storages(p for p in model.parameters())
        kv = _storages(self.model_runner.kv_caches)
        for s, _ in list(params.values()) + list(kv.values()):
            s.resize_(0)
        packed = 0
        for m in model.modules():
            if hasattr(m, "cpu_linear"):
                del m.cpu_linear  # holds oneDNN's packed copy of the layer's weight
                packed += 1
        self._rk_released = {"params": [(s, n) for s, n in params.values()], "kv": [(s, n) for s, n in kv.values()]}
        gc.collect()
        if self.model_runner.device.type == "cuda":
            import torch
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # freed device memory back to the driver: its checkpoint copies what is held
        _malloc_trim()
        return {"weights_released_bytes": sum(n for _, n in params.values()),
                "kv_cache_freed_bytes": sum(n for _, n in kv.values()), "packed_layers_dropped": packed}

    def rk_reattach(self, extra_json: str) -> dict:
        """Give the storages back their size and load the weights from the cache again through vLLM's
        in-place reload (which processes them again, oneDNN packing included)."""
        released = getattr(self, "_rk_released", None)
        if released is None:
            raise RuntimeError("nothing was released")
        for s, n in released["params"] + released["kv"]:
            s.resize_(n)
        vllm_config = self.model_runner.vllm_config
        extra = json.loads(extra_json)
        info = load_from_cache(self.model_runner.model, vllm_config, extra, vllm_config.device_config.device_type,
                               reloader(vllm_config))
        self._rk_released = None
        LOAD_INFO.clear()
        LOAD_INFO.update(info, reattached=True)
        return dict(LOAD_INFO)


def reloader(vllm_config):
    """How the weights go back into a model that holds them already (a re-attach after a weights-less dump):
    vLLM's in-place reload where it has one (0.30 and later), which processes them again (oneDNN packing on the
    CPU); else the model's own load_weights, then vLLM's processing after loading (0.26: a GPU's unquantized
    layers keep their weights as loaded)."""
    from restartkit.engines.vllm_seams import resolve
    if (reload_weights := resolve("reload_weights")) is not None:
        return lambda m, it: reload_weights(vllm_config, m, weights_iterator=it, weights_path=None,
                                            is_checkpoint_format=True)
    process = resolve("process_weights_after_loading")

    def load_and_process(model, weights) -> None:
        model.load_weights(weights)
        process(model, vllm_config.model_config, next(model.parameters()).device)
    return load_and_process
