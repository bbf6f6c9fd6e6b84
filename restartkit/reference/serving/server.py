"""The reference engine's process: start-up, the serving loop, signals, an overlapped
restart's prepared engine.  HTTP lives in api.py, the command line in args.py, engine
assembly in assemble.py, tensor-parallel workers in workers.py.

Run: python -m restartkit.reference.serving.server --model DIR [--port N] ...
SIGTERM/SIGINT: stop accepting, finish the request in flight, exit 0.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import threading
import time

from restartkit.reference.serving.api import EngineServer, State
from restartkit.reference.serving.args import parse_args
from restartkit.reference.serving.assemble import _load
from restartkit.reference.serving.detach import Listeners
from restartkit.reference.log import log
from restartkit.reference.serving.ready import take_ready_fd
from restartkit.reference.serving.workers import _stop_workers, serve_worker, spawn_workers
from restartkit.process.signals import block_stop_signals, next_stop_signal


def serve(args: argparse.Namespace) -> int:
    # long: start-up, the serving loop and the stop in the order they happen, each step's failure handled in place
    take_ready_fd()
    # SIGQUIT: every thread's stack to the log, the engine keeps running (a hang can be read, not guessed)
    faulthandler.register(signal.SIGQUIT, all_threads=True)
    if args.worker_rank > 0:
        return serve_worker(args)
    if args.prepare_only:
        return serve_prepared(args)
    state = State(args.served_model_name or os.path.basename(os.path.normpath(args.model)), args.api_key)
    state.max_connections = args.max_connections
    try:
        given = given_socket(args)
        # Bind first: a port in use is reported before minutes of loading.
        server = EngineServer((args.host, args.port), state, reuse_port=args.reuse_port and given is None, sock=given)
    except OSError as e:
        log(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}")
        return 98 if e.errno == 98 else 1
    # Signals are blocked in every thread and taken by the main thread alone,
    # with sigtimedwait: handlers do nothing, the loop below acts.
    block_stop_signals()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})  # take the held socket back (detach.py)
    listeners = state.listeners = Listeners(state, server)
    host, port = server.server_address[:2]
    if given is not None:  # its connections wait in the kernel's queue until this engine can answer them
        state.on_ready = server.start
        log(f"serving on the socket it was given (fd {given.fileno()}, http://{host}:{port}) once ready "
            f"(loading {args.model})")
    else:
        server.start()
        log(f"listening on http://{host}:{port} (loading {args.model})")
    workers = spawn_workers(args) if args.tensor_parallel_size > 1 else []
    outcome: dict = {}
    loader = threading.Thread(target=_load, args=(args, state, outcome), daemon=True)
    loader.start()
    taken = False
    while True:
        signo = next_stop_signal(0.2, also=frozenset({signal.SIGUSR2}))
        if signo == signal.SIGUSR2:
            listeners.reattach()
        elif signo is not None:
            break
        if state.ready and not taken:  # not while loading: it would draw clients to its 503s
            taken = True
            if server.take_new_connections():
                log("ready: taking every new connection from the engine beside it on the port")
        if "error" in outcome:
            log(f"start failed: {outcome['error']}")
            server.halt()
            _stop_workers(workers)
            return 1
        if dead := _dead_worker(workers):
            log(f"{dead}; stopping")
            server.halt()
            _stop_workers(workers)
            os._exit(1)  # rank 0 may be blocked in a collective with the dead rank
    log(f"received {signal.Signals(signo).name}; finishing in-flight requests")
    # Close the listener first (with SO_REUSEPORT the other engine takes new connections at once), answering
    # those already queued on it; the engine stays ready for what it accepted.
    left = state.drain(queued=listeners.stop_listening())
    if state.engine is not None:
        state.engine.shutdown_workers()
    _stop_workers(workers)
    log("stopped" + (f" ({left} requests still in flight after 30 s)" if left else ""))
    return 0


def given_socket(args):
    """The listening socket this engine was given (--listen-fd, or LISTEN_FDS from socket activation), or
    None: it binds --host/--port itself."""
    import socket
    if args.listen_fd is not None:
        sock = socket.socket(fileno=args.listen_fd)
    else:
        from restartkit.process.listener import from_systemd
        held = from_systemd()
        sock = held.sock if held is not None else None
    if sock is not None:
        sock.set_inheritable(False)  # its tensor-parallel workers never accept
    return sock


def _write_status(path: str | None, **data) -> None:
    if path:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "at": time.time(), **data}, f)
        os.replace(tmp, path)


def serve_prepared(args: argparse.Namespace) -> int:
    """The new engine of an overlapped restart.  It serves on a private
    loopback port at once (so its supervisor can check it alone), prepares
    while the old engine still serves, waits for SIGUSR1 (with a deadline),
    activates, waits for SIGUSR2 (the supervisor has checked it on the
    private port), and only then binds the public port beside the old engine
    (SO_REUSEPORT).  Stop signals work at every step."""
    # long: the hand-over's steps in the order they happen, each with its deadline and its stop check
    state = State(args.served_model_name or os.path.basename(os.path.normpath(args.model)), args.api_key)
    state.max_connections = args.max_connections
    state.prepared_mode = True
    given = given_socket(args)  # the service's socket: accepted on once promoted
    private = EngineServer(("127.0.0.1", 0), state)
    admin_port = private.server_address[1]
    signals = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    private.start()
    _write_status(args.status_file, state="preparing", admin_port=admin_port)
    log(f"preparing (private port {admin_port}); the public port {args.port} is taken on activation")
    outcome: dict = {}
    activate = threading.Event()
    if args.activate_ahead:  # a standby with memory to spare: its KV cache and graph are ready before it is needed
        activate.set()
    workers, go, prepared = _prepared_workers(args)

    def gate():
        if workers:  # prepared means every rank prepared
            _read_exactly(prepared, len(workers), "a tensor-parallel worker exited while it prepared")
        _write_status(args.status_file, state="prepared", admin_port=admin_port, phases=state.phases)
        log("prepared; waiting for SIGUSR1 to activate")
        if not activate.wait(args.activate_timeout):
            raise TimeoutError(f"not activated within {args.activate_timeout:.0f} s")
        if go is not None:  # the other ranks activate with this one (their KV caches, the warm-up's collectives)
            os.write(go, b"x" * len(workers))

    threading.Thread(target=_load, args=(args, state, outcome, gate), daemon=True).start()
    public, publish, announced = None, False, False
    while True:
        info = signal.sigtimedwait(signals, 0.05)
        signo = info.si_signo if info is not None and info.si_signo in signals else None
        if signo == signal.SIGUSR1:
            activate.set()
        elif signo == signal.SIGUSR2:
            publish = True
        elif signo is not None:
            break
        if state.ready and not announced:
            _write_status(args.status_file, state="active", admin_port=admin_port, phases=state.phases)
            announced = True
        if error := outcome.get("error") or _dead_worker(workers):
            log(f"start failed: {error}")
            _write_status(args.status_file, state="failed", admin_port=admin_port, error=error)
            os._exit(1)  # rank 0 may be blocked in a collective with a dead rank; the others die with this one
        if state.ready and publish and public is None:
            try:
                public = EngineServer((args.host, args.port), state, reuse_port=given is None, sock=given)
            except OSError as e:
                _write_status(args.status_file, state="failed", admin_port=admin_port,
                              error=f"cannot listen on {args.host}:{args.port}: {e.strerror}")
                return 98
            public.start()
            took = public.take_new_connections()  # before "ready": then restartkit stops the engine before
            # promoted: it listens where the service does and nowhere else (the private port served restartkit's
            # checks before; with the whole API on it, it must not outlive them)
            private.halt()
            private.server_close()
            private = None
            _write_status(args.status_file, state="ready", phases=state.phases)
            log(f"active: listening on http://{args.host}:{args.port}, its private port closed"
                + (", taking every new connection" if took else ""))
    log(f"received {signal.Signals(signo).name}; finishing in-flight requests")
    queued = [t for srv in (public, private) if srv is not None for t in srv.stop_listening()]
    state.drain(queued=queued)
    if state.engine is not None:
        state.engine.shutdown_workers()
    if go is not None:
        os.close(go)  # workers still waiting to activate see EOF and exit
    _stop_workers(workers)
    log("stopped")
    return 0


def _prepared_workers(args) -> tuple[list, int | None, int | None]:
    """Tensor parallel in prepare-only mode: ranks 1..tp-1, each saying on a pipe when it is prepared and
    waiting on another for this rank's go (workers.spawn_workers); (workers, go's write end, prepared's
    read end)."""
    if args.tensor_parallel_size == 1:
        return [], None, None
    go_r, go_w = os.pipe()
    prepared_r, prepared_w = os.pipe()
    try:
        return spawn_workers(args, gate=(go_r, prepared_w)), go_w, prepared_r
    finally:
        os.close(go_r)
        os.close(prepared_w)


def _dead_worker(workers) -> str | None:
    """What a tensor-parallel worker that exited left to say (rank 0 alone cannot serve), or None."""
    dead = next((w for w in workers if w.poll() is not None), None)
    return None if dead is None else f"tensor-parallel worker PID {dead.pid} exited with code {dead.returncode}"


def _read_exactly(fd: int, n: int, eof: str) -> None:
    got = 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            raise RuntimeError(eof)
        got += len(chunk)


def main(argv=None) -> int:
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # idle clients cost a descriptor each (not a thread)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 1 << 16) if hard != resource.RLIM_INFINITY else 1 << 16,
                                                    hard))
    return serve(parse_args(argv))


if __name__ == "__main__":
    code = main()
    # Drained and stopped: what is left is the interpreter's teardown (torch's, CUDA's), half a
    # second or more that the next engine, or a CRIU restore waiting for this PID, would wait on
    # for nothing.  The kernel and the driver free the memory either way.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
