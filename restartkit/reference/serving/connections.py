"""The HTTP surface's connections, bounded: at most `max_connections` at once (the rest wait in the listening
socket's queue, unaccepted, and no thread is made for them), a request read whole within REQUEST_READ_S of its
first byte (a slow-loris client is cut, whatever its pace), and a keep-alive connection idle for KEEPALIVE_S closed.

One thread (Deadlines) watches every connection's deadline and shuts the late ones down; the handler's thread
then finds its socket closed and ends."""
from __future__ import annotations

import os
import socket
import threading
import time

KEEPALIVE_S = 5.0  # between requests on one connection (uvicorn's default)
REQUEST_READ_S = 30.0  # from a request's first byte to the end of its body
MAX_CONNECTIONS = 1024


def quiet_signals() -> None:
    """This thread takes no stop signal: the engine's main thread takes them (with sigtimedwait)."""
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                                              signal.SIGUSR2})


class Deadlines:
    """Connections with a time by which they must have sent what they owe, and the thread that cuts them."""

    def __init__(self, every_s: float = 0.5):
        self.every_s = every_s
        self.lock = threading.Lock()
        self.due: dict[socket.socket, float] = {}
        self.cut = 0  # connections shut down for missing their deadline
        self._thread: threading.Thread | None = None

    def set(self, conn: socket.socket, seconds: float | None) -> None:
        """`conn` must have sent its request within `seconds` (None: nothing owed now, it is being answered)."""
        with self.lock:
            if seconds is None:
                self.due.pop(conn, None)
            else:
                self.due[conn] = time.monotonic() + seconds
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="http-deadlines", daemon=True)
                self._thread.start()

    def forget(self, conn: socket.socket) -> None:
        with self.lock:
            self.due.pop(conn, None)

    def _run(self) -> None:
        quiet_signals()
        while True:
            time.sleep(self.every_s)
            now = time.monotonic()
            with self.lock:
                late = [c for c, t in self.due.items() if t <= now]
                for c in late:
                    del self.due[c]
            for c in late:
                self.cut += 1
                try:
                    c.shutdown(socket.SHUT_RDWR)  # its thread's read returns at once, and the thread ends
                except OSError:
                    pass


class Bounded:
    """Mixed into the HTTP server (before ThreadingHTTPServer): an accepted connection gets no thread until it
    sends (Waiting holds the silent ones, closing those silent past KEEPALIVE_S), and at most max_connections
    threads answer at once; a readable connection waits for a free one."""

    def bound(self, max_connections: int) -> None:
        from restartkit.guard import peer
        self.slots = threading.BoundedSemaphore(max_connections)
        self.deadlines = Deadlines()
        self.waiting = Waiting(self)
        self.owners = peer.owners()  # behind supervise's front: its owner's connections only (restartkit.guard.peer)
        self.refused = 0

    def process_request(self, request, client_address):
        import select
        if self.owners is not None and not self._owner_asks(request):
            return
        if self.slots.acquire(blocking=False):  # it has sent already (the usual client): its thread at once
            poll = select.poll()  # (select() cannot take a descriptor past 1023)
            poll.register(request, select.POLLIN)
            if poll.poll(0):
                self.dispatch(request, client_address)
                return
            self.slots.release()
        self.waiting.add(request, client_address)

    def _owner_asks(self, conn) -> bool:
        """Whether the client's socket is the engine's user's (or root's); if not, it gets a 403 and is closed
        (in a thread: its request is read first, so that the close sends the answer, not a reset)."""
        from restartkit.guard import peer
        uid = peer.peer_uid(conn)
        if uid in self.owners:
            return True
        self.refused += 1
        if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
            from restartkit.reference.log import log
            log(f"refused a connection of uid {uid} (this engine answers its owner only, behind the front; "
                f"{self.refused} so far)")
        threading.Thread(target=_refuse, args=(self, conn, peer.refusal(uid, self.server_address[1])),
                         name="http-refuse", daemon=True).start()
        return False

    def dispatch(self, request, client_address) -> None:
        """A connection that has sent something, with a slot held for it: its thread."""
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            self.shutdown_request(request)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.deadlines.forget(request)
            self.slots.release()


def _refuse(server, conn, answer: bytes) -> None:
    try:
        conn.settimeout(1.0)
        conn.recv(65536)  # its request (what it sent first), so that closing does not reset the connection
        conn.sendall(answer)
        conn.shutdown(socket.SHUT_WR)
        while conn.recv(65536):
            pass
    except OSError:
        pass
    server.shutdown_request(conn)


class Waiting:
    """Accepted connections that have sent nothing yet, in one selector thread: a connection that becomes readable
    goes to a thread as soon as a slot is free; one silent for KEEPALIVE_S is closed.  So idle connections cost a
    file descriptor each, not a thread, and never stand before a client that sends."""

    def __init__(self, server):
        import selectors
        self.server = server
        self.selector = selectors.DefaultSelector()
        self.lock = threading.Lock()
        self.added: list = []
        self.ready: list = []  # readable, waiting for a slot
        self.closed = 0  # silent past KEEPALIVE_S
        # an eventfd, not a pipe: nothing of it can point outside the process (a CRIU image holds it whole)
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.selector.register(self._wake, selectors.EVENT_READ, None)
        self._thread: threading.Thread | None = None

    def add(self, conn, address) -> None:
        with self.lock:
            self.added.append((conn, address, time.monotonic() + KEEPALIVE_S))
            if self._thread is None:  # made by the accepting thread, so with its signal mask (the engine takes
                # its stop signals in its main thread alone: a thread made earlier would die of a SIGTERM)
                self._thread = threading.Thread(target=self._run, name="http-waiting", daemon=True)
                self._thread.start()
        os.eventfd_write(self._wake, 1)

    def idle(self) -> bool:
        """Nothing added or readable waits for a thread (a stopping engine lets these reach one first)."""
        with self.lock:
            return not self.added and not self.ready

    def _run(self) -> None:
        import selectors
        quiet_signals()
        while True:
            for key, _ in self.selector.select(timeout=0.5 if not self.ready else 0.02):
                if key.data is None:
                    try:
                        os.eventfd_read(self._wake)
                    except BlockingIOError:
                        pass
                    continue
                self.selector.unregister(key.fileobj)
                self.ready.append(key.data[:2])
            with self.lock:
                added, self.added = self.added, []
            for conn, address, due in added:
                try:
                    self.selector.register(conn, selectors.EVENT_READ, (conn, address, due))
                except (ValueError, OSError):  # closed meanwhile
                    pass
            while self.ready and self.server.slots.acquire(blocking=False):
                self.server.dispatch(*self.ready.pop(0))
            self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        late = [key for key in list(self.selector.get_map().values()) if key.data is not None and key.data[2] <= now]
        for key in late:
            self.selector.unregister(key.fileobj)
            self.closed += 1
            self.server.shutdown_request(key.data[0])
