"""An engine that serves on its supervisor's held socket gives it up for a CRIU dump and takes it back.

CRIU dumps a listening TCP socket as an address to bind again at the restore, which the supervisor,
holding the service's socket, forbids.  So before a dump the engine closes its copy of the held
socket and serves restartkit's admin calls on a private loopback port instead (the dump holds that
one, free again when it is restored); restartkit releases the KV cache or the weights there, dumps,
re-attaches there, and then sends SIGUSR2: the engine takes the held socket back from its supervisor's
broker (restartkit.process.listener.engine_broker: an abstract address, reachable only from the
service's own network namespace) and accepts on it again.  While no engine accepts, clients wait in
the held socket's queue: nothing is refused.
"""
from __future__ import annotations

import threading

from restartkit.reference.serving.api import EngineServer
from restartkit.reference.log import log


# Requests the public listener accepted before it was given up are answered before the weights or the
# KV cache are let go (they would fail with a 503 otherwise), for at most this long.
DRAIN_S = 30.0


class DetachError(RuntimeError):
    """The listener could not be given up or taken back: the message says which and why."""


class Listeners:
    """The engine's public listener on a held socket, and the private admin port while it is given up."""

    def __init__(self, state, public: EngineServer):
        self.state = state
        self.public: EngineServer | None = public
        self.admin: EngineServer | None = None
        self.broker: str | None = None
        self.lock = threading.Lock()

    def detach(self, broker: str) -> int:
        """Close this engine's copy of the held socket; returns the private admin port that serves
        instead.  Called from a request thread of the public listener (its connection stays open)."""
        with self.lock:
            if self.public is None or not self.public.held:
                raise DetachError("this engine does not serve on a held socket: there is nothing to give up")
            if self.admin is None:
                self.admin = EngineServer(("127.0.0.1", 0), self.state)
                self.admin.start()
            self.broker = broker
            public, self.public = self.public, None
        public.halt()
        public.server_close()  # our copy only: the supervisor's socket stays open, and queues what comes
        left = self.state.drain(DRAIN_S, others=1)  # this call is one request in flight: the others finish
        port = self.admin.server_address[1]
        log(f"gave up the held socket for a dump; admin calls on 127.0.0.1:{port} until SIGUSR2"
            + (f" ({left} request(s) still in flight after {DRAIN_S:.0f} s)" if left else ""))
        return port

    def reattach(self) -> None:
        """SIGUSR2: take the held socket back from the broker and accept on it; close the private port."""
        from restartkit.process.listener import fetch_from
        with self.lock:
            if self.public is not None or self.broker is None:
                return  # not given up: a stray SIGUSR2 changes nothing
            held = fetch_from(self.broker, timeout_s=5.0)
            if held is None:
                log("SIGUSR2: no supervisor handed over the held socket; still serving on the private port only")
                return
            self.public = EngineServer(held.sock.getsockname()[:2], self.state, sock=held.sock)
            self.public.start()
            admin, self.admin, self.broker = self.admin, None, None
        if admin is not None:
            admin.halt()
            admin.server_close()
        host, port = self.public.server_address[:2]
        log(f"took the held socket back: serving on http://{host}:{port}")

    def stop_listening(self) -> list[threading.Thread]:
        """At stop: what the public listener (or, given up, the private one) still has queued."""
        with self.lock:
            servers = [s for s in (self.public, self.admin) if s is not None]
        return [t for srv in servers for t in srv.stop_listening()]
