"""Assembling the engine in this process: the early CUDA context beside `import torch`, the
engine built, weights from disk or from the weight cache, the draft model, the phases timed."""
from __future__ import annotations

import json
import os
import threading
import time
from typing import TYPE_CHECKING

from restartkit.reference.log import log
from restartkit.reference.serving.ready import signal_ready

# A re-attach after a restore waits this long for a weight cache that is not there at all (no socket,
# nobody listening): the cache served when the snapshot was taken, so one that is gone is not coming.
REATTACH_ABSENT_S = 3.0

if TYPE_CHECKING:
    from restartkit.reference.serving.api import State


def _make_engine(args, draft: bool = False):
    """This rank's engine for the model, or for the draft model (no CUDA graph: speculative decoding runs it)."""
    from restartkit.reference.sched.engine import Engine, EngineOptions

    rank = args.worker_rank
    opts = EngineOptions(model=args.draft_model if draft else args.model, device=args.device, dtype=args.dtype,
                         max_model_len=args.max_model_len, cuda_graph=not (args.no_cuda_graph or draft),
                         tp_size=args.tensor_parallel_size, tp_rank=rank,
                         expert_parallel=args.enable_expert_parallel, quantization=args.quantization,
                         dist_init=f"tcp://127.0.0.1:{args.dist_port}", max_num_seqs=args.max_num_seqs,
                         kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization)
    return Engine(opts, is_draft=draft)


def _start_engine(engine, args, gate=None) -> None:
    """Start with weights from disk or from the weight cache; `gate`, when
    given, runs between preparing and activating (an overlapped restart).
    The engine this one replaces may still be tearing down: device memory is
    allocated only after it has exited (weights mapped zero_copy from the
    weight cache take none, so they attach before that wait)."""
    from restartkit.reference.serving.handover import wait_for_previous_engine

    def previous():
        waited = wait_for_previous_engine()
        engine.phases["wait_previous"] = round(waited, 4)

    draft = _make_engine(args, draft=True) if args.draft_model else None
    if args.load_format != "ipc_cache":
        engine.prepare(before_weights=previous)
        if draft:
            _prepare_draft(engine, draft)
        if gate:
            gate()
        engine.activate()
        _activate_draft(engine, draft, args)
        return
    zero_copy = args.ipc.get("mode", "zero_copy") == "zero_copy"
    engine.prepare(weights=_ipc_weights(engine, args), before_weights=None if zero_copy else previous)
    if zero_copy:
        previous()
    if draft:
        _prepare_draft(engine, draft, _ipc_weights(draft, args, is_draft=True))
    if gate:
        if zero_copy and engine.options.tp_size == 1:
            engine.warm_up_early()  # beside the old engine: weights are shared, the cache is small
        gate()
    engine.activate()
    _activate_draft(engine, draft, args)


def _ipc_weights(engine, args, is_draft: bool = False):
    """The ipc_cache loader for `engine` (the model's daemons, or the draft group's)."""
    from restartkit.weightcache.daemon import device_uuid
    from restartkit.weightcache.fingerprint import fingerprint
    from restartkit.weightcache.loader import attach

    def weights(fallback: bool | None = None):
        """`fallback`: None keeps the engine's --ipc-config; False makes a missing or different
        weight cache an error naming the field (a re-attach after a restore)."""
        o = engine.options
        dtype_name = str(engine.dtype).replace("torch.", "")
        global_rank = args.data_parallel_rank * o.tp_size + o.tp_rank
        uuid = device_uuid(str(engine.device) if engine.device.type == "cuda" else "cpu", global_rank)
        fp = fingerprint(o.model, tp_size=o.tp_size, tp_rank=o.tp_rank, dp_size=args.data_parallel_size,
                         dp_rank=args.data_parallel_rank, expert_parallel=o.expert_parallel, dtype=dtype_name,
                         quantization=o.quantization, revision=args.revision, draft=is_draft)
        attach(engine, args.ipc if fallback is None else {**args.ipc, "fallback": fallback}, uuid, fp, draft=is_draft,
               absent_timeout_s=None if fallback is None else REATTACH_ABSENT_S)
    return weights


def _prepare_draft(engine, draft, weights=None) -> None:
    from restartkit.reference.model.layout import draft_problem
    t0 = time.perf_counter()
    if problem := draft_problem(engine.options.model, draft.options.model):
        raise ValueError(problem)
    draft._control = getattr(engine, "_control", None)  # tensor parallel: the model's process groups
    draft.prepare(weights=weights)
    engine.phases["draft_prepare"] = round(time.perf_counter() - t0, 4)


def _activate_draft(engine, draft, args) -> None:
    if draft is None:
        return
    t0 = time.perf_counter()
    draft.activate()
    engine.draft, engine.spec_tokens = draft, args.num_speculative_tokens
    engine.load_info["draft"] = {k: v for k, v in draft.load_info.items() if k != "socket"}
    engine.phases["draft_activate"] = round(time.perf_counter() - t0, 4)


def _load(args, state: State, outcome: dict, gate=None) -> None:
    try:
        state.phases["process_start"] = round(_since_exec(), 4)
        context = _early_cuda_context(args)
        t0 = time.perf_counter()
        import torch  # the heavy import, timed as its own phase
        state.phases["import_torch"] = round(time.perf_counter() - t0, 4)
        if context is not None:
            t0 = time.perf_counter()
            context.join()
            state.phases["early_context_wait"] = round(time.perf_counter() - t0, 4)
        if args.threads:
            torch.set_num_threads(args.threads)
        from tokenizers import Tokenizer

        engine = _make_engine(args)
        t0 = time.perf_counter()
        state.tokenizer = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
        from restartkit.reference.serving.protocol import chat_template
        state.chat_template, state.special_tokens = chat_template(args.model)
        state.phases["tokenizer"] = round(time.perf_counter() - t0, 4)
        _start_engine(engine, args, gate)
    except Exception as e:
        outcome["error"] = f"{type(e).__name__}: {e}"
        return
    from restartkit.reference.sched.scheduler import Scheduler
    engine.run_ahead = {"auto": None, "on": True, "off": False}[args.run_ahead]
    scheduler = Scheduler(engine, args.max_num_seqs, args.max_queued_seqs, args.max_num_batched_tokens)
    engine.scheduler = scheduler  # the engine's own generate goes through it too
    scheduler.start()
    state.engine, state.scheduler = engine, scheduler
    if args.enable_sleep_mode:
        if args.tensor_parallel_size > 1:
            outcome["error"] = "sleep mode is supported at tensor_parallel_size 1 only"
            return
        from restartkit.reference.runtime.sleep import Sleeper
        state.sleeper = Sleeper(engine)
        state.sleep_public = args.sleep_endpoints_public
    state.phases.update(engine.phases)
    state.phases["ready_since_spawn"] = round(_since_exec(), 4)
    state.ready_at = time.time()
    state.ready = True
    log(f"ready in {state.ready_at - state.started_at:.2f} s; phases {json.dumps(state.phases)}")
    if state.on_ready is not None:  # a socket given to it: it accepts from now on, before it says ready
        state.on_ready()
    signal_ready()


def _early_cuda_context(args):
    """Make this rank's CUDA context (the device's primary context, which torch then uses)
    in a thread while Python imports torch: the driver call lets go of the GIL, so the
    0.15-0.2 s it takes on an H200 runs beside the import instead of after it.
    RESTARTKIT_EARLY_CUDA_CONTEXT=0 turns it off; any failure is left for torch to report."""
    if not args.device.startswith("cuda") or os.environ.get("RESTARTKIT_EARLY_CUDA_CONTEXT", "1") == "0":
        return None
    return start_cuda_context(int(args.device.split(":")[1]) if ":" in args.device else args.worker_rank)


def start_cuda_context(ordinal: int) -> threading.Thread:
    """A thread that makes device `ordinal`'s primary CUDA context through the driver API."""
    def make():
        import ctypes
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            if lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(dev), ordinal) == 0:
                lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
        except OSError:
            pass
    t = threading.Thread(target=make, name="early-cuda-context", daemon=True)
    t.start()
    return t


def _since_exec() -> float:
    """Seconds from spawn until now (interpreter start-up and our imports).
    restartkit passes the spawn time; psutil's create_time is only as precise
    as the boot time it is computed from (whole seconds on some kernels)."""
    spawned = os.environ.get("RESTARTKIT_SPAWN_TIME")
    if spawned:
        try:
            return max(0.0, time.time() - float(spawned))
        except ValueError:
            pass
    try:
        import psutil
        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:
        return 0.0
