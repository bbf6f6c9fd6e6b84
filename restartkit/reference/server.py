"""HTTP front of the reference engine: an OpenAI-compatible subset.

  GET  /health            200 only after a real forward pass ran; 503 before
  GET  /v1/models
  POST /v1/completions    text or token-id prompt, max_tokens, temperature,
                          seed, logprobs; each choice also carries token_ids
  GET  /admin/stats       init phases and their times, load source, memory
  POST /admin/drop_kv_cache   free the KV cache (before a snapshot)
  POST /admin/restore_kv_cache

Run: python -m restartkit.reference.server --model DIR [--port N] ...
SIGTERM/SIGINT: stop accepting, finish the request in flight, exit 0.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from restartkit.signals import block_stop_signals, next_stop_signal

PROCESS_T0 = time.time()
MAX_BODY = 1 << 20
_READY_FD: str | None = None  # restartkit's ready pipe (RESTARTKIT_READY_FD), until it is written


def log(msg: str) -> None:
    print(f"[engine {os.getpid()}] {msg}", file=sys.stderr, flush=True)


class EngineServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr, engine_state, reuse_port: bool = False):
        self.reuse_port = reuse_port
        super().__init__(addr, Handler)
        self.state = engine_state

    def server_bind(self):
        if self.reuse_port:  # several engines on one port: how an overlapped restart hands over
            import socket
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()


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
        self.sleeper = None  # set when the engine runs with --enable-sleep-mode
        self.prepared_mode = False
        self.sleep_public = False

    def drain(self, deadline_s: float = 30.0) -> int:
        """Wait until every request in flight has its answer written; returns how many were left."""
        end = time.monotonic() + deadline_s
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
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str, kind: str = "invalid_request_error") -> None:
        self._send(code, {"error": {"message": message, "type": kind, "code": code}})

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
        try:
            handler()
        finally:
            with st.inflight_lock:
                st.inflight -= 1

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
                self._completions(body)
            elif path in ("/sleep", "/wake_up"):
                self._sleep_or_wake(path, query)
            elif path.startswith("/admin/") and not self._local_only():
                return
            elif path == "/admin/drop_kv_cache":
                self._admin_drop_kv()
            elif path == "/admin/restore_kv_cache":
                self.server.state.engine.restore_kv_cache()
                self.server.state.ready = True
                self._send(200, {"kv_cache_bytes": self.server.state.engine.model.kv_cache_bytes})
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
        if not st.sleep_public and not self._from_this_host():
            self._error(403, "sleep endpoints answer on loopback only (--sleep-endpoints-public to change that)")
            return
        from restartkit.reference.sleep import SleepError
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
            "pid": os.getpid(), "ready": st.ready, "model": st.model_name,
            "phases": st.phases, "requests": st.requests,
            "started_at": st.started_at, "ready_at": st.ready_at,
        }
        if st.sleeper is not None:
            out["sleep"] = {"enabled": True, "level": st.sleeper.level, "last": st.sleeper.last}
        if eng is not None and eng.model is not None:
            out.update(load=eng.load_info, device=str(eng.device), dtype=str(eng.dtype).replace("torch.", ""),
                       reuse_port=getattr(self.server, "reuse_port", False) or st.prepared_mode,
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

    def _completions(self, body: dict) -> None:
        st = self.server.state
        if st.sleeper is not None and st.sleeper.asleep:
            self._error(503, f"the engine is asleep (level {st.sleeper.level}): POST /wake_up first", "unavailable")
            return
        if not st.ready:
            self._error(503, "the engine is not ready (loading, or its KV cache was dropped)", "unavailable")
            return
        t0 = time.perf_counter()
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # the OpenAI client wraps a single prompt in a list
        if isinstance(prompt, str):
            ids = [st.engine.config.bos_token_id] + st.tokenizer.encode(prompt, add_special_tokens=False).ids
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = prompt
        else:
            self._error(400, "prompt must be a string or a list of token ids")
            return
        try:
            max_tokens = int(body.get("max_tokens", 16))
            temperature = float(body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0)
            seed = body.get("seed")
            seed = int(seed) if seed is not None else None
            logprobs = body.get("logprobs")
        except (TypeError, ValueError) as e:
            self._error(400, f"bad parameter: {e}")
            return
        if max_tokens < 1:
            self._error(400, "max_tokens must be at least 1")
            return
        from restartkit.reference.engine import EngineNotReady
        try:
            comp = st.engine.generate(ids, max_tokens, temperature, seed, want_logprobs=logprobs is not None and logprobs is not False)
        except EngineNotReady as e:  # it went to sleep (or dropped its cache) after the check above
            self._error(503, f"the engine is not ready: {e}", "unavailable")
            return
        except ValueError as e:
            self._error(400, str(e))
            return
        st.requests += 1
        text = st.tokenizer.decode(comp.tokens, skip_special_tokens=True)
        choice = {"index": 0, "text": text, "finish_reason": comp.finish_reason,
                  "token_ids": comp.tokens, "prompt_token_ids": comp.prompt_tokens, "logprobs": None}
        if comp.logprobs is not None:
            choice["logprobs"] = {
                "tokens": [st.tokenizer.id_to_token(t) or "" for t in comp.tokens],
                "token_logprobs": comp.logprobs, "top_logprobs": None,
                "text_offset": [0] * len(comp.tokens),
            }
        self._send(200, {
            "id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": st.model_name, "choices": [choice], "system_fingerprint": f"restartkit-ref-{os.getpid()}",
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(comp.tokens),
                      "total_tokens": len(ids) + len(comp.tokens)},
        })
        if "first_request" not in st.phases:  # after a restart, restartkit's readiness probe
            st.phases["first_request"] = round(time.perf_counter() - t0, 4)


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port < 65536:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0..65535)")
    return port


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="restartkit engine serve")
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-rank", type=int, default=0)
    p.add_argument("--enable-expert-parallel", action="store_true")
    p.add_argument("--quantization", default="none", choices=["none", "int8"])
    p.add_argument("--revision", default="")
    p.add_argument("--load-format", default="disk", choices=["disk", "ipc_cache"])
    p.add_argument("--ipc-config", default="{}", help="JSON: mode, fallback, connect_timeout_s, state_timeout_s, socket_dir")
    p.add_argument("--dist-port", type=int, default=0, help="rank 0's rendezvous port (tensor parallel)")
    p.add_argument("--worker-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--reuse-port", action="store_true", help="SO_REUSEPORT on the public port (overlapped restarts)")
    p.add_argument("--prepare-only", action="store_true",
                   help="prepare (imports, device, weights), then wait for SIGUSR1 before taking the device and the port")
    p.add_argument("--status-file", default=None, help="JSON state for the supervisor (prepare-only mode)")
    p.add_argument("--activate-timeout", type=float, default=300.0)
    p.add_argument("--enable-sleep-mode", action="store_true", help="POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping")
    p.add_argument("--sleep-endpoints-public", action="store_true", help="answer sleep endpoints off loopback too")
    p.add_argument("--draft-model", default="", help="a draft checkpoint: greedy requests decode speculatively")
    p.add_argument("--num-speculative-tokens", type=int, default=3, help="draft tokens proposed per round")
    args = p.parse_args(argv)
    if args.draft_model:
        if args.enable_sleep_mode:
            p.error("--draft-model cannot be combined with --enable-sleep-mode")
        if args.num_speculative_tokens < 1:
            p.error("--num-speculative-tokens must be at least 1")
    try:
        args.ipc = json.loads(args.ipc_config)
        if not isinstance(args.ipc, dict):
            raise ValueError("not an object")
    except ValueError as e:
        p.error(f"--ipc-config is not a JSON object: {e}")
    return args


def serve(args: argparse.Namespace) -> int:
    global _READY_FD
    _READY_FD = os.environ.get("RESTARTKIT_READY_FD")
    if args.worker_rank > 0:
        return serve_worker(args)
    if args.prepare_only:
        return serve_prepared(args)
    # Bind first: a port in use is reported before minutes of loading.
    state = State(args.served_model_name or os.path.basename(os.path.normpath(args.model)))
    try:
        server = EngineServer((args.host, args.port), state, reuse_port=args.reuse_port)
    except OSError as e:
        log(f"cannot listen on {args.host}:{args.port}: {e.strerror}")
        return 98 if e.errno == 98 else 1
    # Signals are blocked in every thread and taken by the main thread alone,
    # with sigtimedwait: handlers do nothing, the loop below acts.
    block_stop_signals()
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    log(f"listening on http://{args.host}:{server.server_address[1]} (loading {args.model})")
    workers = spawn_workers(args) if args.tensor_parallel_size > 1 else []
    outcome: dict = {}
    loader = threading.Thread(target=_load, args=(args, state, outcome), daemon=True)
    loader.start()
    while True:
        signo = next_stop_signal(0.2)
        if signo is not None:
            break
        if "error" in outcome:
            log(f"start failed: {outcome['error']}")
            server.shutdown()
            _stop_workers(workers)
            return 1
        dead = [w for w in workers if w.poll() is not None]
        if dead:
            log(f"tensor-parallel worker PID {dead[0].pid} exited with code {dead[0].returncode}; stopping")
            server.shutdown()
            _stop_workers(workers)
            os._exit(1)  # rank 0 may be blocked in a collective with the dead rank
    log(f"received {signal.Signals(signo).name}; finishing in-flight requests")
    state.ready = False
    # Close the listener first: connections queued on it would wait for
    # nothing (with SO_REUSEPORT the other engine takes new ones at once).
    server.shutdown()
    server.server_close()
    left = state.drain()
    if state.engine is not None:
        state.engine.shutdown_workers()
    _stop_workers(workers)
    log("stopped" + (f" ({left} requests still in flight after 30 s)" if left else ""))
    return 0


def spawn_workers(args) -> list:
    """Ranks 1..tp-1 as child processes that die with this one."""
    import subprocess
    if not args.dist_port:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.dist_port = s.getsockname()[1]
    base = [sys.executable, "-m", "restartkit.reference.server"] + _rebuild_argv(args)
    procs = []
    for rank in range(1, args.tensor_parallel_size):
        env = {k: v for k, v in os.environ.items() if k != "RESTARTKIT_READY_FD"}  # the ready pipe is rank 0's
        procs.append(subprocess.Popen(base + ["--worker-rank", str(rank)], env=env, preexec_fn=_die_with_parent))
    return procs


def _rebuild_argv(args) -> list[str]:
    out = ["--model", args.model, "--device", args.device, "--max-model-len", str(args.max_model_len),
           "--tensor-parallel-size", str(args.tensor_parallel_size), "--quantization", args.quantization,
           "--data-parallel-size", str(args.data_parallel_size), "--data-parallel-rank", str(args.data_parallel_rank),
           "--load-format", args.load_format, "--ipc-config", json.dumps(args.ipc), "--dist-port", str(args.dist_port),
           "--threads", str(args.threads), "--revision", args.revision]
    if args.dtype:
        out += ["--dtype", args.dtype]
    if args.enable_expert_parallel:
        out.append("--enable-expert-parallel")
    if args.no_cuda_graph:
        out.append("--no-cuda-graph")
    if args.draft_model:
        out += ["--draft-model", args.draft_model, "--num-speculative-tokens", str(args.num_speculative_tokens)]
    return out


def _die_with_parent() -> None:
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


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
    _start_engine(engine, args)
    engine.worker_loop()
    return 0


def _make_engine(args, draft: bool = False):
    """This rank's engine for the model, or for the draft model (no CUDA graph: speculative decoding runs it)."""
    from restartkit.reference.engine import Engine, EngineOptions

    rank = args.worker_rank
    opts = EngineOptions(model=args.draft_model if draft else args.model, device=args.device, dtype=args.dtype,
                         max_model_len=args.max_model_len, cuda_graph=not (args.no_cuda_graph or draft),
                         tp_size=args.tensor_parallel_size, tp_rank=rank,
                         expert_parallel=args.enable_expert_parallel, quantization=args.quantization,
                         dist_init=f"tcp://127.0.0.1:{args.dist_port}")
    return Engine(opts)


def _start_engine(engine, args, gate=None) -> None:
    """Start with weights from disk or from the weight cache; `gate`, when
    given, runs between preparing and activating (an overlapped restart).
    The engine this one replaces may still be tearing down: device memory is
    allocated only after it has exited (weights mapped zero_copy from the
    weight cache take none, so they attach before that wait)."""
    from restartkit.reference.handover import wait_for_previous_engine

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

    def weights():
        o = engine.options
        dtype_name = str(engine.dtype).replace("torch.", "")
        global_rank = args.data_parallel_rank * o.tp_size + o.tp_rank
        uuid = device_uuid(str(engine.device) if engine.device.type == "cuda" else "cpu", global_rank)
        fp = fingerprint(o.model, tp_size=o.tp_size, tp_rank=o.tp_rank, dp_size=args.data_parallel_size,
                         dp_rank=args.data_parallel_rank, expert_parallel=o.expert_parallel, dtype=dtype_name,
                         quantization=o.quantization, revision=args.revision, draft=is_draft)
        attach(engine, args.ipc, uuid, fp, draft=is_draft)
    return weights


def _prepare_draft(engine, draft, weights=None) -> None:
    from restartkit.reference.layout import draft_problem
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
    state = State(args.served_model_name or os.path.basename(os.path.normpath(args.model)))
    state.prepared_mode = True
    private = EngineServer(("127.0.0.1", 0), state)
    admin_port = private.server_address[1]
    signals = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    threading.Thread(target=private.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    _write_status(args.status_file, state="preparing", admin_port=admin_port)
    log(f"preparing (private port {admin_port}); the public port {args.port} is taken on activation")
    outcome: dict = {}
    activate = threading.Event()

    def gate():
        _write_status(args.status_file, state="prepared", admin_port=admin_port, phases=state.phases)
        log("prepared; waiting for SIGUSR1 to activate")
        if not activate.wait(args.activate_timeout):
            raise TimeoutError(f"not activated within {args.activate_timeout:.0f} s")

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
        if "error" in outcome:
            log(f"start failed: {outcome['error']}")
            _write_status(args.status_file, state="failed", admin_port=admin_port, error=outcome["error"])
            return 1
        if state.ready and publish and public is None:
            try:
                public = EngineServer((args.host, args.port), state, reuse_port=True)
            except OSError as e:
                _write_status(args.status_file, state="failed", admin_port=admin_port,
                              error=f"cannot listen on {args.host}:{args.port}: {e.strerror}")
                return 98
            threading.Thread(target=public.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
            _write_status(args.status_file, state="ready", admin_port=admin_port, phases=state.phases)
            log(f"active: listening on http://{args.host}:{args.port} too")
    log(f"received {signal.Signals(signo).name}; finishing in-flight requests")
    state.ready = False
    for srv in (public, private):
        if srv is not None:
            srv.shutdown()
            srv.server_close()
    state.drain()
    log("stopped")
    return 0


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
        state.phases["tokenizer"] = round(time.perf_counter() - t0, 4)
        _start_engine(engine, args, gate)
    except Exception as e:
        outcome["error"] = f"{type(e).__name__}: {e}"
        return
    state.engine = engine
    if args.enable_sleep_mode:
        if args.tensor_parallel_size > 1:
            outcome["error"] = "sleep mode is supported at tensor_parallel_size 1 only"
            return
        from restartkit.reference.sleep import Sleeper
        state.sleeper = Sleeper(engine)
        state.sleep_public = args.sleep_endpoints_public
    state.phases.update(engine.phases)
    state.phases["ready_since_spawn"] = round(_since_exec(), 4)
    state.ready_at = time.time()
    state.ready = True
    log(f"ready in {state.ready_at - state.started_at:.2f} s; phases {json.dumps(state.phases)}")
    _signal_ready()


def _signal_ready() -> None:
    """Tell restartkit at once (one byte on the pipe it passed), then close the pipe: a
    snapshot of this process must not hold a pipe whose other end is outside it."""
    global _READY_FD
    fd, _READY_FD = _READY_FD, None
    if not fd:
        return
    try:
        os.write(int(fd), b"R")
    except (OSError, ValueError):  # restartkit stopped listening (or the fd is not ours): it probes anyway
        pass
    finally:
        try:
            os.close(int(fd))
        except (OSError, ValueError):
            pass


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


def main(argv=None) -> int:
    return serve(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
