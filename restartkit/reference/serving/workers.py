"""Tensor parallelism: ranks 1..tp-1 run as child processes of rank 0 and die with it."""
from __future__ import annotations

import os
import signal
import sys

from restartkit.reference.serving.args import _rebuild_argv
from restartkit.reference.serving.assemble import _early_cuda_context, _make_engine, _start_engine
from restartkit.reference.serving.ready import READY_FD_ENV


def spawn_workers(args, gate: tuple[int, int] | None = None) -> list:
    """Ranks 1..tp-1 as child processes that die with this one.  `gate` (a prepare-only rank 0): the fds
    the workers keep between preparing and activating, (go, prepared): each says it is prepared with one
    byte on `prepared`, then waits for one byte on `go` (EOF: rank 0 is gone), so that it allocates
    nothing and blocks in no collective while a standby waits."""
    import subprocess
    if not args.dist_port:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.dist_port = s.getsockname()[1]
    base = [sys.executable, "-m", "restartkit.reference.serving.server"] + _rebuild_argv(args)
    if gate is not None:
        base += ["--gate-fds", f"{gate[0]},{gate[1]}"]
    procs = []
    for rank in range(1, args.tensor_parallel_size):
        env = {k: v for k, v in os.environ.items() if k != READY_FD_ENV}  # the ready pipe is rank 0's
        procs.append(subprocess.Popen(base + ["--worker-rank", str(rank)], env=env, preexec_fn=_die_with_parent,
                                      pass_fds=gate or ()))
    return procs


def _gate(fds: str):
    """A prepared worker's gate: say it is prepared, wait for rank 0's go; rank 0 gone (EOF) ends it."""
    go, prepared = map(int, fds.split(","))

    def wait() -> None:
        os.write(prepared, b"x")
        os.close(prepared)
        got = os.read(go, 1)
        os.close(go)
        if not got:
            os._exit(0)  # rank 0 stopped before activating: nothing to serve
    return wait


def _die_with_parent() -> None:
    from restartkit.process.signals import set_parent_death_signal
    set_parent_death_signal(signal.SIGKILL)


def _stop_workers(workers) -> None:
    for w in workers:
        try:
            w.wait(timeout=5)
        except Exception:
            w.kill()


def serve_worker(args) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when workers stop
    context = _early_cuda_context(args)
    engine = _make_engine(args)  # imports torch
    if context is not None:
        context.join()
    _start_engine(engine, args, _gate(args.gate_fds) if args.gate_fds else None)
    engine.worker_loop()
    return 0
