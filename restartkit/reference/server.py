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

PROCESS_T0 = time.time()
MAX_BODY = 1 << 20


def log(msg: str) -> None:
    print(f"[engine {os.getpid()}] {msg}", file=sys.stderr, flush=True)


class EngineServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr, engine_state):
        super().__init__(addr, Handler)
        self.state = engine_state


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
    def do_GET(self):
        path = urlparse(self.path).path
        st = self.server.state
        if path == "/health":
            if st.ready:
                self._send(200, {"status": "ready"})
            else:
                self._send(503, {"status": "loading"})
        elif path == "/v1/models":
            self._send(200, {"object": "list", "data": [
                {"id": st.model_name, "object": "model", "created": int(st.started_at), "owned_by": "restartkit"}]})
        elif path == "/admin/stats":
            self._send(200, self._stats())
        else:
            self._error(404, f"no route {path}")

    def do_POST(self):
        parsed = urlparse(self.path)
        path, query = parsed.path, parse_qs(parsed.query)
        body = self._body()
        if body is None:
            return
        try:
            if path == "/v1/completions":
                self._completions(body)
            elif path == "/admin/drop_kv_cache":
                self._admin_drop_kv()
            elif path == "/admin/restore_kv_cache":
                self.server.state.engine.restore_kv_cache()
                self._send(200, {"kv_cache_bytes": self.server.state.engine.model.kv_cache_bytes})
            else:
                self._error(404, f"no route {path}")
        except Exception as e:  # one bad request must not take the engine down
            log(f"error on {path}: {type(e).__name__}: {e}")
            self._error(500, f"{type(e).__name__}: {e}", "server_error")

    def _stats(self) -> dict:
        st = self.server.state
        eng = st.engine
        out = {
            "pid": os.getpid(), "ready": st.ready, "model": st.model_name,
            "phases": st.phases, "requests": st.requests,
            "started_at": st.started_at, "ready_at": st.ready_at,
        }
        if eng is not None and eng.model is not None:
            out.update(load=eng.load_info, device=str(eng.device), dtype=str(eng.dtype).replace("torch.", ""),
                       weight_bytes=eng.weight_bytes(), kv_cache_bytes=eng.model.kv_cache_bytes,
                       cuda_graph=eng._graph is not None)
        try:
            import psutil
            out["rss_bytes"] = psutil.Process().memory_info().rss
        except ImportError:
            pass
        return out

    def _admin_drop_kv(self):
        eng = self.server.state.engine
        self.server.state.ready = False
        freed = eng.drop_kv_cache()
        self._send(200, {"freed_bytes": freed})

    def _completions(self, body: dict) -> None:
        st = self.server.state
        if not st.ready:
            self._error(503, "the engine is not ready (loading, or its KV cache was dropped)", "unavailable")
            return
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
        try:
            comp = st.engine.generate(ids, max_tokens, temperature, seed, want_logprobs=logprobs is not None and logprobs is not False)
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
            "model": st.model_name, "choices": [choice],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(comp.tokens),
                      "total_tokens": len(ids) + len(comp.tokens)},
        })


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="restartkit engine serve")
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    return p.parse_args(argv)


def serve(args: argparse.Namespace) -> int:
    # Bind first: a port in use is reported before minutes of loading.
    state = State(args.served_model_name or os.path.basename(os.path.normpath(args.model)))
    try:
        server = EngineServer((args.host, args.port), state)
    except OSError as e:
        log(f"cannot listen on {args.host}:{args.port}: {e.strerror}")
        return 98 if e.errno == 98 else 1
    # Signals are blocked in every thread and taken by the main thread alone,
    # with sigtimedwait: handlers do nothing, the loop below acts.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    log(f"listening on http://{args.host}:{server.server_address[1]} (loading {args.model})")
    outcome: dict = {}
    loader = threading.Thread(target=_load, args=(args, state, outcome), daemon=True)
    loader.start()
    while True:
        info = signal.sigtimedwait({signal.SIGTERM, signal.SIGINT}, 0.2)
        if info is not None:
            break
        if "error" in outcome:
            log(f"start failed: {outcome['error']}")
            server.shutdown()
            return 1
    log(f"received {signal.Signals(info.si_signo).name}; finishing in-flight requests")
    state.ready = False
    server.shutdown()
    if state.engine is not None:
        with state.engine.lock:  # wait for the request in flight
            pass
    server.server_close()
    log("stopped")
    return 0


def _load(args, state: State, outcome: dict) -> None:
    try:
        state.phases["process_start"] = round(_since_exec(), 4)
        t0 = time.perf_counter()
        import torch  # the heavy import, timed as its own phase
        state.phases["import_torch"] = round(time.perf_counter() - t0, 4)
        if args.threads:
            torch.set_num_threads(args.threads)
        from tokenizers import Tokenizer

        from restartkit.reference.engine import Engine, EngineOptions

        opts = EngineOptions(model=args.model, device=args.device, dtype=args.dtype,
                             max_model_len=args.max_model_len, cuda_graph=not args.no_cuda_graph)
        engine = Engine(opts)
        state.tokenizer = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
        engine.start()
    except Exception as e:
        outcome["error"] = f"{type(e).__name__}: {e}"
        return
    state.engine = engine
    state.phases.update(engine.phases)
    state.ready_at = time.time()
    state.ready = True
    log(f"ready in {state.ready_at - state.started_at:.2f} s; phases {json.dumps(state.phases)}")


def _since_exec() -> float:
    """Seconds from exec until now (interpreter start-up and our imports)."""
    try:
        import psutil
        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:
        return 0.0


def main(argv=None) -> int:
    return serve(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
