"""The reference engine's HTTP front: an OpenAI-compatible subset.

  GET  /health            200 only after a real forward pass ran; 503 before
  GET  /v1/models
  POST /v1/completions    text or token-id prompt (or a list of them), max_tokens, temperature, seed,
                          n, stop, logprobs (0..5), echo, stream, top_p, top_k, min_p, the penalties,
                          stop_token_ids, ignore_eos, min_tokens; each choice also carries token_ids
  POST /v1/chat/completions   messages through the tokenizer's chat template; logprobs, top_logprobs,
                          max_completion_tokens, n, stop, stream and the sampling fields.  Any other field is a
                          400 naming it (restartkit.reference.serving.protocol); a 503 says Retry-After.
                          Served through the scheduler (restartkit.reference.sched): serving_completions.py
  POST /tokenize, /detokenize; GET /version, /metrics   utility_routes.py
  With --api-key: /v1/*, /tokenize and /detokenize want Authorization: Bearer <key> (401)
  GET  /admin/stats       init phases and their times, load source, memory, the scheduler's counts
  POST /admin/drop_kv_cache   free the KV cache (before a snapshot)
  POST /admin/restore_kv_cache
  POST /admin/release_weights   let go of the weights mapped from the weight cache, and the KV cache
  POST /admin/reattach_weights  map them again ({"fallback": false}: a missing cache is an error), KV cache back
  POST /sleep, /wake_up; GET /is_sleeping   sleep mode (vLLM's interface)
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from restartkit.guard.admin import ADMIN_TOKEN_ENV

from restartkit.reference.log import log
from restartkit.reference.serving.admin_routes import ENGINE_ROUTES, AdminRoutes
from restartkit.reference.serving.serving_completions import CompletionRoutes
from restartkit.reference.serving.utility_routes import EngineMetrics, UtilityRoutes
from restartkit.reference.serving import reuseport
from restartkit.reference.serving.connections import KEEPALIVE_S, MAX_CONNECTIONS, REQUEST_READ_S, Bounded

MAX_BODY = 1 << 20
PROTECTED = ("/v1/", "/tokenize", "/detokenize")  # the routes an API key guards
# A request that finds the weights or the KV cache let go for a snapshot waits this long for them (State.back_in_time)
SNAPSHOT_HOLD_S = 30.0
READ_TIMEOUT_S = 60.0  # a connection that sends nothing for this long (mid-request, or idle between requests)


def _check_text(obj) -> None:
    """Every string in a parsed body is text (a lone surrogate escape, \\ud800, is not): UnicodeError."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            item.encode("utf-8")
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


class EngineServer(Bounded, ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default of 5 drops the SYNs of a burst of new clients while the accept thread waits
    # for the GIL: each dropped one costs its client a second or more before it retries
    request_queue_size = 1024
    QUEUED_IDLE_S = 2.0  # a connection found queued at stop that sends nothing is closed after this

    def __init__(self, addr, engine_state, reuse_port: bool = False, sock=None):
        """`sock`: a listening socket given to this engine (restartkit.process.listener: held by its
        supervisor, passed at spawn); `addr` is then not bound, and the socket outlives this engine."""
        self.reuse_port = reuse_port
        self.held = sock is not None
        self.serving = False  # serve_forever started (shutdown() waits for it to end: never call it before)
        super().__init__(addr, Handler, bind_and_activate=sock is None)
        if sock is not None:
            self.socket.close()
            self.socket = sock
            self.server_address = sock.getsockname()[:2]
        self.state = engine_state
        self.bound(getattr(engine_state, "max_connections", MAX_CONNECTIONS))

    def start(self) -> None:
        """Accept in a thread of its own."""
        self.serving = True
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def halt(self) -> None:
        """Stop accepting (a no-op when it never started)."""
        if self.serving:
            self.shutdown()
            self.serving = False

    def server_bind(self):
        if self.reuse_port:  # several engines on one port: how an overlapped restart hands over
            import socket
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()

    def handle_error(self, request, client_address):
        """A client that closed before its answer was written is one line of the log, not a traceback."""
        import sys
        err = sys.exc_info()[1]
        if isinstance(err, (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)):
            log(f"client {client_address[0]}:{client_address[1]} closed before its answer ({type(err).__name__})")
            return
        super().handle_error(request, client_address)

    def take_new_connections(self) -> bool:
        """Once ready, beside the engine before on the port: every new connection comes here
        (restartkit.reference.serving.reuseport); the one before finishes what it has."""
        return self.reuse_port and reuseport.take_new_connections(self.socket)

    def stop_listening(self) -> list[threading.Thread]:
        """Stop accepting, answer what is still queued on the listener, then close it.  Closing a listener
        resets the connections in its queue: clients that the kernel gave this engine (with SO_REUSEPORT,
        while its successor already listens beside it) would see a reset instead of an answer.  Returns
        the threads answering them.  A connection queued in the microseconds between the last accept and
        the close is still reset, unless the successor took every new connection (take_new_connections) or the
        kernel hands it over (net.ipv4.tcp_migrate_req = 1)."""
        self.state.stopping = True
        self.halt()
        end = time.monotonic() + 1.0  # connections accepted and sending reach a thread (and the drain) first
        while not self.waiting.idle() and time.monotonic() < end:
            time.sleep(0.01)
        threads = []
        if self.held:  # the service's socket: what is queued on it waits for the next engine, never reset
            self.server_close()
            return threads
        self.socket.setblocking(False)
        while True:
            try:
                conn, addr = self.socket.accept()
            except OSError:  # BlockingIOError: the queue is empty
                break
            conn.settimeout(self.QUEUED_IDLE_S)
            if not self.slots.acquire(timeout=self.QUEUED_IDLE_S):  # every thread busy past that: not answered
                self.shutdown_request(conn)
                continue
            t = threading.Thread(target=self.process_request_thread, args=(conn, addr), daemon=True)
            t.start()
            threads.append(t)
        self.server_close()
        return threads


class State:
    """What the handlers see: the engine (None while loading) and the tokenizer."""

    def __init__(self, model_name: str, api_key: str | None = None):
        self.model_name = model_name
        self.api_key = api_key  # clients send it to the PROTECTED routes (None: no key asked)
        # restartkit's admin token (restartkit.guard.admin), from the environment restartkit started it with; an
        # engine started by hand has none, and its admin routes answer loopback clients only, as before
        self.admin_token: str | None = os.environ.get(ADMIN_TOKEN_ENV) or None
        self.metrics = EngineMetrics(self)  # /metrics
        self.engine = None
        self.scheduler = None  # restartkit.reference.sched.scheduler.Scheduler: what requests and admin work go through
        self.tokenizer = None
        self.ready = False
        self.phases: dict[str, float] = {}
        self.started_at = time.time()
        self.ready_at: float | None = None
        self.requests = 0
        self.inflight = 0  # requests between being read and their answer written
        self.inflight_lock = threading.Lock()
        from restartkit.process.inflight import Counter
        self.inflight_count = Counter()  # where its supervisor reads it after a crash
        self.stopping = False  # /health says so; what reaches the engine is still answered, then its connection closed
        self.chat_template: str | None = None  # the tokenizer's, if it has one
        self.special_tokens: dict = {}
        self.sleeper = None  # set when the engine runs with --enable-sleep-mode
        self.prepared_mode = False
        self.sleep_public = False
        self.on_ready = None  # called once, when it became ready (start accepting on a given socket)
        self.listeners = None  # restartkit.reference.serving.detach.Listeners, where the engine serves on a held socket

    def drain(self, deadline_s: float = 30.0, queued: Iterable[threading.Thread] = (), others: int = 0) -> int:
        """Wait until every request in flight has its answer written, and the connections found queued at
        stop theirs (EngineServer.stop_listening); returns how many requests were left.  `others`: requests
        of the caller's own, not waited for (the request asking for the drain)."""
        end = time.monotonic() + deadline_s
        for t in queued:
            t.join(max(0.0, end - time.monotonic()))
        while self.inflight > others and time.monotonic() < end:
            time.sleep(0.005)
        return max(0, self.inflight - others)

    def back_in_time(self, deadline_s: float) -> bool:
        """For a request that finds the engine without its weights or KV cache, let go for a snapshot: wait
        up to `deadline_s` for them to come back (a dump takes seconds; its clients wait, never see a 503).
        False at once while it loads, sleeps (asked for by its operator) or stops."""
        end = time.monotonic() + deadline_s
        while not self.ready:
            if self.ready_at is None or self.stopping or (self.sleeper is not None and self.sleeper.asleep):
                return False
            if time.monotonic() >= end:
                return False
            time.sleep(0.01)
        return True


class Handler(CompletionRoutes, UtilityRoutes, AdminRoutes, BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: EngineServer

    def log_message(self, fmt, *args):  # keep the log to what matters
        pass

    # ---- plumbing -----------------------------------------------------------
    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if code == 503:  # loading, asleep, its KV cache dropped for a snapshot: back in a moment
            self.send_header("Retry-After", "1")
        if self.server.state.stopping:  # the next request goes to a new connection, to the engine after this one
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> None:
        self._send(code, {"error": {"message": message, "type": kind, "param": param, "code": code}})

    # ---- server-sent events (stream: true) ----------------------------------------
    def _events_begin(self) -> None:
        """A stream's head.  To an HTTP/1.1 client in chunks (Transfer-Encoding), so that its connection is kept for
        the next request (the front's to the engine: no connect and accept per request); to HTTP/1.0 the stream ends
        when the connection does."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self._chunked = self.request_version == "HTTP/1.1"
        if self._chunked:
            self.send_header("Transfer-Encoding", "chunked")
        if not self._chunked or self.server.state.stopping:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()

    def _event(self, obj) -> None:
        data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
        if getattr(self, "_chunked", False):
            data = b"%x\r\n%s\r\n" % (len(data), data)
        self.wfile.write(data)
        self.wfile.flush()

    def _events_end(self, whole: bool = True) -> None:
        """A stream's end: `whole` (after [DONE]), the last chunk, the connection kept; else the connection closed
        with no last chunk, so that the client sees the stream cut."""
        if getattr(self, "_chunked", False) and whole:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        else:
            self.close_connection = True
        self._chunked = False

    def _body(self) -> dict | None:
        """The request's JSON object, or None after a 4xx naming what is wrong with it (the connection is
        closed after one whose body could not be read to its end)."""
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            self._error(411, "chunked request bodies are not accepted: send Content-Length")
            return None
        text = self.headers.get("Content-Length") or "0"
        if not text.strip().isdigit():
            self.close_connection = True
            self._error(400, f"Content-Length {text[:40]!r} is not a byte count")
            return None
        length = int(text)
        if length > MAX_BODY:
            self.close_connection = True
            self._error(413, f"request body over {MAX_BODY} bytes")
            return None
        try:
            raw = self.rfile.read(length) if length else b"{}"
        except (TimeoutError, OSError):  # a timeout, or cut at its deadline
            raw = b""
        self.server.deadlines.set(self.connection, None)  # read whole: it is answered, however long that takes
        if len(raw) < length:  # the client stopped sending (or its read timed out): nothing more will come
            self.close_connection = True
            self._error(400, f"request body ended after {len(raw)} of {length} bytes (Content-Length)")
            return None
        try:
            body = json.loads((raw or b"{}").decode("utf-8"))
            _check_text(body)
        except UnicodeDecodeError as e:
            self._error(400, f"request body is not valid UTF-8 text: {e.reason} at byte {e.start}")
            return None
        except UnicodeEncodeError:
            self._error(400, "request body has a string that is not text (a lone UTF-16 surrogate escape)")
            return None
        except RecursionError:
            self._error(400, "request body is JSON nested too deeply")
            return None
        except ValueError as e:
            self._error(400, f"request body is not JSON: {e}")
            return None
        if not isinstance(body, dict):
            self._error(400, "request body must be a JSON object")
            return None
        return body

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (a malformed request line, headers too long) as OpenAI-shaped JSON."""
        self.close_connection = True
        if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":  # an unreadable request line: answer in 1.1
            self.request_version = "HTTP/1.1"
        try:
            self._error(code, message or explain or "malformed request")
        except OSError:
            pass

    def setup(self):
        super().setup()
        if self.connection.gettimeout() is None:  # a client that stops sending mid-request frees its thread
            self.connection.settimeout(READ_TIMEOUT_S)
        if self.connection.family in (socket.AF_INET, socket.AF_INET6):
            # each event of a stream leaves at once: a stream's last chunk (its end, on a kept connection) written
            # behind [DONE] would otherwise wait for the client's delayed ack (40 ms)
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def handle_one_request(self):
        """Each request: its first byte within KEEPALIVE_S (an idle keep-alive connection is closed), the rest
        of it within REQUEST_READ_S (restartkit.reference.serving.connections)."""
        deadlines = self.server.deadlines
        deadlines.set(self.connection, KEEPALIVE_S)
        try:
            if not self.rfile.peek(1):
                self.close_connection = True
                return
        except OSError:
            self.close_connection = True
            return
        deadlines.set(self.connection, REQUEST_READ_S)
        super().handle_one_request()

    # ---- routes -------------------------------------------------------------
    def _counted(self, handler) -> None:
        # From the parsed request to the last byte of its answer (an idle
        # keep-alive connection does not count), so a stopping engine answers
        # everything it accepted before it exits.
        st = self.server.state
        started = self._started = time.perf_counter()
        self._status = 0
        with st.inflight_lock:
            st.inflight += 1
            st.inflight_count.set(st.inflight)
        try:
            handler()
        finally:
            with st.inflight_lock:
                st.inflight -= 1
                st.inflight_count.set(st.inflight)
            self._observe(urlparse(self.path).path, started)

    def send_response(self, code, message=None):
        self._status = code  # for /metrics
        super().send_response(code, message)

    def do_GET(self):
        self.server.deadlines.set(self.connection, None)  # no body to wait for
        self._counted(self._get)

    def do_POST(self):
        self._counted(self._post)

    def _get(self):
        path = urlparse(self.path).path
        if not self._authorized(path):
            return
        st = self.server.state
        if path == "/health":
            if st.sleeper is not None and st.sleeper.asleep:
                self._send(503, {"status": "asleep", "level": st.sleeper.level})
            elif st.stopping:
                self._send(503, {"status": "stopping"})
            elif st.ready:
                self._send(200, {"status": "ready"})
            else:
                self._send(503, {"status": "loading"})
        elif path == "/is_sleeping":
            if st.sleeper is None:
                self._error(404, "sleep mode is off: start the engine with --enable-sleep-mode")
            else:
                self._send(200, {"is_sleeping": st.sleeper.asleep, "level": st.sleeper.level})
        elif path == "/v1/models":
            if not self._serving():  # clients take a model list as "ready": not before a completion would work
                return
            self._send(200, {"object": "list", "data": [
                {"id": st.model_name, "object": "model", "created": int(st.started_at), "owned_by": "restartkit",
                 "max_model_len": st.engine.options.max_model_len}]})  # as vLLM's list says it
        elif path == "/version":
            self._version()
        elif path == "/metrics":
            self._metrics()
        elif path == "/admin/stats":
            if self._admin_ok():
                self._send(200, self._stats())
        else:
            self._error(404, f"no route {path}")

    def _post(self):
        parsed = urlparse(self.path)
        path, query = parsed.path, parse_qs(parsed.query)
        if not self._authorized(path):
            return
        body = self._body()
        if body is None:
            return
        try:
            if path == "/v1/completions":
                self._complete(body, chat=False)
            elif path == "/v1/chat/completions":
                self._complete(body, chat=True)
            elif path == "/tokenize":
                self._tokenize(body)
            elif path == "/detokenize":
                self._detokenize(body)
            elif path in ("/sleep", "/wake_up"):
                self._sleep_or_wake(path, query)
            elif path.startswith("/admin/") and not self._admin_ok():
                return
            elif path in ENGINE_ROUTES and self.server.state.engine is None:  # a standby before its promotion
                self._error(409, f"{path}: this engine has no model loaded yet (a prepared standby is given it "
                                 "at its promotion)", "conflict")
            elif path.startswith("/admin/"):
                self._admin_post(path, body)
            else:
                self._error(404, f"no route {path}")
        except Exception as e:  # one bad request must not take the engine down
            log(f"error on {path}: {type(e).__name__}: {e}")
            self._error(500, f"{type(e).__name__}: {e}", "server_error")

    def _sleep_or_wake(self, path: str, query: dict) -> None:
        st = self.server.state
        if st.sleeper is None:
            self._error(404, "sleep mode is off: start the engine with --enable-sleep-mode")
            return
        if not st.sleep_public and not self._admin_ok():
            return
        from restartkit.reference.runtime.sleep import SleepError
        eng = st.engine
        try:
            with st.scheduler.exclusive():
                if path == "/sleep":
                    level = int((query.get("level") or ["1"])[0])
                    st.ready = False
                    info = st.sleeper.sleep(level)
                else:
                    tags = query.get("tags") or ["weights", "kv_cache"]
                    info = st.sleeper.wake(weights="weights" in tags, kv_cache="kv_cache" in tags)
                    st.ready = not st.sleeper.asleep and eng.model.cache_k is not None
        except SleepError as e:
            self._error(409, str(e), "conflict")
            return
        except (RuntimeError, MemoryError) as e:  # out of memory while waking: still asleep, weights kept
            log(f"{path} failed: {type(e).__name__}: {e}")
            self._error(507, f"{path} failed: {type(e).__name__}: {str(e)[:300]}; the engine is still asleep", "insufficient_storage")
            return
        log(f"{path}: {json.dumps(info)}")
        # vLLM's answer shape (status, level / tags), plus what this engine measured
        if path == "/sleep":
            head = {"status": "sleeping", "level": st.sleeper.level}
        else:
            awake = not st.sleeper.asleep and eng.model.cache_k is not None
            head = {"status": "awake" if awake else "sleeping", "tags": query.get("tags")}
        self._send(200, {**head, **info, "is_sleeping": st.sleeper.asleep})

    def _authorized(self, path: str) -> bool:
        """With an API key: the OpenAI routes want it (Authorization: Bearer); /health, /version, /metrics
        and the loopback-only admin routes do not.  A 401 otherwise."""
        import hmac
        key = self.server.state.api_key
        if key is None or not path.startswith(PROTECTED):
            return True
        sent = self.headers.get("Authorization") or ""
        if hmac.compare_digest(sent.encode(), f"Bearer {key}".encode()):
            return True
        self.close_connection = True  # its body, if any, is not read
        self._error(401, "a valid API key is needed: send Authorization: Bearer <key>", "authentication_error")
        return False

    def _serving(self) -> bool:
        st = self.server.state
        if st.sleeper is not None and st.sleeper.asleep:
            self._error(503, f"the engine is asleep (level {st.sleeper.level})", "unavailable")
            return False
        if not st.ready and not st.back_in_time(SNAPSHOT_HOLD_S):
            self._error(503, "the engine is not ready (loading, or its KV cache was dropped)", "unavailable")
            return False
        return True
