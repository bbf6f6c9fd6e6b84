"""restartkit's launcher for vLLM's OpenAI API server:
`python -m restartkit.engines.vllm_serve [restartkit's flags] <vllm serve flags>`.

It builds vLLM's engine and app through vLLM's own functions and serves them on a listening
socket it is given (`--listen-fd N`: the service's socket, held by supervise, so that no engine's
death refuses a connection) or binds the service's port itself, as vLLM does.  Beside vLLM's
routes it serves restartkit's admin calls, to loopback clients only, in place of vLLM's dev-mode
/collective_rpc (which is not needed and stays off):
  GET  /admin/stats             what the engine loaded its weights from (every rank), its phases
  POST /admin/release_weights   free the weights and the KV cache before a weights-less dump
  POST /admin/reattach_weights  load them from the weight cache again after the restore
The workers do the work (restartkit.engines.vllm_ext.Worker, called through the engine client).

`--prepare-only --status-file F` makes a standby: the engine built, its weights loaded, one forward
pass run, the whole API on a private loopback port and nothing on the service's.  SIGUSR1: active
(vLLM's KV cache exists from the start: nothing to do); SIGUSR2: it serves on the service's socket
and closes the private port.  Its states go to F as the reference engine's do (preparing, prepared,
active, ready, failed).
"""
import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from restartkit.engines.vllm_seams import resolve

LOOPBACK = ("127.0.0.1", "::1", "localhost")
_flags = {"usr1": False, "usr2": False}


def _on_usr(signo, _frame) -> None:
    _flags["usr1" if signo == signal.SIGUSR1 else "usr2"] = True


def own_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--listen-fd", type=int)
    p.add_argument("--prepare-only", action="store_true")
    p.add_argument("--status-file")
    p.add_argument("--activate-timeout", type=float, default=600.0)
    p.add_argument("--activate-ahead", action="store_true")
    return p


def _status(own, **data) -> None:
    if own.status_file:
        from restartkit.files import write_json_atomic
        write_json_atomic(Path(own.status_file), {"pid": os.getpid(), "at": time.time(), **data})


def _log(msg: str) -> None:
    print(f"[restartkit vllm_serve {os.getpid()}] {msg}", flush=True)


class Admin:
    """restartkit's calls into the engine, served to loopback clients only."""

    def __init__(self, client, args, phases: dict, held: bool):
        self.client, self.args, self.phases, self.held = client, args, phases, held
        self.lock = asyncio.Lock()

    async def load_info(self) -> dict:
        ranks = await self.client.collective_rpc("rk_load_info")
        first = dict(ranks[0]) if ranks else {}
        first["ranks"] = [r.get("ipc") for r in ranks]
        if not first.get("ipc"):
            first.update(source="disk", ipc=None)
        return first

    async def stats(self) -> dict:
        from vllm import __version__
        return {"engine": "vllm", "version": __version__, "load": await self.load_info(), "phases": self.phases,
                "held_socket": self.held, "pid": os.getpid()}

    async def release(self) -> dict:
        async with self.lock:
            await self.client.reset_prefix_cache()  # the KV cache's contents are gone after a release
            answers = await self.client.collective_rpc("rk_release")
        return {k: sum(a.get(k, 0) for a in answers) for k in answers[0]}

    async def reattach(self, extra: dict) -> dict:
        async with self.lock:
            answers = await self.client.collective_rpc("rk_reattach", args=(json.dumps(extra),))
            await self.client.reset_prefix_cache()
        load = dict(answers[0])
        load["ranks"] = [a.get("ipc") for a in answers]
        return {"load": load}

    def routes(self, app) -> None:
        # (no `from __future__ import annotations` in this module: FastAPI reads `Request` from the annotations)
        from fastapi import Request
        from fastapi.responses import JSONResponse, Response

        def loopback_only(request: Request):
            if not admin_allowed(request.headers, request.client.host if request.client else ""):
                return JSONResponse({"error": "restartkit's admin calls answer restartkit only (its admin token)"},
                                    status_code=403)
            return None

        # vLLM built its app (and Starlette its middleware stack) before these routes: the stack is made again,
        # with this one in it, at the first request (none has come yet)
        app.middleware_stack = None

        from restartkit.guard import peer
        owners = peer.owners()  # behind supervise's front: its owner's connections only (restartkit.guard.peer)

        @app.middleware("http")
        async def keyed_dev_routes(request: Request, call_next):
            """vLLM's dev-mode routes (on only where restartkit needs sleep mode) answer restartkit's calls only;
            behind the front, every route answers the engine's user (and root) only."""
            if owners is not None and request.client and request.scope.get("server"):
                if (uid := peer.client_uid(request.client, request.scope["server"])) not in owners:
                    return Response(peer.refusal_body(uid, request.scope["server"][1]),
                                    status_code=403, media_type="application/json")
            if request.url.path in DEV_ROUTES and not admin_allowed(request.headers, request.client.host
                                                                   if request.client else ""):
                return JSONResponse({"error": f"{request.url.path} answers restartkit's calls only (its admin "
                                              "token)"}, status_code=403)
            return await call_next(request)

        async def stats(request: Request):
            return loopback_only(request) or JSONResponse(await self.stats())

        async def release(request: Request):
            return loopback_only(request) or JSONResponse(await self.release())

        async def reattach(request: Request):
            if denied := loopback_only(request):
                return denied
            body = await request.json() if int(request.headers.get("content-length") or 0) else {}
            try:
                return JSONResponse(await self.reattach(body.get("loader") or _loader_config(self.args)))
            except Exception as e:
                return JSONResponse({"error": f"{type(e).__name__}: {e}"}, status_code=500)

        app.add_api_route("/admin/stats", stats, methods=["GET"])
        app.add_api_route("/admin/release_weights", release, methods=["POST"])
        app.add_api_route("/admin/reattach_weights", reattach, methods=["POST"])


# vLLM's routes under VLLM_SERVER_DEV_MODE=1 (engine methods, sleep, caches, its configuration): keyed here
DEV_ROUTES = ("/collective_rpc", "/sleep", "/wake_up", "/is_sleeping", "/server_info", "/reset_prefix_cache",
              "/reset_mm_cache", "/reset_encoder_cache", "/update_weights", "/pause", "/resume", "/is_paused")


def admin_allowed(headers, client_host: str) -> bool:
    """restartkit's admin token (and the API key, when vLLM has one) where restartkit started the engine with one;
    a launcher run by hand without one answers loopback clients only."""
    import hmac
    from restartkit.guard.admin import ADMIN_HEADER, ADMIN_TOKEN_ENV
    token = os.environ.get(ADMIN_TOKEN_ENV)
    if not token:
        return client_host in LOOPBACK
    key = os.environ.get("VLLM_API_KEY")
    key_ok = not key or hmac.compare_digest((headers.get("authorization") or "").encode(), f"Bearer {key}".encode())
    return key_ok and hmac.compare_digest((headers.get(ADMIN_HEADER) or "").encode(), token.encode())


def _loader_config(args) -> dict:
    """The load format's config this engine was started with (a re-attach uses the same cache)."""
    raw = getattr(args, "model_loader_extra_config", None) or {}
    return json.loads(raw) if isinstance(raw, str) else dict(raw)


async def _app(client, args, admin: Admin):
    tasks = await client.get_supported_tasks()
    app = resolve("build_app")(args, tasks, client.model_config)
    await resolve("init_app_state")(client, app.state, args, tasks)
    admin.routes(app)
    return app


async def _serve_public(client, args, sock: socket.socket, admin: Admin):
    """vLLM's own serving loop (its signal handling, drain and watchdog) on `sock`, until it stops."""
    import vllm.envs as envs
    app = await _app(client, args, admin)
    return await resolve("serve_http")(app, sock=sock, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            access_log=not args.disable_uvicorn_access_log,
                            timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE)


async def _first_forward(client) -> None:
    from vllm import SamplingParams
    async for _ in client.generate("ready", SamplingParams(max_tokens=1, temperature=0.0), request_id="restartkit-warmup"):
        pass


async def _wait_flag(name: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not _flags[name]:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def _prepared(client, args, own, admin: Admin, given: socket.socket | None, phases: dict):
    """A standby: the API on a private port until SIGUSR1 and SIGUSR2, then on the service's socket."""
    import uvicorn

    from restartkit.engines.vllm_seams import no_signal_server
    create_server_socket = resolve("create_server_socket")
    private_sock = create_server_socket(("127.0.0.1", 0), reuse_port=False)
    port = private_sock.getsockname()[1]
    private = no_signal_server(uvicorn.Config(await _app(client, args, admin), log_level="warning", access_log=False))
    private_task = asyncio.create_task(private.serve(sockets=[private_sock]))
    while not private.started and not private_task.done():  # prepared once its private port answers: a canary
        await asyncio.sleep(0.01)                           # asked ahead must not find it refusing
    _status(own, state="prepared", admin_port=port, phases=phases)
    _log(f"prepared (private port {port}); waiting for SIGUSR1")
    if not (own.activate_ahead or await _wait_flag("usr1", own.activate_timeout)):
        _status(own, state="failed", admin_port=port, error=f"not activated within {own.activate_timeout:.0f} s")
        return None
    _status(own, state="active", admin_port=port, phases=phases)
    await _wait_flag("usr2", float("inf"))
    try:
        public = given or create_server_socket((args.host or "", args.port), reuse_port=True)
    except OSError as e:
        _status(own, state="failed", admin_port=port, error=f"cannot listen on {args.host}:{args.port}: {e.strerror}")
        return None
    public.listen(4096)  # queued from now on, accepted once vLLM's loop runs (it listens again, harmlessly)
    serving = asyncio.create_task(_serve_public(client, args, public, admin))
    await asyncio.sleep(0)
    private.should_exit = True  # promoted: it listens where the service does and nowhere else
    await private_task
    private_sock.close()
    _status(own, state="ready", phases=phases)
    _log(f"promoted: serving on the service's socket ({args.host}:{args.port}), the private port closed")
    return await serving


async def serve(own, args) -> int:
    build_async_engine_client, create_server_socket = resolve("build_async_engine_client"), \
        resolve("create_server_socket")
    given = socket.socket(fileno=own.listen_fd) if own.listen_fd is not None else None
    if given is not None:
        given.set_inheritable(False)  # vLLM's engine processes never accept
    public = given
    if public is None and not own.prepare_only:  # as vLLM does: the port is taken before the engine is built
        public = create_server_socket((args.host or "", args.port), reuse_port=False)
    _status(own, state="preparing")
    phases: dict[str, float] = {}
    t0 = time.monotonic()
    async with build_async_engine_client(args) as client:
        phases["engine"] = round(time.monotonic() - t0, 3)
        t1 = time.monotonic()
        await _first_forward(client)
        phases["first_forward"] = round(time.monotonic() - t1, 3)
        admin = Admin(client, args, phases, held=given is not None)
        if own.prepare_only:
            shutdown = await _prepared(client, args, own, admin, given, phases)
        else:
            _log(f"engine ready in {phases['engine']:.1f} s; serving" + (" on the held socket" if given else ""))
            shutdown = await _serve_public(client, args, public, admin)
    if shutdown is None:
        return 1
    await shutdown
    return 0


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGUSR1, _on_usr)  # before anything slow: a promotion may come while vLLM builds
    signal.signal(signal.SIGUSR2, _on_usr)
    own, rest = own_parser().parse_known_args(argv)

    def interrupt(*_):
        raise KeyboardInterrupt("terminated")
    signal.signal(signal.SIGTERM, interrupt)  # until vLLM's serving loop installs its own
    from restartkit.engines.vllm_seams import configure_logging
    resolve("cli_env_setup")()
    args = resolve("make_arg_parser")(resolve("FlexibleArgumentParser")(prog="restartkit-vllm-serve")).parse_args(rest)
    configure_logging(args)
    resolve("validate_parsed_serve_args")(args)
    import uvloop
    try:
        return uvloop.run(serve(own, args))
    except KeyboardInterrupt:
        return 0
    except Exception as e:
        _status(own, state="failed", error=f"{type(e).__name__}: {e}")
        raise


if __name__ == "__main__":
    sys.exit(main())
