"""The reference engine's HTTP front: an OpenAI-compatible subset.

  GET  /health            200 only after a real forward pass ran; 503 before
  GET  /v1/models
  POST /v1/completions    text or token-id prompt (or a list of them), max_tokens, temperature, seed,
                          n, stop, logprobs (0..5), echo, stream; each choice also carries token_ids
  POST /v1/chat/completions   messages through the tokenizer's chat template; logprobs, top_logprobs,
                          max_completion_tokens, n, stop, stream.  Any other field is a 400 naming it
                          (restartkit.reference.serving.completions); a 503 says Retry-After
  GET  /admin/stats       init phases and their times, load source, memory
  POST /admin/drop_kv_cache   free the KV cache (before a snapshot)
  POST /admin/restore_kv_cache
  POST /admin/release_weights   let go of the weights mapped from the weight cache, and the KV cache
  POST /admin/reattach_weights  map them again ({"fallback": false}: a missing cache is an error), KV cache back
  POST /sleep, /wake_up; GET /is_sleeping   sleep mode (vLLM's interface)
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from restartkit.reference.log import log
from restartkit.reference.serving import reuseport

MAX_BODY = 1 << 20


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """A text prompt's token ids with the special tokens the tokenizer itself adds (its post-processor:
    BOS for Llama 3's, nothing for one without), as transformers encodes it."""
    return tokenizer.encode(prompt).ids


class EngineServer(ThreadingHTTPServer):
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
            t = threading.Thread(target=self.process_request_thread, args=(conn, addr), daemon=True)
            t.start()
            threads.append(t)
        self.server_close()
        return threads


class State:
    """What the handlers see: the engine (None while loading) and the tokenizer."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.engine = None
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

    def drain(self, deadline_s: float = 30.0, queued: Iterable[threading.Thread] = ()) -> int:
        """Wait until every request in flight has its answer written, and the connections found queued at
        stop theirs (EngineServer.stop_listening); returns how many requests were left."""
        end = time.monotonic() + deadline_s
        for t in queued:
            t.join(max(0.0, end - time.monotonic()))
        while self.inflight and time.monotonic() < end:
            time.sleep(0.005)
        return self.inflight


class Handler(BaseHTTPRequestHandler):
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
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the stream ends when the connection does
        self.end_headers()
        self.close_connection = True

    def _event(self, obj) -> None:
        self.wfile.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")
        self.wfile.flush()

    def _body(self) -> dict | None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self._error(413, f"request body over {MAX_BODY} bytes")
            return None
        raw = self.rfile.read(length) if length else b"{}"
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError as e:
            self._error(400, f"request body is not JSON: {e}")
            return None
        if not isinstance(body, dict):
            self._error(400, "request body must be a JSON object")
            return None
        return body

    # ---- routes -------------------------------------------------------------
    def _counted(self, handler) -> None:
        # From the parsed request to the last byte of its answer (an idle
        # keep-alive connection does not count), so a stopping engine answers
        # everything it accepted before it exits.
        st = self.server.state
        with st.inflight_lock:
            st.inflight += 1
            st.inflight_count.set(st.inflight)
        try:
            handler()
        finally:
            with st.inflight_lock:
                st.inflight -= 1
                st.inflight_count.set(st.inflight)

    def do_GET(self):
        self._counted(self._get)

    def do_POST(self):
        self._counted(self._post)

    def _get(self):
        path = urlparse(self.path).path
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
                {"id": st.model_name, "object": "model", "created": int(st.started_at), "owned_by": "restartkit"}]})
        elif path == "/admin/stats":
            if self._local_only():
                self._send(200, self._stats())
        else:
            self._error(404, f"no route {path}")

    def _post(self):
        parsed = urlparse(self.path)
        path, query = parsed.path, parse_qs(parsed.query)
        body = self._body()
        if body is None:
            return
        try:
            if path == "/v1/completions":
                self._complete(body, chat=False)
            elif path == "/v1/chat/completions":
                self._complete(body, chat=True)
            elif path in ("/sleep", "/wake_up"):
                self._sleep_or_wake(path, query)
            elif path.startswith("/admin/") and not self._local_only():
                return
            elif path == "/admin/detach_listener":
                self._admin_detach(body)
            elif path == "/admin/drop_kv_cache":
                self._admin_drop_kv()
            elif path == "/admin/release_weights":
                self.server.state.ready = False
                try:
                    self._send(200, self.server.state.engine.release_weights())
                except ValueError as e:
                    self.server.state.ready = self.server.state.engine.model is not None
                    self._error(409, str(e), "conflict")
            elif path == "/admin/reattach_weights":
                fallback = bool((body or {}).get("fallback", False))
                try:
                    info = self.server.state.engine.reattach_weights(fallback=fallback)
                except RuntimeError as e:  # the loader: the weight cache is gone or holds other weights
                    self._error(409, str(e), "conflict")
                    return
                self.server.state.ready = True
                self._send(200, {"load": info, "kv_cache_bytes": self.server.state.engine.model.kv_cache_bytes})
            elif path == "/admin/restore_kv_cache":
                self.server.state.engine.restore_kv_cache()
                self.server.state.ready = True
                self._send(200, {"kv_cache_bytes": self.server.state.engine.model.kv_cache_bytes})
            else:
                self._error(404, f"no route {path}")
        except Exception as e:  # one bad request must not take the engine down
            log(f"error on {path}: {type(e).__name__}: {e}")
            self._error(500, f"{type(e).__name__}: {e}", "server_error")

    def _admin_detach(self, body: dict) -> None:
        broker = body.get("broker")
        if not isinstance(broker, str) or not broker:
            self._error(400, "'broker' must name the address to take the held socket back from", param="broker")
            return
        if self.server.state.listeners is None:
            self._error(409, "this engine serves no held socket", "conflict")
            return
        try:
            self._send(200, {"admin_port": self.server.state.listeners.detach(broker)})
        except RuntimeError as e:  # detach.DetachError: nothing to give up
            self._error(409, str(e), "conflict")

    def _sleep_or_wake(self, path: str, query: dict) -> None:
        st = self.server.state
        if st.sleeper is None:
            self._error(404, "sleep mode is off: start the engine with --enable-sleep-mode")
            return
        if not st.sleep_public and not self._from_this_host():
            self._error(403, "sleep endpoints answer on loopback only (--sleep-endpoints-public to change that)")
            return
        from restartkit.reference.runtime.sleep import SleepError
        eng = st.engine
        try:
            with eng.lock:
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

    def _from_this_host(self) -> bool:
        """Loopback, or this host calling the specific address the server binds (restartkit does
        that when [service] host names one): another host cannot open a TCP connection from it."""
        client = self.client_address[0]
        bound = self.server.server_address[0]
        return client in ("127.0.0.1", "::1") or client.startswith("127.") or (
            bound not in ("0.0.0.0", "::", "") and client == bound)

    def _local_only(self) -> bool:
        """Admin endpoints (stats, KV-cache drop) answer this host only; a 403 otherwise."""
        if self._from_this_host():
            return True
        self._error(403, "admin endpoints answer on loopback only", "forbidden")
        return False

    def _serving(self) -> bool:
        st = self.server.state
        if st.sleeper is not None and st.sleeper.asleep:
            self._error(503, f"the engine is asleep (level {st.sleeper.level})", "unavailable")
            return False
        if not st.ready:
            self._error(503, "the engine is not ready (loading, or its KV cache was dropped)", "unavailable")
            return False
        return True

    def _stats(self) -> dict:
        st = self.server.state
        eng = st.engine
        out = {
            "pid": os.getpid(), "ready": st.ready and not st.stopping, "model": st.model_name,
            "phases": st.phases, "requests": st.requests,
            "started_at": st.started_at, "ready_at": st.ready_at,
        }
        if st.sleeper is not None:
            out["sleep"] = {"enabled": True, "level": st.sleeper.level, "last": st.sleeper.last}
        if eng is not None and eng.model is not None:
            out.update(load=eng.load_info, device=str(eng.device), dtype=str(eng.dtype).replace("torch.", ""),
                       # can a new engine serve beside it on its port (an overlapped hand-over)?
                       reuse_port=getattr(self.server, "reuse_port", False) or st.prepared_mode or self.server.held,
                       held_socket=self.server.held,
                       weight_bytes=eng.weight_bytes(), kv_cache_bytes=eng.model.kv_cache_bytes,
                       cuda_graph=eng._graph is not None)
            if eng.draft is not None:
                out["speculative"] = {"draft_model": eng.draft.options.model, "tokens": eng.spec_tokens,
                                      **eng.spec_counts}
        try:  # resident pages (psutil's import alone costs tens of ms on a busy start)
            with open("/proc/self/statm") as f:
                out["rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            pass
        return out

    def _admin_drop_kv(self):
        eng = self.server.state.engine
        self.server.state.ready = False
        freed = eng.drop_kv_cache()
        self._send(200, {"freed_bytes": freed})

    def _complete(self, body: dict, chat: bool) -> None:
        """/v1/completions and /v1/chat/completions, streamed (server-sent events ending in [DONE]) or not;
        n choices per prompt, stop strings, logprobs, echo (restartkit.reference.serving.completions)."""
        from restartkit.reference.serving.completions import BadRequest, read_chat, read_completion
        from restartkit.reference.runtime.engine import EngineNotReady
        st = self.server.state
        if not self._serving():
            return
        t0 = time.perf_counter()
        try:
            ask = (read_chat(body, st.tokenizer, st.chat_template, st.special_tokens) if chat
                   else read_completion(body, st.tokenizer, encode_prompt))
        except BadRequest as e:
            self._error(400, str(e), param=e.param)
            return
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        if ask.stream:
            self._events_begin()
            if chat:  # the assistant's turn opens
                self._event(self._chunk(ask, 0, {"role": "assistant", "content": ""}, None))
        try:
            choices = self._choices(ask, usage)
        except EngineNotReady as e:  # it went to sleep (or dropped its cache) after the check above
            if ask.stream:
                return  # the stream ends without [DONE]: the client sees it cut
            self._error(503, f"the engine is not ready: {e}", "unavailable")
            return
        except ValueError as e:
            if ask.stream:
                self._event({"error": {"message": str(e), "type": "invalid_request_error", "code": 400}})
                return
            self._error(400, str(e))
            return
        except OSError:  # the client went away mid-stream
            return
        st.requests += 1
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if ask.stream:
            if ask.include_usage:
                self._event({**self._head(ask), "choices": [], "usage": usage})
            self._event(b"[DONE]")
        else:
            self._send(200, {**self._head(ask), "choices": choices, "usage": usage,
                             "system_fingerprint": f"restartkit-ref-{os.getpid()}"})
        if "first_request" not in st.phases:  # after a restart, restartkit's readiness probe
            st.phases["first_request"] = round(time.perf_counter() - t0, 4)

    def _choices(self, ask, usage: dict) -> list[dict]:
        """n choices for each prompt, each streamed as its tokens come when asked (each chunk with the logprobs
        of the tokens its text completes); the choices (not streamed)."""
        from restartkit.reference.serving.completions import TextSoFar
        st, chat, choices = self.server.state, ask.chat, []
        for pi, ids in enumerate(ask.prompts):
            usage["prompt_tokens"] += len(ids)
            for j in range(ask.n):
                index = pi * ask.n + j
                if ask.stream and ask.echo:
                    self._event(self._chunk(ask, index, ask.prompt_texts[pi], None))
                so_far = TextSoFar(st.tokenizer, ask.stop)
                stream = _Streamed(self, ask, index, so_far) if ask.stream else None
                so_far.send = stream
                max_tokens = ask.max_tokens or max(1, st.engine.options.max_model_len - len(ids))
                # choice j of n samples with its own seed (greedy choices are alike whatever the seed)
                seed = ask.seed + j if ask.seed is not None else None if j == 0 else st.engine.options.seed + j
                comp = st.engine.generate(ids, max_tokens, ask.temperature, seed, want_logprobs=ask.want_logprobs,
                                          top_logprobs=ask.top_logprobs, on_token=so_far)
                text = so_far.finish(comp.tokens)
                finish = "stop" if so_far.stopped else comp.finish_reason
                usage["completion_tokens"] += len(comp.tokens)
                if stream is not None:  # the last chunk: the finish reason, the logprobs of what remains (an EOS)
                    self._event(self._chunk(ask, index, {} if chat else "", finish,
                                            stream.logprobs(comp.tokens, comp.logprobs, comp.top_logprobs)))
                else:
                    choices.append(self._choice(ask, index, (ask.prompt_texts[pi] if ask.echo else "") + text,
                                                finish, comp))
        return choices

    def _head(self, ask, chunk: bool = False) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if ask.chat else "text_completion"
        return {"id": f"{'chatcmpl' if ask.chat else 'cmpl'}-{ask.id}", "object": kind, "created": ask.created,
                "model": self.server.state.model_name}

    def _chunk(self, ask, index: int, piece, finish, logprobs=None) -> dict:
        if ask.chat:
            delta = piece if isinstance(piece, dict) else {"content": piece}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": piece, "logprobs": logprobs, "finish_reason": finish}
        return {**self._head(ask, chunk=True), "choices": [choice]}

    def _choice(self, ask, index: int, text: str, finish: str, comp) -> dict:
        logprobs = self._logprobs(ask, comp) if ask.want_logprobs else None
        if ask.chat:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": finish, "token_ids": comp.tokens}
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs,
                "token_ids": comp.tokens, "prompt_token_ids": comp.prompt_tokens}

    def _logprobs(self, ask, comp) -> dict:
        return self._logprobs_of(ask, comp.tokens, comp.logprobs, comp.top_logprobs)

    def _logprobs_of(self, ask, tokens: list[int], lps: list, tops: list | None, at: int = 0) -> dict:
        """OpenAI's logprobs for these tokens (chat: `content`; completions: tokens, token_logprobs,
        top_logprobs, text_offset counted from `at`)."""
        tok = self.server.state.tokenizer
        names = [tok.id_to_token(t) or "" for t in tokens]
        each_top = tops or [None] * len(tokens)
        if ask.chat:
            def entry(t, lp):
                piece = tok.decode([t], skip_special_tokens=False)
                return {"token": piece, "logprob": lp, "bytes": list(piece.encode())}
            return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in (top or {}).items()]}
                                for t, lp, top in zip(tokens, lps, each_top)]}
        offsets = []
        for t in tokens:
            offsets.append(at)
            at += len(tok.decode([t], skip_special_tokens=True))
        return {"tokens": names, "token_logprobs": list(lps),
                "top_logprobs": [{tok.id_to_token(i) or "": v for i, v in top.items()} for top in each_top]
                if tops else None, "text_offset": offsets}


class _Streamed:
    """One streamed choice: each piece of text TextSoFar lets go is a chunk, with the logprobs of the
    tokens it completes (when asked), their text offsets running on from the chunk before."""

    def __init__(self, handler, ask, index: int, so_far):
        self.handler, self.ask, self.index, self.so_far = handler, ask, index, so_far
        self.done, self.at = 0, 0  # tokens whose logprobs were sent; the text offset after them

    def __call__(self, piece: str) -> None:
        sf = self.so_far
        lps = self.logprobs(sf.tokens, sf.logprobs, sf.top_logprobs if self.ask.top_logprobs else None)
        self.handler._event(self.handler._chunk(self.ask, self.index, piece, None, lps))

    def logprobs(self, tokens: list[int], lps: list | None, tops: list | None) -> dict | None:
        """The logprobs of tokens[done:] (None when not asked, or none is left), counted as sent."""
        first, self.done = self.done, len(tokens)
        if not self.ask.want_logprobs or first >= len(tokens):
            return None
        out = self.handler._logprobs_of(self.ask, tokens[first:], lps[first:], tops[first:] if tops else None, self.at)
        if not self.ask.chat:  # the offset after these tokens: the last one's, plus its text
            tok = self.handler.server.state.tokenizer
            self.at = out["text_offset"][-1] + len(tok.decode([tokens[-1]], skip_special_tokens=True))
        return out
